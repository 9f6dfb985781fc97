"""A linear input's tensor-parallel backward sum runs behind the weight gradients of its readers.

Plan level: the sums are marked where the runtime can put dW off (`overlaps` names the
weights), not with overlap off nor under ZeRO-3 without a pipeline; the step time hides
each behind its readers' weight-gradient seconds in a whole backward (B), by the ring
all-reduce's formula and the matmuls' FLOPs, never in a split one (I, W).
Runtime (gloo: tp, tp with SP, dp x tp with SP and ZeRO-2): every marked sum starts
async, its readers' dW run, then it is waited for; under SP the readers' input, gathered
again for dW, is in flight from before the sum starts (beside the readers' dX); the
gradients are bitwise those of the run without overlap.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fivedc.estimates.costs import op_times
from fivedc.estimates.unit_costs import unit_times
from fivedc.estimates.memo import Memo, memo_units
from fivedc.estimates.saved import SaveContext
from fivedc.estimates.step_time import estimate_time
from fivedc.estimates.transient import transients
from fivedc.frontends.dsl_file import load_model
from fivedc.ir.graph import Block, CollectiveKind, Op, Phase, Redistribute, Repeat
from fivedc.ir.hardware import hardware
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.train import TrainSettings

MODEL = "examples/tiny_llama.5d"
TP2 = "1x1x2x1x1"


def compiled(mesh: str = TP2, **options):
    return compile_graph(load_model(MODEL), CompileOptions(mesh=Mesh.parse(mesh), dtype="fp64", **options))


def marked(plan) -> dict[str, str]:
    """tensor -> overlaps, for the plan's backward sums overlapped with weight gradients."""
    return {c.tensor: c.overlaps for c in plan.collectives
            if c.phase == Phase.BACKWARD and c.overlaps.startswith("the weight gradients of")}


def test_the_sums_of_linear_inputs_are_marked_where_the_runtime_puts_dw_off() -> None:
    plan = compiled()
    readers = sorted(m.split(" of ")[1].split(" (")[0] for m in marked(plan).values())
    assert readers == ["w_gate, w_up", "w_head", "wq, wk, wv"]
    assert all(c.kind == CollectiveKind.ALL_REDUCE for c in plan.collectives if c.overlaps in marked(plan).values())
    sp = compiled(sequence_parallel=True)
    assert {c.kind for c in sp.collectives if c.overlaps in marked(sp).values()} == {CollectiveKind.REDUCE_SCATTER}
    assert marked(compiled(overlap=False)) == {}
    assert marked(compiled("2x1x2x1x1", zero=3)) == {}  # the weights are gathered copies, not leaves
    assert marked(compiled("2x2x2x1x1", zero=3, microbatches=2))  # under a pipeline they are leaves


def hidden_seconds(c: SaveContext, items, hw) -> float:
    """Per run of `items`: each marked sum's seconds by the ring formula (all-reduce 2(n-1)/n,
    gloo or NCCL reduce-scatter (n-1)/n of the bytes), or its readers' weight gradients (each
    its GEMM's roofline, tested in test_step_time.py) if those take less; under SP, plus the all-gather of the
    readers' input for dW ((n-1)/n of the bytes), or their input gradients (the op's
    roofline, tested in test_step_time.py) if those take less; and a ring reduce-scatter's
    gradient gathered back in a ring ((n-1)/n of the bytes), or (n-1)/n of its linear's
    input gradient if that takes less."""
    total = 0.0
    link = hw.nvlink_bytes_per_s * hw.link_efficiency
    for before, node in zip([None, *items], items):
        if not (isinstance(node, Redistribute) and node.backward and node.backward[0].overlaps):
            continue
        (sum_,) = node.backward
        n = c.mesh.size(*sum_.axes)
        if sum_.kind == CollectiveKind.ALL_GATHER:  # a reduce-scatter's gradient, back in a ring
            assert node.forward[0].kind == CollectiveKind.REDUCE_SCATTER and before.out == node.src
            seconds = (n - 1) / n * sum_.bytes / link + (n - 1) * hw.nvlink_latency_s
            total += min(seconds, (n - 1) / n * op_times(c, before, hw)[1])
            continue
        share = 2 * (n - 1) / n if sum_.kind == CollectiveKind.ALL_REDUCE else (n - 1) / n
        steps = 2 * (n - 1) if sum_.kind == CollectiveKind.ALL_REDUCE else n - 1
        ring = share * sum_.bytes / link + steps * hw.nvlink_latency_s
        readers = [op for op in items if isinstance(op, Op) and op.kind == "linear" and op.args[0] == node.out]
        total += min(ring, sum(op_times(c, op, hw)[2] for op in readers))
        for gather in (x for x in node.forward if x.kind == CollectiveKind.ALL_GATHER):
            seconds = (n - 1) / n * gather.bytes / link + (n - 1) * hw.nvlink_latency_s
            total += min(seconds, sum(op_times(c, op, hw)[1] for op in readers))
    return total


