"""Tensor parallelism's forward collectives beside their linears (collective matmul).

Under SP, the gather before a column-parallel linear runs in a ring, the linear
multiplying each chunk as it arrives, and the reduce-scatter after a row-parallel linear
runs in a ring, the linear making each chunk as the ring needs it; without SP, the
all-reduce after a row-parallel linear runs by chunks, each summed while the next is made.

Plan level: with overlap on, the forward all-gathers whose next op is a linear reading
them, and the reduce-scatters and all-reduces of the linear just before, are marked
(`overlaps` names the matmul; an all-reduce's `dim` is the one it is cut along); none with
overlap off. Runtime (gloo, 4 ranks): the gather's ring brings chunk i, i-1, i-2, i-3 and
posts the next hop before the product of the chunk just in; the sum's ring makes chunk
i-1, i-2, i-3, i, each before waiting for the hop that brings the previous member's sum
of it; so one hop is always in flight while a chunk multiplies; in backward the sum's
gradient comes back in a ring, the linear's input gradient made a chunk at a time, bitwise
the gradients without it. The chunked all-reduce
starts each chunk's sum (async) before making the next. The products, the gathered
tensor and the sums are those of the whole collectives. A model at tp4, with and
without SP, with full recomputation, trains to the gradients of the run without them.
The step-time model is tested in tests/test_tp_overlap.py, the hops and chunks against
what the runtime calls in tests/test_agreement.py.
"""

from __future__ import annotations

import pytest
import torch

from fivedc.frontends.dsl_file import load_model
from fivedc.ir.graph import Phase, Redistribute, walk_ops
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.collectives import Step
from fivedc.runtime.train import TrainSettings


def compiled(model: str = "examples/tiny_llama.5d", mesh: str = "1x1x2x1x1", **options):
    return compile_graph(load_model(model), CompileOptions(mesh=Mesh.parse(mesh), dtype="fp64", **options))


def rings(plan, kind: str) -> list[str]:
    """The matmul each forward collective of `kind` run in a ring names, in program order."""
    return [node.forward[0].overlaps.split(",")[0].removeprefix("the matmul of ")
            for node, _ in walk_ops(plan.graph.body) if isinstance(node, Redistribute) and node.forward
            and node.forward[0].overlaps and node.forward[0].kind == kind]


def test_the_collectives_beside_a_linear_are_run_in_rings() -> None:
    plan = compiled(sequence_parallel=True)
    assert rings(plan, "all_gather") == ["wq", "w_gate", "w_head"]  # the first reader of each gathered input
    assert rings(plan, "reduce_scatter") == ["wo", "w_down"]  # the row-parallel linears making them
    back = [node.backward[0].overlaps for node, _ in walk_ops(plan.graph.body) if isinstance(node, Redistribute)
            and node.forward and node.forward[0].kind == "reduce_scatter" and node.forward[0].overlaps]
    assert back == [f"the input gradient of {w}, chunk by chunk as a ring brings them (collective matmul)"
                    for w in ("wo", "w_down")]  # their gradients' gathers, in backward
    in_layers = [c for c in plan.collectives if c.phase == Phase.FORWARD and c.count == 2]
    assert in_layers and all(c.overlaps.endswith("(collective matmul)") for c in in_layers)
    top = [node.forward[0] for node in plan.graph.body.items if isinstance(node, Redistribute) and node.forward]
    assert [(c.kind, bool(c.overlaps)) for c in top] == \
        [("reduce_scatter", False), ("all_gather", True)]  # the embedding's (no linear makes it), the head's input
    off = compiled(sequence_parallel=True, overlap=False)
    assert rings(off, "all_gather") == rings(off, "reduce_scatter") == []
    no_sp = compiled()  # the linears read a replicated input; the row-parallel ones' all-reduces go by chunks
    assert rings(no_sp, "all_gather") == rings(no_sp, "reduce_scatter") == []
    assert rings(no_sp, "all_reduce") == ["wo", "w_down"]
    chunked = [node.forward[0] for node, _ in walk_ops(no_sp.graph.body) if isinstance(node, Redistribute)
               and node.forward and node.forward[0].overlaps]
    assert [(c.dim, c.overlaps.split(", ")[1]) for c in chunked] == [("batch", "in 2 chunks along batch")] * 2
    assert rings(compiled(overlap=False), "all_reduce") == []


