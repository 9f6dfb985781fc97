"""`fivedc.parallelize(module, fp8=True)`: the module's linears run in float8 (torchao's tensorwise recipe).

The parallel module is checked against a single-device float8 reference built here from the
plain module: its linears that torchao converts (not the output head) replaced by the
recipe's matmuls (`fivedc.runtime.fp8.Fp8Linear`), each data-parallel rank's rows scaled
apart as the parallel run scales them (`reference_blocks`). In float64 the two agree to
reassociation; the loss differs from the module without float8, so an option silently
dropped fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fivedc
from fivedc.errors import FivedcError
from fivedc.ir.graph import Op, walk_ops
from fivedc.passes.fp8 import is_fp8
from fivedc.runtime.fp8 import E4M3, E5M2, Fp8Cast, Fp8Linear, Operand, reference_blocks

HERE = str(Path(__file__).resolve())
TOL = 1e-10


class Mlp(nn.Module):
    """Two float8-eligible linears (features multiples of 16) and an output head (never float8)."""

    def __init__(self, hidden: int = 32, ffn: int = 64, vocab: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = x + self.down(F.gelu(self.up(x)))
        return F.cross_entropy(self.head(h).view(-1, self.head.out_features), targets.view(-1))


def make_mlp(seed: int = 0):
    torch.manual_seed(seed)
    module = Mlp().double()
    gen = torch.Generator().manual_seed(seed + 1)
    inputs = (torch.randn(4, 8, 32, generator=gen, dtype=torch.float64), torch.randint(0, 16, (4, 8), generator=gen))
    return module, inputs


def float8_reference(module: Mlp, inputs, *, blocks: int) -> tuple[float, dict]:
    """The plain module's loss and gradients with `up` and `down` in float8 (the head not),
    the batch's rows scaled in `blocks` blocks."""
    cast = Fp8Cast(Operand(E4M3, batch=0, blocks=blocks), Operand(E4M3), Operand(E5M2, batch=0, blocks=blocks))
    float8 = lambda linear: lambda x: Fp8Linear.apply(x, linear.weight.T, 1, cast)  # noqa: E731
    module.up.forward, module.down.forward = float8(module.up), float8(module.down)
    module.zero_grad()
    loss = module(*inputs)
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in module.named_parameters()}


def _max_error(grads: dict, reference: dict) -> float:
    return max(((grads[k] - g).abs().max() / g.abs().max()).item() for k, g in reference.items())


def _float8_linears(model) -> dict[str, bool]:
    graph = model.fivedc_plan.graph
    return {op.args[1]: is_fp8(op) for op, _ in walk_ops(graph.body) if isinstance(op, Op) and op.kind == "linear"}


def test_one_rank_runs_the_float8_reference() -> None:
    module, inputs = make_mlp()
    model = fivedc.parallelize(module, mesh="1x1x1x1x1", example_inputs=inputs, fp8=True)
    assert model.fivedc_plan.fp8 and sorted(_float8_linears(model).values()) == [False, True, True]
    loss = model(*inputs)
    loss.backward()
    grads = model.full_grads()
    reference, reference_grads = float8_reference(make_mlp()[0], inputs, blocks=reference_blocks(model.fivedc_plan))
    assert loss.item() == pytest.approx(reference, rel=1e-12)
    assert _max_error(grads, reference_grads) <= 1e-12
    plain = fivedc.parallelize(make_mlp()[0], mesh="1x1x1x1x1", example_inputs=inputs)
    assert not plain.fivedc_plan.fp8
    assert abs(plain(*inputs).item() - loss.item()) > 1e-6  # float8 changes the numbers: the option was not dropped


def mesh_job(info, payload) -> dict:
    """One rank: the module parallelized on `mesh` with and without float8, one forward and backward each."""
    mesh = payload
    out = {}
    for fp8 in (True, False):
        module, inputs = make_mlp()
        model = fivedc.parallelize(module, mesh=mesh, example_inputs=inputs, fp8=fp8)
        loss = model(*inputs)
        loss.backward()
        out[fp8] = (loss.item(), model.full_grads(), model.fivedc_plan)
    return out if info.rank == 0 else {}


@pytest.mark.parametrize("mesh", ["2x1x2x1x1"])
def test_a_mesh_runs_the_float8_reference(mesh: str, worker_pool) -> None:
    out = worker_pool.run(mesh_job, world=4, payload=mesh)[0]
    loss, grads, plan = out[True]
    assert plan.fp8 and any(c.reason.startswith("fp8:") for c in plan.collectives)  # amax over tp
    reference, reference_grads = float8_reference(make_mlp()[0], make_mlp()[1], blocks=reference_blocks(plan))
    assert reference_blocks(plan) == 2  # each dp rank's rows scale apart
    assert abs(loss - reference) <= TOL * abs(reference)
    assert _max_error(grads, reference_grads) <= TOL
    assert abs(out[False][0] - loss) > 1e-6  # without float8 the loss is another


def test_mesh_auto_searches_with_float8_linears() -> None:
    from fivedc.parallel.parallelize import search_module

    module, inputs = make_mlp()
    _, plan = search_module(module, inputs, gpus=2, gpu="h100", fp8=True)
    assert plan.fp8 and plan.mesh.world == 2
    _, bf16 = search_module(make_mlp()[0], inputs, gpus=2, gpu="h100")
    assert not bf16.fp8
    with pytest.raises(FivedcError, match="no float8 tensor cores"):
        fivedc.parallelize(make_mlp()[0], mesh="auto", gpus=2, gpu="a100", example_inputs=inputs, fp8=True)
