"""Plan-level tests with no processes: large meshes against hand-computed values.

Shard shapes, group sizes, collective bytes and counts of Llama 3 405B at 16384
ranks, the size of the plan file, its JSON round trip and versioning.
"""

from __future__ import annotations

import json
import math

import pytest

from fivedc.errors import PlanError, ShapeError
from fivedc.frontends.dsl_file import load_model
from fivedc.ir.graph import CollectiveKind as K, Phase
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.plan.execution_plan import ExecutionPlan

MiB = 2**20
LLAMA = "examples/llama3_405b.5d"


@pytest.fixture(scope="module")
def llama_sp():
    return compile_graph(load_model(LLAMA), CompileOptions(mesh=Mesh.parse("2048x1x8x1x1"), sequence_parallel=True))


def find(plan, *, phase, kind, tensor=None, dim=None):
    return [c for c in plan.collectives if c.phase == phase and c.kind == kind
            and (tensor is None or c.tensor == tensor) and (dim is None or c.dim == dim)]


def test_mesh_of_16384_ranks() -> None:
    mesh = Mesh.parse("8x16x8x4x4")
    assert mesh.world == 16384
    assert [mesh.stride(a) for a in (MeshAxis.TP, MeshAxis.CP, MeshAxis.EP, MeshAxis.DP, MeshAxis.PP)] == [1, 8, 32, 128, 1024]
    assert mesh.group_ranks((MeshAxis.TP,), 0) == tuple(range(8))
    assert mesh.group_ranks((MeshAxis.DP,), 5) == tuple(5 + 128 * i for i in range(8))
    assert mesh.group_count((MeshAxis.DP, MeshAxis.EP)) == 16384 // 32
    for rank in (0, 1, 777, 16383):
        assert mesh.rank_of(mesh.coords(rank)) == rank
    assert Mesh.parse("dp=8,pp=16,tp=8,cp=4,ep=4") == mesh
    custom = Mesh.parse("2x1x2x1x1", rank_order="dp,tp,cp,ep,pp")
    assert custom.group_ranks((MeshAxis.DP,), 0) == (0, 1)


def test_llama_405b_on_four_axes() -> None:
    """dp=8, pp=16, tp=8, cp=4: 4096 ranks; 16 balanced chunks of the 126 layers."""
    plan = compile_graph(load_model(LLAMA), CompileOptions(mesh=Mesh.parse("8x16x8x4x1"), sequence_parallel=True))
    chunks = plan.pipeline.chunks
    assert len(chunks) == 16 and [c.rank for c in chunks] == list(range(16))
    costs = [c.cost for c in chunks]
    assert max(costs) / min(costs) < 1.6  # the head (vocab 128256) weighs on the last chunk
    assert "embedding" in chunks[0].what and "cross_entropy" in chunks[-1].what
    assert str(plan.graph.seq_layout) == "balanced"


def test_llama_405b_shards(llama_sp) -> None:
    params = {p.name: p for p in llama_sp.graph.body.params}
    repeat = next(i for i in llama_sp.graph.body.items if hasattr(i, "body"))
    layer = {p.name: p for p in repeat.body.params}
    assert repeat.count == 126
    assert str(layer["wq"].sharding) == "heads:tp"  # column parallel: [16384, 128/8, 128]
    assert str(layer["wk"].sharding) == "kv_heads:tp"  # 8 kv heads over tp=8: one each
    assert str(layer["wo"].sharding) == "heads:tp"  # row parallel
    assert str(layer["w_down"].sharding) == "ffn:tp"
    assert str(params["tok_embeddings"].sharding) == "vocab:tp"  # vocab-parallel embedding
    assert str(params["output"].sharding) == "vocab:tp"  # vocab-parallel loss head
    assert layer["wq"].grad_partial == (MeshAxis.DP,)
    assert set(layer["attn_norm"].grad_partial) == {MeshAxis.DP, MeshAxis.TP}  # sequence parallel norm


