"""Buffers the forward writes (issue 37): an MoE block's routing bias and tokens per expert are
state in the plan (fivedc/ir/states.py), the counts summed over the ranks that split the batch,
updated by after-step hooks; the module check compares them with the plain module's."""

from __future__ import annotations

import pytest

from fivedc.ir.states import graph_states
from fivedc.parallel.check import check_module, check_module_here

MODEL = "tests/balanced_moe.py:build"


def test_the_probe_reads_the_bias_and_the_counts_and_the_plan_sums_them_over_the_batch() -> None:
    from fivedc.frontends.python_file import load_factory
    from fivedc.ir.mesh import Mesh
    from fivedc.parallel.parallelize import compile_module

    module, inputs = load_factory(MODEL)
    traced, plan = compile_module(module, inputs, mesh=Mesh.parse("2x1x1x1x2"))
    states = {(s.key, s.written) for s in graph_states(plan.graph)}
    assert states == {(f"layers.{i}.moe.{name}", name == "tokens_per_expert")
                      for i in (0, 1) for name in ("expert_bias", "tokens_per_expert")}
    counted = [c for c in plan.collectives if "the state layers." in c.reason]
    assert len(counted) == 2 and all(c.kind == "all_reduce" and set(c.axes) == {"dp", "ep"} for c in counted)
    assert not any(b.abs().max() for b in module.buffers())  # tracing left the module's buffers as they were


def test_one_rank_trains_the_bias_as_the_plain_loop_and_a_wrong_count_is_caught(monkeypatch) -> None:
    report = check_module_here(MODEL, steps=3, dtype="fp64")
    assert report.max_error <= 1e-10, report
    import fivedc.runtime.moe as moe

    monkeypatch.setattr(moe, "add_to_state", lambda *args: None)  # the counts never reach the buffer
    report = check_module_here(MODEL, kwargs={"after_step": False}, steps=2, dtype="fp64")
    assert report.state_error > 0.5 and "tokens_per_expert" in report.worst


@pytest.mark.parametrize("mesh", ["2x1x2x1x1", "1x1x1x1x2", "1x2x1x1x1"])
def test_the_bias_and_the_counts_train_as_one_device_on_every_axis(worker_pool, mesh: str) -> None:
    """3 steps with the hook (the bias after 3 updates), then without (the counts of 3 steps)."""
    # pp2: layer 1's MoE on pp rank 1 only, so rank 0 holds its states through the sum over pp
    options = {"schedule": "1f1b", "stage_boundaries": ("layers.1",)} if mesh == "1x2x1x1x1" else {}
    for after_step in (True, False):
        report = check_module(MODEL, kwargs={"after_step": after_step}, mesh=mesh, steps=3, dtype="fp64",
                              pool=worker_pool, **options)
        assert report.max_error <= 1e-10, (mesh, after_step, report)


def test_the_routing_reads_the_bias(monkeypatch) -> None:
    """A plan that chose without the bias would route otherwise once the bias moves: caught."""
    import torch

    import fivedc.runtime.moe as moe

    monkeypatch.setattr(moe, "read_state", lambda ctx, key, like, size: torch.zeros(size, dtype=like.dtype))
    report = check_module_here(MODEL, steps=3, dtype="fp64")
    assert report.loss_error > 1e-4 and report.state_error > 0.5


def test_fivedc_train_runs_the_hooks_and_saves_and_resumes_the_states(worker_pool, tmp_path) -> None:
    """fivedc's own loop: 2 steps on pp2 (the counts summed over pp before the hook), saved, resumed
    on one device for 2 more: the bias, the counts and the losses of 4 steps on one device."""
    import dataclasses

    import torch

    from fivedc.frontends.python_file import load_factory
    from fivedc.ir.mesh import Mesh
    from fivedc.parallel.parallelize import compile_module
    from fivedc.runtime.checkpoint import read_index
    from fivedc.runtime.reshard import consolidate
    from fivedc.runtime.train_loop import train_job
    from train_helpers import job_for, make_tokens, one_device

    data = make_tokens(tmp_path, vocab=32)
    module, inputs = load_factory(MODEL)
    traced, pp2 = compile_module(module, inputs, mesh=Mesh.parse("1x2x1x1x1"), schedule="1f1b",
                                 stage_boundaries=("layers.1",))  # layer 1 on pp rank 1: rank 0 saves its states
    _, one = compile_module(module, inputs, mesh=Mesh.parse("1x1x1x1x1"))
    start = dict(states=traced.state_values(module), hooks=MODEL, init=traced.to_ir_params(module.state_dict()))
    config = dict(steps=4, lr=1e-2, save_every=2, keep=5, clip=0.5, seed=1)
    first = dataclasses.replace(job_for(pp2, data, **config), **start, save_dir=str(tmp_path / "a"), until=2)
    worker_pool.run(train_job, world=2, payload=first)
    whole = one_device(dataclasses.replace(first, plan=one, save_dir=str(tmp_path / "b"), until=None))
    resumed = one_device(dataclasses.replace(first, plan=one, save_dir=str(tmp_path / "c"), until=None, init=None,
                                             states=None, resume=str(tmp_path / "a" / "step-00000002")))
    for got, want in zip(resumed, whole[2:], strict=True):
        assert abs(got["loss"] - want["loss"]) <= 1e-12 * abs(want["loss"])
    folders = [tmp_path / d / "step-00000004" for d in ("b", "c")]
    states = [consolidate(f, read_index(f), kind="state") for f in folders]
    assert set(states[0]) == {f"layers.{i}.moe.{n}" for i in (0, 1) for n in ("expert_bias", "tokens_per_expert")}
    assert all(states[0][k].abs().max() > 0 for k in states[0] if k.endswith("bias"))  # the hook moved them
    for key, want in states[0].items():
        assert torch.allclose(states[1][key], want, rtol=0, atol=1e-12), key


