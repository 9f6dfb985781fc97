"""Models written by others, second source: torchtitan and torchtune decoders of
`examples/titan_tune_models.py` (built from the libraries themselves, tiny configs,
random weights, no downloads; its docstring says how to install them without moving torch).

The rule of tests/test_hf_models.py (tests/library_models.py): each is held to its measured row
of docs/compatibility.md, verifying on one rank in float64 and compiling at dp2·tp2, or stopping
with the table's error. By default a few, one per distinct path (`IN_EVERY_RUN`), so that the
suite stays within its time; `--all-library-models` runs every one. CI installs both libraries
(.ci/run); elsewhere, without them, this file is skipped.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")  # optional (not in the `test` extra): README, "Models written by others"
pytest.importorskip("torchtune")

from fivedc.cli.main import load_graph  # noqa: E402
from library_models import assert_as_the_table_says  # noqa: E402

ARCHITECTURES = (
    "titan_llama3", "titan_llama3_sdpa", "titan_qwen3", "titan_qwen3_sdpa", "titan_qwen3_moe_sdpa",
    "titan_deepseek_v3", "titan_deepseek_v3_sdpa",
    "tune_llama2", "tune_llama3", "tune_llama3_2", "tune_qwen2", "tune_mistral", "tune_phi3", "tune_gemma",
    "tune_gemma2",
)


# run in every suite, one per path (the others with --all-library-models): torchtitan's Llama with SDPA
# (its FlexAttention one trains below), its MoE, torchtune's Llama
IN_EVERY_RUN = ("titan_llama3_sdpa", "titan_qwen3_moe_sdpa", "tune_llama2")


def pytest_generate_tests(metafunc) -> None:
    if "arch" in metafunc.fixturenames:  # the others are not collected (no test skipped in every run)
        metafunc.parametrize("arch", ARCHITECTURES if metafunc.config.getoption("--all-library-models")
                             else IN_EVERY_RUN)


def test_a_library_model_verifies_or_stops_as_the_table_says(arch: str) -> None:
    assert_as_the_table_says(f"examples/titan_tune_models.py:{arch}", arch, mesh="2x1x2x1x1")


def test_the_examples_list_every_architecture() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("titan_tune_models", "examples/titan_tune_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.ARCHITECTURES == ARCHITECTURES
    assert all(callable(getattr(module, arch)) for arch in ARCHITECTURES)


def test_torchtitans_default_llama3_with_flex_attention_trains_as_one_device(worker_pool) -> None:
    """torchtitan's llama3 with its default attention, a compiled flex_attention over a compiled
    document block mask (fivedc/frontends/fx/flex.py): each layer's attention is the IR's causal
    attention, nothing runs replicated, and it trains as on one device (the reference: torch's
    eager flex_attention op, in float64) under cp2 and pp2 with 1F1B."""
    from fivedc.ir.graph import walk_ops
    from fivedc.parallel.check import check_module

    graph = load_graph("examples/titan_tune_models.py:titan_llama3")
    ops = [op for op, _ in walk_ops(graph.body)]
    assert [op.attr("causal") for op in ops if op.kind == "attention"] == [True, True]
    assert not [op for op in ops if op.kind == "aten" and op.attr("rule") == "replicated"]
    for mesh, options in (("1x1x1x2x1", {}), ("1x2x1x1x1", {"schedule": "1f1b"})):
        report = check_module("examples/titan_tune_models.py:titan_llama3", mesh=mesh, steps=2, dtype="fp64",
                              pool=worker_pool, **options)
        assert report.max_error <= 1e-10, (mesh, report)


# torchtitan's MoE models with their default load balancing (load_balance_coeff 1e-3): the expert bias
# and tokens per expert are state (fivedc/ir/states.py), and the trainer's bias update is the factory's
# after-step hook (examples/titan_tune_models.expert_bias_update); Qwen3-MoE's layouts with the flag
LAYOUTS = ("2x1x2x1x1", "1x1x1x1x2", "1x2x1x1x1")
BALANCED = ("titan_deepseek_v3", "titan_qwen3_moe_sdpa")


@pytest.mark.parametrize("balanced", BALANCED)
def test_torchtitans_moe_balancing_bias_trains_as_its_trainers_loop(worker_pool, request, balanced) -> None:
    """The bias after 3 steps (and the losses, gradients, parameters) as a one-device loop running
    the trainer's update after each optimizer step, in float64, at 1 rank, dp2·tp2, ep2 and pp2."""
    from fivedc.ir.states import graph_states
    from fivedc.parallel.check import check_module, check_module_here

    spec = f"examples/titan_tune_models.py:{balanced}"
    graph = load_graph(spec)
    assert {s.key.rpartition(".")[2] for s in graph_states(graph)} == {"expert_bias_E", "tokens_per_expert_E"}
    report = check_module_here(spec, steps=3, dtype="fp64")
    assert report.max_error <= 1e-10, report
    every = balanced == "titan_deepseek_v3" or request.config.getoption("--all-library-models")
    for mesh in LAYOUTS if every else ():
        # pp2: the MoE layer (the last) on pp rank 1 only: the others hold its states through the sum over pp
        options = {"schedule": "1f1b", "stage_boundaries": ("model.layers.1",)} if mesh == "1x2x1x1x1" else {}
        report = check_module(spec, mesh=mesh, steps=3, dtype="fp64", pool=worker_pool, **options)
        assert report.max_error <= 1e-10, (mesh, report)