def test_the_summary_counts_the_collectives_beside_compute() -> None:
    """tiny_llama's 2 layers under SP: per layer the q and gate gathers, the o and down
    reduce-scatters, their gradients' gathers and the q and gate inputs' gradient sums, all
    8; at the top the head's gather and its gradient's sum, not the embedding's
    reduce-scatter nor its gradient's gather: 2 of 4."""
    from rich.console import Console

    from fivedc.plan.summary import render_summary

    def header(plan) -> str:
        console = Console(width=200, record=True)
        render_summary(plan, console=console)
        return next(line for line in console.export_text().splitlines() if line.startswith("overlap"))

    assert "18 of the 20 redistributions' collectives per step run beside compute" in header(
        compiled(sequence_parallel=True))
    assert "beside compute" not in header(compiled(sequence_parallel=True, overlap=False))


def ring_job(info, payload) -> dict:
    """On a 4-rank tp group: a ring gathers a seeded shard per rank along dim 1, `product`
    multiplies it; each chunk's group index and how many hops were posted when it multiplied."""
    from fivedc.runtime import tp_ring
    from fivedc.runtime.groups import MeshGroups
    from fivedc.ir.mesh import MeshAxis

    groups = MeshGroups(Mesh.parse("1x1x4x1x1"), device_type="cpu")
    shards = [torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(4)]
    w = torch.randn(5, 7, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ring = tp_ring.start_ring(shards[info.rank], Step("all_gather", (MeshAxis.TP,), 1), groups)
    seen, arrivals = [], ring.arrivals

    def logged():
        for index, chunk in arrivals():
            seen.append((index, len(ring.transfers)))
            yield index, chunk

    ring.arrivals = logged
    value = ring.out
    product = tp_ring.product(value, w, 1, ring)
    whole = torch.cat(shards, dim=1)
    return dict(seen=seen, product=torch.equal(product, whole @ w), gathered=torch.equal(value, whole))


def test_each_chunk_multiplies_while_the_next_hop_runs(worker_pool) -> None:
    for rank, got in enumerate(worker_pool.run(ring_job, world=4, payload=None)):
        assert got["product"] and got["gathered"], rank
        # its own chunk first, then what each hop brought from the previous member; the
        # hop after a chunk's is posted before that chunk multiplies, none after the third
        assert got["seen"] == [(rank, 1), ((rank - 1) % 4, 2), ((rank - 2) % 4, 3), ((rank - 3) % 4, 3)]


def grads_job(info, plans) -> list:
    """Per plan: the gradients of one step, and after a forward of the plan's program the
    rings' values still held by them (none: a ring lets go of its value once it is done).
    The rings are those the forward made, each recorded (weakly) as it is made: no scan of
    the worker's heap, where an earlier job may have left anything (a dead weakref proxy
    raises ReferenceError on isinstance)."""
    import weakref

    from fivedc.runtime import tp_ring, verify

    made: weakref.WeakSet = weakref.WeakSet()  # the rings of this forward still alive
    count = [0]  # and how many it made
    init = tp_ring._Ring.__init__

    def recorded(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        made.add(self)
        count[0] += 1

    out = []
    tp_ring._Ring.__init__ = recorded
    try:
        for plan in plans:
            settings = TrainSettings(steps=1)
            program, params, inputs, _ = verify.setup_rank(plan, info, settings)
            made.clear()
            count[0] = 0
            loss = program.loss({k: v.detach().requires_grad_() for k, v in params.items()}, inputs)
            # rings made exactly where the plan runs its collectives in rings (else nothing to look at)
            assert (count[0] > 0) == any(rings(plan, kind) for kind in ("all_gather", "reduce_scatter", "all_reduce"))
            held = [ring for ring in made if isinstance(getattr(ring, "out", None), torch.Tensor)]
            del loss
            out.append((verify.train_plan(plan, program, params, inputs, settings).grads[0], len(held)))
    finally:
        tp_ring._Ring.__init__ = init
    return out


@pytest.mark.parametrize("sp", [True, False])
def test_a_model_in_rings_trains_as_with_whole_collectives(sp, worker_pool) -> None:
    """tp4 with SP (rings of three hops) or without (all-reduces by 4 chunks), and full
    recomputation (they run again in backward)."""
    on = compiled("examples/gpt.5d", "1x1x4x1x1", sequence_parallel=sp, recompute="full")
    off = compiled("examples/gpt.5d", "1x1x4x1x1", sequence_parallel=sp, recompute="full", overlap=False)
    assert (rings(on, "all_gather") and rings(on, "reduce_scatter")) if sp else rings(on, "all_reduce")
    for (grads, held), (grads_off, _) in worker_pool.run(grads_job, world=4, payload=[on, off]):
        assert held == 0  # the values (whole activations) are the program's to keep or let go
        assert grads.keys() == grads_off.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], grads_off[name], rtol=1e-12, atol=1e-12, msg=name)


