"""ZeRO-1/2/3: the plan's collectives and memory, the runtime's bytes, and equivalence.

Each stage composes with dp, tp (with and without SP) and cp; training 2 steps in
float64 must match the single-device run, and the bytes every rank holds in
parameters, gradients and optimizer state must match the plan's estimate.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from fivedc.cli.main import main
from fivedc.errors import FivedcError
from fivedc.frontends.dsl_file import load_model, parse_model
from fivedc.ir.graph import CollectiveKind, Phase
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.estimates.memory import OPTIMIZER_BYTES
from fivedc.runtime.train import TrainSettings
from fivedc.runtime.verify import single_device_mesh, verify_plan
from fivedc.runtime.flat_shard import FlatShard
from fivedc.runtime.zero import _AdamState, adamw_
from random_models import Case, draw_case, draw_cp_case

TOL = 1e-10
K = CollectiveKind


def plan_for(mesh: str, zero: int, *, model: str = "tiny_llama", sp: bool = False, dtype: str = "fp64"):
    graph = load_model(f"examples/{model}.5d")
    return compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=sp, dtype=dtype, zero=zero))


def test_adamw_matches_torch_adamw() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(10, generator=gen, dtype=torch.float64)
    mine, ref = p.clone(), p.clone().requires_grad_(True)
    optimizer = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    state = _AdamState(torch.zeros(12, dtype=torch.float64), torch.zeros(12, dtype=torch.float64), None)
    for _ in range(5):
        grad = torch.randn(10, generator=gen, dtype=torch.float64)
        ref.grad = grad.clone()
        optimizer.step()
        adamw_(mine, grad, state, lr=1e-2, weight_decay=0.1)  # moments padded to 12: the head is used
    assert torch.allclose(mine, ref.detach(), rtol=0, atol=1e-15)
    assert state.exp_avg[10:].abs().sum() == 0


def test_flat_shards_are_equal_padded_chunks() -> None:
    specs = [FlatShard(10, 4, i, None) for i in range(4)]
    assert [s.chunk for s in specs] == [3, 3, 3, 3]
    assert [s.owned_length for s in specs] == [3, 3, 3, 1]
    flat = torch.arange(10.0)
    assert torch.cat([s.owned(flat) for s in specs]).tolist() == flat.tolist()
    assert specs[3].pad(specs[3].owned(flat)).tolist() == [9.0, 0.0, 0.0]


def test_memory_estimate_divides_as_each_stage_divides() -> None:
    """2Ψ + 2Ψ + 12Ψ in bf16: ZeRO-1 divides the 12Ψ by the group, ZeRO-2 also the
    gradients, ZeRO-3 also the parameters (tiny_llama's dims divide dp=4 evenly)."""
    mems = [plan_for("4x1x1x1x1", z, dtype="bf16").memory for z in range(4)]
    psi = mems[0].params // 2
    assert (mems[0].params, mems[0].grads, mems[0].optimizer) == (2 * psi, 2 * psi, 12 * psi)
    assert (mems[1].params, mems[1].grads, mems[1].optimizer) == (2 * psi, 2 * psi, 12 * psi // 4)
    assert (mems[2].params, mems[2].grads, mems[2].optimizer) == (2 * psi, 2 * psi // 4, 12 * psi // 4)
    assert (mems[3].params, mems[3].grads, mems[3].optimizer) == (2 * psi // 4, 2 * psi // 4, 12 * psi // 4)
    assert OPTIMIZER_BYTES["bf16"] == 12


def test_collectives_per_stage() -> None:
    def kinds(zero: int) -> set[tuple[Phase, K]]:
        plan = plan_for("2x1x2x1x1", zero, sp=True)
        names = ("wte", "layers.*.wq")
        return {(c.phase, c.kind) for c in plan.collectives
                if "dp" in c.axes and (c.tensor in names or any(f" {n}" in c.tensor for n in names))}

    assert kinds(0) == {(Phase.GRAD_SYNC, K.ALL_REDUCE)}
    assert kinds(1) == {(Phase.GRAD_SYNC, K.REDUCE_SCATTER), (Phase.OPTIMIZER, K.ALL_GATHER)}
    assert kinds(2) == {(Phase.GRAD_SYNC, K.REDUCE_SCATTER), (Phase.OPTIMIZER, K.ALL_GATHER)}
    assert kinds(3) == {(Phase.BACKWARD, K.REDUCE_SCATTER), (Phase.FORWARD, K.ALL_GATHER), (Phase.BACKWARD, K.ALL_GATHER)}
    plan = plan_for("2x1x2x1x1", 3, sp=True)

    def group(name: str, kind: K, phase: Phase):
        return next(c for c in plan.collectives if c.kind == kind and c.phase == phase and f" {name}" in c.tensor)

    wq = group("layers.*.wq", K.ALL_GATHER, Phase.FORWARD)
    assert wq.count == 2 and "as one group" in wq.reason and " layers.*.wo" in wq.tensor  # once per layer, with wo
    assert group("norm", K.REDUCE_SCATTER, Phase.BACKWARD).axes == ("dp", "tp")  # SP: a norm weight spans dp x tp
    # FSDP2's count: per group (a layer's weights of one ZeRO group) one gather forward, one
    # backward, one reduce-scatter; not one per parameter and use
    for axes in (("dp",), ("dp", "tp")):
        instances = sum(b.count for b in plan.buckets if b.axes == axes)
        moved = [c for c in plan.collectives if c.axes == axes and c.kind in (K.ALL_GATHER, K.REDUCE_SCATTER)]
        assert sum(c.count for c in moved) == 3 * instances
    assert [b.count for b in plan.buckets].count(2) == 2  # a layer's groups: its weights (dp), its norms (dp x tp)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_and_2_move_2psi_per_step(zero: int) -> None:
    """The ZeRO paper's 2Ψ: a reduce-scatter and an all-gather of the parameters' bytes over
    each data-parallel group, (n-1)/n x Ψ each on a ring, as much as plain data parallelism's
    all-reduce, where an all-reduce and then the gather would move 3Ψ."""
    def wire(plan) -> float:
        total = 0.0
        for c in plan.collectives:
            if c.phase in (Phase.GRAD_SYNC, Phase.OPTIMIZER):
                n = plan.mesh.size(*c.axes)
                total += c.bytes * c.count * (n - 1) / n * (2 if c.kind == K.ALL_REDUCE else 1)
        return total

    plain, sharded = plan_for("4x1x1x1x1", 0), plan_for("4x1x1x1x1", zero)
    assert {c.kind for c in sharded.collectives if c.phase == Phase.GRAD_SYNC} == {K.REDUCE_SCATTER}
    assert wire(sharded) == pytest.approx(wire(plain))  # 2Ψ (n-1)/n both; tiny_llama's shapes divide by 4
    one = plan_for("4x1x1x1x1", 1)
    assert all("ZeRO-1 keeps the full gradients until then" in c.overlaps for c in one.collectives
               if c.phase == Phase.GRAD_SYNC)


def test_buckets_follow_backward_order_and_the_bucket_size() -> None:
    """Buckets hold one ZeRO group each, in backward order (head first, embedding
    last), per layer for a repeat body, and close at the bucket size."""
    plan = compile_graph(load_model("examples/tiny_llama.5d"),
                         CompileOptions(mesh=Mesh.parse("2x1x1x1x1"), dtype="fp64", bucket_mb=4096 / 2**20))
    names = [b.params for b in plan.buckets]
    assert names[0] == ("w_head",) and names[-1] == ("wte",)  # 64 x 32 x 8 B = 16 KiB each: alone
    # a layer in backward order; fp64 sizes: w_down 24 KiB, mlp_norm 256 B, wo 8 KiB, wv 4 KiB, ...
    layer = [tuple(p.removeprefix("layers.*.") for p in b.params) for b in plan.buckets if b.count == 2]
    assert layer == [("w_down",), ("w_up",), ("w_gate",), ("mlp_norm", "wo"), ("wv",), ("wk",), ("wq",), ("attn_norm",)]
    sync = [c for c in plan.collectives if c.phase == Phase.GRAD_SYNC]
    assert [c.tensor.split(":")[0] for c in sync] == [f"bucket {i}" for i in range(len(plan.buckets))]
    assert all("starts when its last gradient is ready" in c.overlaps for c in sync)
    off = compile_graph(load_model("examples/tiny_llama.5d"),
                        CompileOptions(mesh=Mesh.parse("2x1x1x1x1"), overlap=False))
    assert all("overlap is off" in c.overlaps for c in off.collectives if c.phase == Phase.GRAD_SYNC)
    with pytest.raises(FivedcError, match="bucket size 0 MiB must be > 0"):
        CompileOptions(mesh=Mesh.parse("2x1x1x1x1"), bucket_mb=0)


def test_zero_over_one_rank_groups_says_it_does_nothing(capsys) -> None:
    assert plan_for("1x1x2x1x1", 3).notes and "changes nothing" in plan_for("1x1x2x1x1", 3).notes[0]
    assert plan_for("2x1x1x1x1", 3).notes == ()
    assert main(["compile", "examples/tiny_llama.5d", "--mesh", "1x1x2x1x1", "--zero", "3", "-o", "/dev/null"]) == 0
    assert "changes nothing" in capsys.readouterr().out


def test_unknown_stage_is_a_clear_error(capsys) -> None:
    with pytest.raises(FivedcError, match="unknown ZeRO stage 4"):
        CompileOptions(mesh=Mesh.parse("2x1x1x1x1"), zero=4)
    assert main(["compile", "examples/gpt.5d", "--mesh", "2x1x1x1x1", "--zero", "5", "-o", "/dev/null"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "unknown ZeRO stage 5" in err and "choose 1" in err and "Traceback" not in err


def _verify(plan, graph, pool):
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    report = verify_plan(plan, reference, settings=TrainSettings(steps=2), pool=pool)
    assert report.max_error <= TOL, report
    return report


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_bytes_each_rank_holds_match_the_plan(zero: int, worker_pool) -> None:
    graph = load_model("examples/gpt.5d")
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse("4x1x2x1x1"), sequence_parallel=True, dtype="fp64", zero=zero))
    report = _verify(plan, graph, worker_pool)
    expected = {"params": plan.memory.params, "grads": plan.memory.grads, "optimizer": plan.memory.optimizer}
    for rank, held in enumerate(report.held):
        for kind, value in expected.items():
            assert abs(held[kind] - value) <= 0.05 * value, (rank, kind, held[kind], value)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.one_of(draw_case(), draw_cp_case()), zero=st.sampled_from([1, 2, 3]))
def test_random_models_with_zero_match_single_device(case: Case, zero: int, worker_pool) -> None:
    graph = parse_model(case.text, filename="<random>")
    options = CompileOptions(mesh=Mesh.parse(case.mesh), sequence_parallel=case.sp, dtype="fp64",
                             cp_attention=case.cp_attention, cp_layout=case.cp_layout, zero=zero)
    _verify(compile_graph(graph, options), graph, worker_pool)



def _bucket_job(info, overlap: bool) -> tuple[int, list[float]]:
    import torch.distributed as dist

    from fivedc.runtime.buckets import GradBuckets

    group = dist.new_group([0, 1])
    params = {name: torch.full((3,), float(info.rank + 1), dtype=torch.float64, requires_grad=True)
              for name in ("a", "b", "c")}
    buckets = GradBuckets(params, [("c",), ("b", "a")], {}, dict.fromkeys(params, group), stage=0, overlap=overlap)
    loss = ((params["a"] * 2).sum() * params["b"].sum() + params["c"].pow(2).sum())
    loss.backward()
    summed = buckets.finish()
    return buckets.started_early, [float(summed[n][0]) for n in ("a", "b", "c")]


@pytest.mark.parametrize("overlap", [True, False])
def test_buckets_start_during_backward_only_with_overlap(overlap: bool, worker_pool) -> None:
    results = worker_pool.run(_bucket_job, world=2, payload=overlap)
    # d/da = 2 * sum(b) = 6r', d/db = 2 * sum(a), d/dc = 2c, summed over ranks with values 1 and 2
    for started_early, sums in results:
        assert sums == [2 * 3 * 1 + 2 * 3 * 2, 2 * 3 * 1 + 2 * 3 * 2, 2 * 1 + 2 * 2]
        assert started_early == (2 if overlap else 0)


# (numel, dtype, group) per parameter: "world" is all 4 ranks, "pair" is {0, 1} or {2, 3}, None no group
_GATHERED = {"a": (10, torch.float64, "world"), "b": (3, torch.float64, "world"), "c": (1, torch.float64, "world"),
             "d": (9, torch.float32, "world"), "e": (5, torch.float64, "pair"), "f": (1, torch.float64, "pair"),
             "g": (4, torch.float64, None)}


def _gather_flat_job(info, bucket_bytes: int) -> dict:
    import torch.distributed as dist

    from fivedc.runtime.flat_shard import flat_shard, gather_flat

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both, in the same order
    groups = {"world": dist.new_group([0, 1, 2, 3]), "pair": pairs[info.rank // 2], None: None}
    specs, chunks, wanted = {}, {}, {}
    for k, (name, (numel, dtype, group)) in enumerate(_GATHERED.items()):
        replica = info.rank // 2 if group == "pair" else 0  # the two pairs hold different replicas
        full = torch.arange(numel, dtype=dtype) + 100 * k + 1000 * replica
        specs[name] = flat_shard(numel, groups[group])
        chunks[name] = specs[name].owned(full).clone()  # this rank's real elements only (the tail unpadded)
        wanted[name] = full
    calls: list[int] = []
    original = dist.all_gather

    def counting(*args, **kwargs):
        calls.append(dist.get_world_size(kwargs["group"]))
        return original(*args, **kwargs)

    dist.all_gather = counting
    try:
        batched = gather_flat(chunks, specs, bucket_bytes=bucket_bytes)
        out = {name: torch.full((numel,), -1.0, dtype=dtype) for name, (numel, dtype, _) in _GATHERED.items()}
        into = gather_flat(chunks, specs, out=out, bucket_bytes=bucket_bytes)
    finally:
        dist.all_gather = original
    per_param = {name: specs[name].gather(specs[name].pad(chunks[name])) for name in specs}
    return {"calls": calls, "batched": batched, "per_param": per_param, "wanted": wanted,
            "into_out": all(into[n] is out[n] for n in out), "out": out}


@pytest.mark.parametrize("bucket_bytes, calls", [
    (25 * 2**20, [4, 4, 2]),  # one collective per (group, dtype): a-c fp64, d fp32, e-f over the pair
    (128, [4, 4, 4, 2]),  # a (4 x 3 x 8 B = 96) and b (32) fill a bucket; c starts the next
    (1, [4, 4, 4, 4, 2, 2]),  # every parameter alone, still in name order
])
def test_gather_flat_equals_the_per_parameter_gather(bucket_bytes: int, calls: list[int], worker_pool) -> None:
    """Parameters of different sizes (some smaller than the group), two dtypes and two
    groups per rank: one all-gather per group and dtype, the same tensors as one
    gather per parameter, and every rank issues the same collectives in one order."""
    for rank, got in enumerate(worker_pool.run(_gather_flat_job, world=4, payload=bucket_bytes)):
        assert got["calls"] == calls + calls, rank  # gather_flat twice: into new tensors, then into `out`
        assert got["into_out"], rank
        for name, want in got["wanted"].items():
            assert got["batched"][name].dtype == want.dtype and got["batched"][name].shape == want.shape
            assert torch.equal(got["batched"][name], want), (rank, name)
            assert torch.equal(got["out"][name], want), (rank, name)
            assert torch.equal(got["per_param"][name], want), (rank, name)


def _gathered_copies_job(info, zero: int) -> dict:
    """Under `parallelize(zero=1|2)`: how many of each step's gathered tensors are alive
    after the last step, with the cycle collector off; and the gradients of two forwards
    summed in one backward against twice those of one forward (the first forward's
    tensors held only by its graph)."""
    import gc
    import weakref
    from pathlib import Path

    import fivedc
    from fivedc.frontends.python_file import import_file

    llama = import_file(Path(__file__).resolve().parent.parent / "examples" / "llama.py")
    module, inputs = llama.factory(batch=2)
    model = fivedc.parallelize(module, mesh="2x1x1x1x1", example_inputs=inputs, zero=zero, device=info.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    enabled = gc.isenabled()
    gc.disable()
    try:
        refs = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(*inputs).backward()
            opt.step()
            refs.append([weakref.ref(t) for t in model._fivedc_weights.gathered.values()])
        alive = [sum(ref() is not None for ref in step) for step in refs]
        opt.zero_grad(set_to_none=True)
        first = model(*inputs)
        (first + model(*inputs)).backward()
        twice = [p.grad.clone() for p in model.parameters()]
        opt.zero_grad(set_to_none=True)
        model(*inputs).backward()
        once = [p.grad.clone() for p in model.parameters()]
    finally:
        if enabled:
            gc.enable()
    error = max(float((a - 2 * b).abs().max()) for a, b in zip(twice, once))
    return {"alive": alive, "gathered": len(refs[0]), "error": error}


@pytest.mark.parametrize("zero", [1, 2])
def test_parallelize_frees_each_forwards_gathered_tensors(zero: int, worker_pool) -> None:
    """ZeRO-1/2 under `fivedc.parallelize` hold one forward's whole parameters, not one
    per forward until Python's cycle collector runs."""
    for got in worker_pool.run(_gathered_copies_job, world=2, payload=zero):
        assert got["gathered"] > 0
        assert got["alive"] == [0, 0, got["gathered"]], got
        assert got["error"] <= 1e-12, got