def ring_seconds(c: SaveContext, items, hw) -> tuple[float, float]:
    """Per run of `items`, the forward's collectives beside a linear (collective matmul): what
    they hide, and what they add. An all-gather or reduce-scatter in a ring: n-1 hops,
    (n-1)/n of the bytes and n-1 latencies, hidden up to (n-1)/n of the linear beside it (an
    all-gather's next, a reduce-scatter's maker): all but one chunk's product run beside a
    hop; it adds nothing. An all-reduce in n chunks: n ring all-reduces of 1/n of the bytes
    (n times the latency: what it adds), (n-1)/n of it or of its maker hidden, whichever is
    less: every chunk's sum but the last runs beside the next chunk's product."""
    hidden = added = 0.0
    link = hw.nvlink_bytes_per_s * hw.link_efficiency
    for before, node, after in zip([None, *items], items, [*items[1:], None]):
        if not (isinstance(node, Redistribute) and node.forward and node.forward[0].overlaps):
            continue
        (x,) = node.forward
        n = c.mesh.size(*x.axes)
        linear = after if x.kind == CollectiveKind.ALL_GATHER else before
        assert linear.kind == "linear"
        assert node.out == linear.args[0] if x.kind == CollectiveKind.ALL_GATHER else node.src == linear.out
        matmul = op_times(c, linear, hw)[0]
        if x.kind == CollectiveKind.ALL_REDUCE:
            whole = 2 * (n - 1) / n * x.bytes / link + 2 * (n - 1) * hw.nvlink_latency_s
            chunked = n * (2 * (n - 1) / n * x.bytes / n / link + 2 * (n - 1) * hw.nvlink_latency_s)
            hidden += (n - 1) / n * min(chunked, matmul)
            added += chunked - whole
        else:
            seconds = (n - 1) / n * x.bytes / link + (n - 1) * hw.nvlink_latency_s
            hidden += min(seconds, matmul * (n - 1) / n)
    return hidden, added


@pytest.mark.parametrize("sp", [False, True])
def test_the_step_hides_each_sum_behind_its_readers_weight_gradients(sp) -> None:
    hw = hardware("h100")
    plan, off = compiled(hardware=hw, sequence_parallel=sp), compiled(hardware=hw, overlap=False, sequence_parallel=sp)
    c = SaveContext.of(plan.graph, plan.mesh, dtype="fp64", dtype_bytes=8)
    layers = next(node for node in plan.graph.body.items if isinstance(node, Repeat))
    expected = layers.count * hidden_seconds(c, layers.body.items, hw) + hidden_seconds(c, plan.graph.body.items, hw)
    assert hidden_seconds(c, layers.body.items, hw) > 0
    units = memo_units(Memo(plan.graph, plan.mesh, "fp64"))
    mine = unit_times(c, plan.graph, units, hw, recompute="none")
    theirs = unit_times(SaveContext.of(off.graph, off.mesh, dtype="fp64", dtype_bytes=8), off.graph, units, hw,
                        recompute="none")
    rings = [ring_seconds(c, layers.body.items if u.layer is not None else plan.graph.body.items[u.start:u.stop], hw)
             for u in units]
    assert sum(hidden for hidden, _ in rings) > 0  # SP's gathers and reduce-scatters, else the all-reduces
    keep = hw.overlap_keep  # what hides still holds the SMs it runs on: that share is not hidden
    assert 0.8 < keep < 1
    for t, u, (hidden, added) in zip(mine, theirs, rings):
        assert (t.backward_input, t.backward_weight) == pytest.approx((u.backward_input, u.backward_weight))
        assert (t.forward, t.comm) == pytest.approx((u.forward + added - hidden * keep,
                                                     u.comm + added - hidden * keep))
        assert t.backward == pytest.approx(t.backward_input + t.backward_weight - t.hidden)
    assert sum(t.hidden for t in mine) == pytest.approx(expected * keep)
    hidden, added = (layers.count * a + b for a, b in zip(ring_seconds(c, layers.body.items, hw),
                                                         ring_seconds(c, plan.graph.body.items, hw)))
    assert off.time.compute_seconds - plan.time.compute_seconds == pytest.approx((expected + hidden) * keep - added,
                                                                               rel=1e-6)