def _trainer_loop(spec: str, tokens: str, config, steps: int) -> tuple[list[float], dict]:
    """torchtitan's trainer as a plain one-device loop in float64: fivedc train's batches (the same
    windows of the token file), torch's AdamW at the same learning rate per step, torch's clipping,
    then the trainer's expert-bias update (the factory's after-step hook). (losses, buffers)."""
    import numpy as np
    import torch

    from fivedc.frontends.fx.flex import flex_attention_on_cpu
    from fivedc.frontends.fx.precision import float64_everywhere
    from fivedc.frontends.python_file import load_factory
    from fivedc.runtime.data import Sampler, read_windows

    module, (ids, _) = load_factory(spec)
    batch, seq = ids.shape
    array = np.memmap(tokens, dtype=np.uint16, mode="r")
    sampler = Sampler(len(array), seq, batch, config.seed)
    opt = torch.optim.AdamW(module.parameters(), lr=config.lr, weight_decay=config.weight_decay, foreach=False)
    losses = []
    for step in range(steps):
        windows = torch.from_numpy(read_windows(array, sampler.rows(step), seq))
        opt.zero_grad(set_to_none=True)
        with float64_everywhere(), flex_attention_on_cpu(eager=True):  # the model's ops as fivedc's fp64 runs them
            loss = module(windows[:, :-1], windows[:, 1:])
            loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.grad is not None], config.clip)
        for group in opt.param_groups:
            group["lr"] = config.lr_at(step)
        opt.step()
        with torch.no_grad():  # the bias (float32, as torchtitan keeps it) updated as the trainer does
            module.fivedc_after_step(module)
        losses.append(loss.item())
    return losses, {k: b.detach().clone() for k, b in module.named_buffers() if "expert" in k}


def test_fivedc_train_updates_the_expert_bias_as_torchtitans_trainer(worker_pool, tmp_path) -> None:
    """torchtitan's DeepSeek-V3 trained 3 steps by `fivedc train`'s loop on pp2 (the MoE layer on pp
    rank 1), float64: the losses and the expert bias of the trainer's one-device loop."""
    import dataclasses

    import torch

    from fivedc.frontends.python_file import load_factory
    from fivedc.ir.mesh import Mesh
    from fivedc.parallel.parallelize import compile_module
    from fivedc.runtime.checkpoint import read_index
    from fivedc.runtime.reshard import consolidate
    from fivedc.runtime.train_loop import train_job
    from train_helpers import job_for, make_tokens

    spec = "examples/titan_tune_models.py:titan_deepseek_v3"
    data = make_tokens(tmp_path, vocab=64)
    module, inputs = load_factory(spec)
    traced, plan = compile_module(module, inputs, mesh=Mesh.parse("1x2x1x1x1"), schedule="1f1b",
                                  stage_boundaries=("model.layers.1",))
    job = dataclasses.replace(job_for(plan, data, steps=3, lr=1e-2, save_every=3, clip=0.5, seed=1),
                              save_dir=str(tmp_path / "run"), states=traced.state_values(module), hooks=spec,
                              init=traced.to_ir_params(module.state_dict()))
    rows = worker_pool.run(train_job, world=2, payload=job)[0]["rows"]
    losses, buffers = _trainer_loop(spec, data[0], job.config, 3)
    assert max(abs(r["loss"] - want) / abs(want) for r, want in zip(rows, losses, strict=True)) <= 1e-10
    folder = tmp_path / "run" / "step-00000003"
    states = consolidate(folder, read_index(folder), kind="state")
    bias = "model.layers.1.moe.expert_bias_E"
    assert buffers[bias].abs().max() > 0 and set(states) == set(buffers)
    for key, want in buffers.items():
        assert torch.allclose(states[key].to(want.dtype), want, rtol=0, atol=1e-12), (key, states[key], want)