def sum_job(info, payload) -> dict:
    """On a 4-rank tp group: a ring sums each rank's seeded product x_r @ w along dim 1 as
    `summed_product` makes it; the order of parts made and hops waited for, and the results."""
    from fivedc.runtime import tp_ring
    from fivedc.runtime.groups import MeshGroups
    from fivedc.ir.mesh import MeshAxis

    groups = MeshGroups(Mesh.parse("1x1x4x1x1"), device_type="cpu")
    xs = [torch.randn(2, 8, 5, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(4)]
    w = torch.randn(5, 3, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ring, events = tp_ring.RingSum(Step("reduce_scatter", (MeshAxis.TP,), 1), groups), []
    exchange, run = ring._exchange, ring.run

    class Logged:
        def __init__(self, transfer) -> None:
            self.transfer = transfer

        def wait(self) -> None:
            events.append("waited")
            self.transfer.wait()

    def logged_exchange(send):
        received, transfer = exchange(send)
        events.append("posted")
        return received, Logged(transfer)

    def logged_run(part):
        return run(lambda j: (events.append(j), part(j))[1])

    ring._exchange, ring.run = logged_exchange, logged_run
    partial = tp_ring.summed_product(xs[info.rank], w, 1, ring)
    total = sum(x @ w for x in xs)
    return dict(events=events, partial=torch.equal(partial, xs[info.rank] @ w),
                summed=torch.allclose(ring.out, total[:, 2 * info.rank:2 * info.rank + 2], rtol=1e-14, atol=1e-14))


def test_each_chunk_is_made_while_the_last_ones_sum_moves_on(worker_pool) -> None:
    for rank, got in enumerate(worker_pool.run(sum_job, world=4, payload=None)):
        assert got["partial"] and got["summed"], rank
        # chunk i-1 first (its sum starts here), this rank's own last; each made before the
        # hop bringing the previous member's sum of it is waited for
        first, second, third = ((rank - t) % 4 for t in (1, 2, 3))
        assert got["events"] == [first, "posted", second, "waited", "posted", third, "waited", "posted", rank,
                                 "waited"]


def chunked_job(info, payload) -> dict:
    """On a 4-rank tp group: each rank's seeded product x_r @ w summed in 4 chunks along dim 1
    as `summed_product` makes them; the order of chunks made and sums started, and the sum."""
    import torch.distributed as dist
    from fivedc.runtime import tp_ring
    from fivedc.runtime.groups import MeshGroups
    from fivedc.ir.mesh import MeshAxis

    groups = MeshGroups(Mesh.parse("1x1x4x1x1"), device_type="cpu")
    xs = [torch.randn(2, 8, 5, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(4)]
    w = torch.randn(5, 3, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ring, events, real = tp_ring.ChunkedSum(Step("all_reduce", (MeshAxis.TP,), 1), groups), [], dist.all_reduce
    run = ring.run

    def logged_all_reduce(t, *args, async_op=False, **kwargs):
        events.append(("sum", async_op, tuple(t.shape)))
        return real(t, *args, async_op=async_op, **kwargs)

    ring.run = lambda part: run(lambda j: (events.append(j), part(j))[1])
    dist.all_reduce = logged_all_reduce
    try:
        partial = tp_ring.summed_product(xs[info.rank], w, 1, ring)
    finally:
        dist.all_reduce = real
    total = sum(x @ w for x in xs)
    return dict(events=events, partial=torch.equal(partial, xs[info.rank] @ w),
                summed=torch.allclose(ring.out, total, rtol=1e-14, atol=1e-14))


def test_each_chunk_is_summed_while_the_next_is_made(worker_pool) -> None:
    for rank, got in enumerate(worker_pool.run(chunked_job, world=4, payload=None)):
        assert got["partial"] and got["summed"], rank
        assert got["events"] == [e for j in range(4) for e in (j, ("sum", True, (2, 2, 3)))]


def grad_ring_job(info, payload) -> dict:
    """On a 4-rank tp group: a row-parallel product summed in a ring, trained one backward with
    its gradient gathered in a ring (the linear's input gradient a chunk at a time) and
    without rings; the chunks' order as the linear's backward took them, and both gradients."""
    from fivedc.ir.mesh import MeshAxis
    from fivedc.runtime import tp_ring
    from fivedc.runtime.collectives import redistribute
    from fivedc.runtime.groups import MeshGroups

    groups = MeshGroups(Mesh.parse("1x1x4x1x1"), device_type="cpu")
    seeded = lambda shape, seed: torch.randn(*shape, generator=torch.Generator().manual_seed(seed),  # noqa: E731
                                             dtype=torch.float64)
    up = seeded((2, 2, 3), 10 + info.rank)  # the gradient of this rank's chunk of the sum
    steps = ([Step("reduce_scatter", (MeshAxis.TP,), 1)], [Step("all_gather", (MeshAxis.TP,), 1)])
    seen, arrivals = [], tp_ring.RingGather.arrivals

    def logged(ring):
        for index, chunk in arrivals(ring):
            seen.append((index, len(ring.transfers)))
            yield index, chunk

    def trained(ringed: bool):
        x, w = seeded((2, 8, 5), info.rank).requires_grad_(), seeded((5, 3), 9).requires_grad_()
        if ringed:
            ring = tp_ring.RingSum(steps[0][0], groups, grad_step=steps[1][0])
            y = tp_ring.Product.apply(x, w, 1, tp_ring.summed_product(x, w, 1, ring), ring)
            out = redistribute(y, *steps, groups, None, ring)
        else:
            out = redistribute(torch.tensordot(x, w, dims=1), *steps, groups)
        (out * up).sum().backward()
        return x.grad, w.grad

    tp_ring.RingGather.arrivals = logged
    try:
        ringed = trained(True)
    finally:
        tp_ring.RingGather.arrivals = arrivals
    whole = trained(False)
    # dW from the whole gradient: bitwise. dX by rows: a matmul's rows made apart equal the
    # whole's only up to the BLAS kernel's blocking (one ulp on some CPUs), so to reassociation
    (dx, dw), (whole_dx, whole_dw) = ringed, whole
    return dict(seen=seen, equal=torch.equal(dw, whole_dw) and torch.allclose(dx, whole_dx, rtol=1e-14, atol=0))


def test_a_sums_gradient_comes_back_by_chunks_into_the_input_gradient(worker_pool) -> None:
    for rank, got in enumerate(worker_pool.run(grad_ring_job, world=4, payload=None)):
        assert got["equal"], rank  # dX by rows (to reassociation), dW from the whole gradient (bitwise)
        assert got["seen"] == [(rank, 1), ((rank - 1) % 4, 2), ((rank - 2) % 4, 3), ((rank - 3) % 4, 3)]


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
    ring = tp_ring.start_ring(shards[info.rank], Step("all_gather", (MeshAxis.TP,), dim), groups)
    value = ring.out
    w = torch.ones(value.shape[1], 2, dtype=torch.float64)
    product = tp_ring.product(value, w, 1, ring)
    whole = torch.cat(shards, dim=dim)
    return torch.equal(value, whole) and (product is None if contracted else torch.equal(product, whole @ w))
