"""SP's gather before a column-parallel linear runs in a ring, the linear multiplying each chunk as it arrives.

Plan level: with overlap on, the forward all-gathers whose next op is a linear reading
them are marked (`overlaps` names the matmul), none with overlap off or without SP.
Runtime (gloo, 4 ranks): the ring brings chunk i, i-1, i-2, i-3 and posts the next hop
before the product of the chunk just in, so one hop is always in flight while a chunk
multiplies; the product and the gathered tensor are the all-gather's. A model at tp4
with SP and full recomputation trains to the gradients of the run without rings. The
step-time model is tested in tests/test_tp_overlap.py, the hops against what the
runtime calls in tests/test_agreement.py.
"""

from __future__ import annotations

import pytest
import torch

from fivedc.frontends.dsl_file import load_model
from fivedc.ir.graph import Phase, Redistribute, walk_ops
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.train import TrainSettings


def compiled(model: str = "examples/tiny_llama.5d", mesh: str = "1x1x2x1x1", **options):
    return compile_graph(load_model(model), CompileOptions(mesh=Mesh.parse(mesh), dtype="fp64", **options))


def rings(plan) -> dict[str, str]:
    """Each gathered value run in a ring -> the matmul its `overlaps` names."""
    return {node.out: node.forward[0].overlaps for node, _ in walk_ops(plan.graph.body)
            if isinstance(node, Redistribute) and node.forward and node.forward[0].overlaps}


def test_the_gathers_before_a_linear_are_run_in_rings() -> None:
    plan = compiled(sequence_parallel=True)
    matmuls = sorted(text.split(",")[0].removeprefix("the matmul of ") for text in rings(plan).values())
    assert matmuls == ["w_gate", "w_head", "wq"]  # the first reader of each gathered input
    forward_gathers = [c for c in plan.collectives if c.phase == Phase.FORWARD and c.kind == "all_gather"]
    assert forward_gathers and all(c.overlaps.endswith("(collective matmul)") for c in forward_gathers)
    assert rings(compiled(sequence_parallel=True, overlap=False)) == {}
    assert rings(compiled()) == {}  # without SP the linears read a replicated input: nothing to gather


def ring_job(info, payload) -> dict:
    """On a 4-rank tp group: a ring gathers a seeded shard per rank along dim 1, `product`
    multiplies it; each chunk's group index and how many hops were posted when it multiplied."""
    from fivedc.runtime import tp_ring
    from fivedc.runtime.groups import MeshGroups
    from fivedc.ir.mesh import MeshAxis

    groups = MeshGroups(Mesh.parse("1x1x4x1x1"), device_type="cpu")
    shards = [torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(4)]
    w = torch.randn(5, 7, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ring = tp_ring.start_ring(shards[info.rank], 1, (MeshAxis.TP,), groups)
    seen, arrivals = [], ring.arrivals

    def logged():
        for index, chunk in arrivals():
            seen.append((index, len(ring.transfers)))
            yield index, chunk

    ring.arrivals = logged
    value = tp_ring.mark_ring(ring.out, ring)
    product = tp_ring.product(value, w, 1)
    whole = torch.cat(shards, dim=1)
    return dict(seen=seen, product=torch.equal(product, whole @ w), gathered=torch.equal(value, whole))


def test_each_chunk_multiplies_while_the_next_hop_runs(worker_pool) -> None:
    for rank, got in enumerate(worker_pool.run(ring_job, world=4, payload=None)):
        assert got["product"] and got["gathered"], rank
        # its own chunk first, then what each hop brought from the previous member; the
        # hop after a chunk's is posted before that chunk multiplies, none after the third
        assert got["seen"] == [(rank, 1), ((rank - 1) % 4, 2), ((rank - 2) % 4, 3), ((rank - 3) % 4, 3)]


def grads_job(info, plans) -> list:
    from fivedc.runtime import verify

    out = []
    for plan in plans:
        settings = TrainSettings(steps=1)
        program, params, inputs, _ = verify.setup_rank(plan, info, settings)
        out.append(verify.train_plan(plan, program, params, inputs, settings).grads[0])
    return out


def test_a_model_in_rings_trains_as_with_all_gathers(worker_pool) -> None:
    """tp4 with SP (rings of three hops) and full recomputation (they run again in backward)."""
    on = compiled("examples/gpt.5d", "1x1x4x1x1", sequence_parallel=True, recompute="full")
    off = compiled("examples/gpt.5d", "1x1x4x1x1", sequence_parallel=True, recompute="full", overlap=False)
    assert rings(on)
    for grads, grads_off in worker_pool.run(grads_job, world=4, payload=[on, off]):
        assert grads.keys() == grads_off.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], grads_off[name], rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("contracted", [False, True])
def test_the_product_is_made_only_where_the_gathered_dim_is_kept(contracted, worker_pool) -> None:
    got = worker_pool.run(contracted_job, world=2, payload=contracted)
    assert all(got)


def contracted_job(info, contracted: bool) -> bool:
    """A ring along a dim the matmul contracts makes no product; the value is gathered whole."""
    from fivedc.runtime import tp_ring
    from fivedc.runtime.groups import MeshGroups
    from fivedc.ir.mesh import MeshAxis

    groups = MeshGroups(Mesh.parse("1x1x2x1x1"), device_type="cpu")
    shards = [torch.full((3, 4), float(r + 1), dtype=torch.float64) for r in range(2)]
    dim = 1 if contracted else 0
    ring = tp_ring.start_ring(shards[info.rank], dim, (MeshAxis.TP,), groups)
    value = tp_ring.mark_ring(ring.out, ring)
    w = torch.ones(value.shape[1], 2, dtype=torch.float64)
    product = tp_ring.product(value, w, 1)
    whole = torch.cat(shards, dim=dim)
    return torch.equal(value, whole) and (product is None if contracted else torch.equal(product, whole @ w))
