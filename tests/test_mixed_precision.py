"""Mixed precision (bf16 autocast, float32 master weights) and compiled layer regions.

The kernels follow `torch.autocast` (runtime/precision.py): a parallelized module
trained under autocast matches the plain module trained under autocast to bfloat16's
accuracy, its parameters and gradients stay float32. Compiled regions
(runtime/regions.py) change no result: in float64 they equal the uncompiled
program, as one graph per repeat with no graph break. A long RoPE table in float32
(2048 positions) is still recognised as the rope op (it was a replicated constant).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

import fivedc
from fivedc.frontends.python_file import import_file
from fivedc.parallel.check import check_module, compare, train_module

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
llama = import_file(EXAMPLES / "llama.py")


def small_llama(dtype=torch.float32, seq: int = 32, layers: int = 2):
    args = llama.ModelArgs(dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=172,
                           max_seq_len=seq)
    return llama.factory(batch=2, args=args, dtype=dtype)


def test_autocast_trains_like_the_plain_module_under_autocast() -> None:
    module, inputs = small_llama()
    plain = copy.deepcopy(module)
    model = fivedc.parallelize(module, mesh="1x1x1x1x1", example_inputs=inputs)
    report = compare(train_module(plain, inputs, steps=1, autocast="bf16"),
                     train_module(model, inputs, steps=1, autocast="bf16"))
    assert report.loss_error < 3e-4 and report.grad_error < 3e-2, report
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(*inputs)
    full = train_module(copy.deepcopy(plain), inputs, steps=1)  # float32: autocast did change the numbers
    assert loss.dtype == torch.float32 and abs(loss.item() - full.losses[0]) > 1e-5


def test_autocast_under_tensor_and_sequence_parallelism(worker_pool) -> None:
    report = check_module(f"{EXAMPLES / 'llama.py'}:factory", kwargs={"dtype": torch.float32}, mesh="2x1x2x1x1",
                          steps=1, autocast="bf16", pool=worker_pool, sequence_parallel=True)
    assert report.loss_error < 1e-3 and report.grad_error < 5e-2, report


def test_compiled_regions_compute_what_the_program_does() -> None:
    from torch._dynamo.utils import counters

    module, inputs = small_llama(torch.float64, layers=3)
    eager = fivedc.parallelize(copy.deepcopy(module), mesh="1x1x1x1x1", example_inputs=inputs)
    counters.clear()
    compiled = fivedc.parallelize(module, mesh="1x1x1x1x1", example_inputs=inputs, compile="aot_eager")
    report = compare(train_module(eager, inputs), train_module(compiled, inputs))
    assert report.max_error <= 1e-12, report
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_a_long_float32_rope_table_is_the_rope_op() -> None:
    from fivedc.ir.graph import Op, walk_ops
    from fivedc.ir.mesh import Mesh
    from fivedc.parallel.parallelize import compile_module

    module, inputs = small_llama(seq=2048)
    _, plan = compile_module(module, inputs, mesh=Mesh.parse("1x1x1x1x1"))
    kinds = [op.kind for op, _ in walk_ops(plan.graph.body) if isinstance(op, Op)]
    assert kinds.count("rope") == 2 and "aten" not in kinds