WRITES = "tests/buffer_models.py:build"


def test_a_buffer_the_traced_forward_adds_to_is_a_state_summed_over_the_batch(worker_pool) -> None:
    """`self.seen.add_(x.abs().sum(dim=(0, 1)))` in each layer and a token histogram at the top:
    `state_add` ops (the batch's sums computed whole), verified at 1 rank, dp2·tp2 and pp2 with
    two microbatches (each adds its rows' sum)."""
    from fivedc.frontends.python_file import load_factory
    from fivedc.ir.mesh import Mesh
    from fivedc.parallel.parallelize import compile_module

    module, inputs = load_factory(WRITES)
    _, plan = compile_module(module, inputs, mesh=Mesh.parse("2x1x2x1x1"))
    assert {(s.key, s.written) for s in graph_states(plan.graph)} == {
        ("hist", True), ("layers.0.seen", True), ("layers.1.seen", True)}
    assert check_module_here(WRITES, steps=3, dtype="fp64").max_error <= 1e-10
    report = check_module(WRITES, mesh="2x1x2x1x1", steps=3, dtype="fp64", pool=worker_pool)
    assert report.max_error <= 1e-10, report
    # a sum over the batch adds up over a pipeline's microbatches (the histogram's one_hot runs replicated)
    report = check_module(WRITES, kwargs={"histogram": False}, mesh="1x2x1x1x1", steps=3, dtype="fp64",
                          pool=worker_pool, schedule="1f1b", microbatches=2, stage_boundaries=("layers.1",))
    assert report.max_error <= 1e-10, report


def test_other_buffer_writes_are_refused_at_their_line() -> None:
    from fivedc.errors import FivedcError
    from fivedc.frontends.python_file import load_factory
    from fivedc.ir.mesh import Mesh
    from fivedc.parallel.parallelize import compile_module

    module, inputs = load_factory(WRITES, kwargs={"layer": "moving"})  # read and written: a moving average
    with pytest.raises(FivedcError, match="average other than an addition") as refused:
        compile_module(module, inputs, mesh=Mesh.parse("2x1x1x1x1"))
    assert "self.average.mul_(0.9)" in refused.value.loc.text
    module, inputs = load_factory(WRITES)  # the histogram's one_hot runs replicated: not per microbatch
    with pytest.raises(FivedcError, match="one_hot.default runs replicated .* cannot run in 2 microbatches"):
        compile_module(module, inputs, mesh=Mesh.parse("1x2x1x1x1"), schedule="1f1b")


def test_the_parallel_modules_buffers_are_its_states_and_load_back() -> None:
    """`model.after_step()` runs the hook on the parallel module's own buffers; its state_dict carries
    the bias, and another parallel module loading it (in place or assigned) routes by it."""
    import torch

    import fivedc
    from fivedc.frontends.python_file import load_factory

    module, inputs = load_factory(MODEL)
    model = fivedc.parallelize(module, mesh="1x1x1x1x1", example_inputs=inputs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(*inputs).backward()
        opt.step()
        opt.zero_grad()
        model.after_step()
    bias = model.get_buffer("layers.0.moe.expert_bias")
    assert bias.abs().max() > 0 and model.full_states()["layers.0.moe.expert_bias"].equal(bias)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for assign in (False, True):
        other = fivedc.parallelize(load_factory(MODEL)[0], mesh="1x1x1x1x1", example_inputs=inputs)
        other.load_state_dict(state, assign=assign)
        with torch.no_grad():
            assert other(*inputs).item() == model(*inputs).item()


def test_a_checkpoints_buffers_are_held_to_the_models_before_resuming() -> None:
    """A checkpoint is untrusted: a buffer the model does not use, or one of another size, is
    refused by name before anything is read."""
    from fivedc.errors import FivedcError
    from fivedc.frontends.python_file import load_factory
    from fivedc.ir.mesh import Mesh
    from fivedc.ir.states import state_sizes
    from fivedc.parallel.parallelize import compile_module
    from fivedc.runtime.program import qualified_params
    from fivedc.runtime.resume import check_same_model

    module, inputs = load_factory(MODEL)
    _, plan = compile_module(module, inputs, mesh=Mesh.parse("1x1x1x1x1"))
    params = {f"param/{n}": {"shape": [plan.graph.dim(d) for d in p.dims]} for n, p in qualified_params(plan.graph)}
    states = {f"state/{k}": {"shape": [n]} for k, n in state_sizes(plan.graph).items()}
    check_same_model({"tensors": params | states}, plan, where="ck")
    key = next(iter(states))
    for edit, message in (({key: {"shape": [99]}}, "of 99 elements"),
                          ({"state/nowhere": {"shape": [2]}}, "nowhere, which the model does not use")):
        with pytest.raises(FivedcError, match=message):
            check_same_model({"tensors": params | states | edit}, plan, where="ck")