def without_backward_overlaps(block: Block) -> Block:
    """`block` with no backward sum marked to run behind weight gradients."""
    items = []
    for node in block.items:
        if isinstance(node, Redistribute):
            node = replace(node, backward=tuple(replace(x, overlaps="") for x in node.backward))
        elif isinstance(node, Repeat):
            node = replace(node, body=without_backward_overlaps(node.body))
        items.append(node)
    return replace(block, items=tuple(items))


def step_seconds(plan, graph, hw) -> float:
    return estimate_time(graph, mesh=plan.mesh, dtype="fp64", dtype_bytes=8, zero=plan.zero, overlap=plan.overlap,
                         buckets=plan.buckets, pipeline=plan.pipeline, recompute="none", hardware=hw).compute_seconds


@pytest.mark.parametrize("schedule,hides", [("zb-h1", False), ("1f1b", True)])
def test_a_split_backward_hides_nothing(schedule, hides) -> None:
    """Zero-bubble's I runs the sum, its W the weight gradients, later: the schedule plays I and W."""
    hw = hardware("h100")
    plan = compiled("1x2x2x1x1", hardware=hw, schedule=schedule, microbatches=4)
    assert marked(plan)
    stripped = replace(plan.graph, body=without_backward_overlaps(plan.graph.body))
    assert step_seconds(plan, plan.graph, hw) == pytest.approx(plan.time.compute_seconds)
    assert (step_seconds(plan, plan.graph, hw) < step_seconds(plan, stripped, hw)) == hides
    if not hides:
        assert step_seconds(plan, plan.graph, hw) == pytest.approx(step_seconds(plan, stripped, hw))