def test_llama_405b_collective_volumes(llama_sp) -> None:
    # per rank: 2048 sequences over dp=2048 -> 1 x 8192 tokens x hidden 16384 x 2 bytes
    activation = 1 * 8192 * 16384 * 2
    gathers = find(llama_sp, phase=Phase.FORWARD, kind=K.ALL_GATHER, dim="seq")
    scatters = find(llama_sp, phase=Phase.FORWARD, kind=K.REDUCE_SCATTER, dim="seq")
    assert gathers and scatters and not find(llama_sp, phase=Phase.FORWARD, kind=K.ALL_REDUCE, dim=None)[3:]
    assert all(c.bytes == activation and c.axes == (MeshAxis.TP,) for c in gathers + scatters)
    per_layer = [c for c in gathers + scatters if c.count == 126]
    assert len(per_layer) == 4  # 2 all-gathers + 2 reduce-scatters per layer
    # 25 MiB gradient buckets in backward order: wv and wk (4 MiB each) share one with
    # wq (64 MiB), which closes it; once per layer
    bucket = next(b for b in llama_sp.buckets if "layers.*.wq" in b.params)
    assert bucket.params == ("layers.*.wv", "layers.*.wk", "layers.*.wq")
    sync = find(llama_sp, phase=Phase.GRAD_SYNC, kind=K.ALL_REDUCE, tensor=f"bucket {bucket.index}: {', '.join(bucket.params)}")[0]
    assert sync.bytes == (16384 * (128 // 8) * 128 + 2 * 16384 * (8 // 8) * 128) * 2 and sync.count == 126
    ce = [c for c in llama_sp.collectives if "cross-entropy" in c.reason]
    assert len(ce) == 3 and all(c.bytes == 8192 * 4 for c in ce)


def test_memory_estimate_by_hand(llama_sp) -> None:
    per_layer = 16384 * 128 * 128 * 2 + 16384 * 8 * 128 * 2 + 3 * 16384 * 53248 + 2 * 16384  # attn, mlp, norms
    total = 126 * per_layer + 2 * 128256 * 16384 + 16384
    local = 126 * (per_layer - 2 * 16384) // 8 + 126 * 2 * 16384 + 2 * 128256 * 16384 // 8 + 16384
    assert llama_sp.memory.params == local * 2
    assert llama_sp.memory.optimizer == local * 12
    assert 400e9 < total < 410e9  # the published 405B


def test_plan_size_does_not_grow_with_world(tmp_path) -> None:
    graph = load_model(LLAMA)
    sizes = []
    for mesh in ("2x1x8x1x1", "2048x1x8x1x1"):  # same axes in use, 1024x the ranks
        path = tmp_path / f"{mesh}.json"
        compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh))).save(path)
        sizes.append(path.stat().st_size)
    assert abs(sizes[0] - sizes[1]) < 0.01 * sizes[0]  # only the digits of the sizes differ


def test_plan_round_trip_and_version(tmp_path, llama_sp) -> None:
    path = tmp_path / "plan.json"
    llama_sp.save(path)
    assert ExecutionPlan.load(path) == llama_sp
    data = json.loads(path.read_text())
    data["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="version 99"):
        ExecutionPlan.load(path)
    path.write_text("not json")
    with pytest.raises(PlanError, match="not JSON"):
        ExecutionPlan.load(path)


@pytest.mark.parametrize("mesh,message", [
    ("1x1x3x1x1", "heads=128 is not divisible by tp=3"),
    ("3x1x1x1x1", "batch=2048 is not divisible by dp=3"),
    ("1x1x16x1x1", "kv_heads=8 is not divisible by tp=16"),
])
def test_divisibility_errors_quote_the_numbers(mesh: str, message: str) -> None:
    with pytest.raises(ShapeError, match=message) as info:
        compile_graph(load_model(LLAMA), CompileOptions(mesh=Mesh.parse(mesh)))
    assert info.value.loc is not None and "choose" in info.value.hint


def test_compile_time_does_not_grow_with_world() -> None:
    import time

    graph = load_model(LLAMA)
    times = {}
    for mesh in ("1x1x1x1x1", "2048x1x8x1x1"):
        start = time.perf_counter()
        for _ in range(5):
            compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh)))
        times[mesh] = (time.perf_counter() - start) / 5
    assert max(times.values()) < 2.0
    assert math.isfinite(times["2048x1x8x1x1"])