@pytest.mark.parametrize("sp", [False, True])
def test_the_transient_counts_what_waits_for_the_sum(sp) -> None:
    """The MLP's is the largest: gate's and up's output gradients [b, s, ffn/tp] kept for dW,
    the input's gradient [b, s, hidden] and the sum's buffer, under SP the input gathered again."""
    plan = compiled(sequence_parallel=sp)
    g = plan.graph
    b, s, h, ffn = (g.dim(d) for d in ("batch", "seq", "hidden", "ffn"))
    parts = transients(g, plan.mesh, dtype="fp64", dtype_bytes=8, zero=0, pipeline=None, recompute="none", regions=[0])
    assert parts[0]["weight gradients put off"] == (2 * b * s * ffn // 2 + (3 if sp else 2) * b * s * h) * 8
    assert transients(compiled(overlap=False).graph, plan.mesh, dtype="fp64", dtype_bytes=8, zero=0, pipeline=None,
                      recompute="none", regions=[0])[0]["weight gradients put off"] == 0


def overlap_job(info, plans) -> list:
    """Per plan: the events of one training step in order (a sum started async, a weight
    gradient put off and run, a wait) and the gradients."""
    import torch.distributed as dist
    from fivedc.runtime import tp_overlap, verify, zero

    events: list[tuple] = []
    real_all_reduce, real_all_gather = dist.all_reduce, dist.all_gather
    real_run = tp_overlap.PutOff.weight_grads

    class Logged:
        def __init__(self, work, done: tuple) -> None:
            self.work, self.done = work, done

        def wait(self, *args):
            events.append(self.done)
            return self.work.wait(*args)

    def logged(real, start: str, done: str):
        def call(*args, async_op=False, **kwargs):
            work = real(*args, async_op=async_op, **kwargs)
            if not async_op:
                return work
            events.append((start, len(events)))
            return Logged(work, (done, events[-1][1]))
        return call

    trained: dict = {}  # the parameters the program reads (the optimizer's leaves)
    real_init = zero.ZeroOptimizer.__init__

    def init(self, *args, **kwargs) -> None:
        real_init(self, *args, **kwargs)
        trained.update({id(t): name.split(".")[-1] for name, t in self.params.items()})

    def run(self) -> list:
        events.extend(("dW", trained[id(self.weights[pending[0]])]) for pending in self.pending)
        return real_run(self)

    out = []
    for plan in plans:
        settings = TrainSettings(steps=1)
        program, params, inputs, _ = verify.setup_rank(plan, info, settings)
        events.clear()
        dist.all_reduce, dist.all_gather = logged(real_all_reduce, "start", "wait"), logged(real_all_gather, "gather",
                                                                                            "gathered")
        tp_overlap.PutOff.weight_grads, zero.ZeroOptimizer.__init__ = run, init
        try:
            record = verify.train_plan(plan, program, params, inputs, settings)
        finally:
            dist.all_reduce, dist.all_gather = real_all_reduce, real_all_gather
            tp_overlap.PutOff.weight_grads, zero.ZeroOptimizer.__init__ = real_run, real_init
        out.append((list(events), record.grads[0]))
    return out


def sums_and_readers(events: list[tuple]) -> list[tuple[tuple[str, ...], bool]]:
    """Per async sum that had weight gradients run while it was in flight (sums with none,
    such as gradient buckets, left out): those weights, and whether an all-gather started
    early (SP's input gathered again) was in flight when the sum started. Fails on a weight
    gradient run with no sum in flight."""
    found, open_, gathering = [], {}, set()
    for kind, what in events:
        if kind == "gather":
            gathering.add(what)
        elif kind == "gathered":
            gathering.discard(what)
        elif kind == "start":
            open_[what] = ([], bool(gathering))
        elif kind == "dW":
            assert open_, f"the weight gradient of {what} ran with no sum in flight"
            open_[max(open_)][0].append(what)  # the sum started last
        elif (sum_ := open_.pop(what))[0]:
            found.append((tuple(sorted(sum_[0])), sum_[1]))
    assert not open_
    return found


@pytest.mark.parametrize("mesh,options", [
    (TP2, {}),
    (TP2, dict(sequence_parallel=True)),
    # the head's weight is a bucket of its own, started from its hook: by the weight's real gradient only
    ("2x1x2x1x1", dict(sequence_parallel=True, zero=2)),
])
def test_each_sum_runs_while_its_readers_weight_gradients_are_computed(mesh, options, worker_pool) -> None:
    on, off = compiled(mesh, **options), compiled(mesh, overlap=False, **options)
    layers = next(node for node in on.graph.body.items if isinstance(node, Repeat)).count
    for (events, grads), (events_off, grads_off) in worker_pool.run(overlap_job, world=on.mesh.world, payload=[on, off]):
        assert not [e for e in events_off if e[0] == "dW"]  # nothing put off
        # backward order: the head's input, then per layer (last first) the MLP's and the attention's
        early = bool(options.get("sequence_parallel"))  # each input's gather runs beside the readers' dX
        assert sums_and_readers(events) == \
            [(("w_head",), early)] + [(("w_gate", "w_up"), early), (("wk", "wq", "wv"), early)] * layers
        assert grads.keys() == grads_off.keys()
        for name in grads:
            assert torch.equal(grads[name], grads_off[name]), name
