"""Context parallelism: the sequence layout, the plan, bad input, and equivalence.

Plan-level tests need no processes; the property test trains random models with
cp in {2, 4} composed with dp and tp (world <= 8), both attention variants, both
layouts, causal or not, GQA, against the single-device run in float64.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fivedc.errors import NotSupportedError, ShapeError, ShardingError
from fivedc.frontends.dsl_file import load_model, parse_model
from fivedc.ir.graph import CollectiveKind, Op, Phase, walk_ops
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.base import CompileOptions
from fivedc.passes.communication import plan_steps
from fivedc.pipeline import compile_graph
from fivedc.runtime.train import TrainSettings
from fivedc.runtime.verify import single_device_mesh, verify_plan
from fivedc.ir.seq_layout import SeqLayout, layout_order
from fivedc.ir.sharding import Sharding
from random_models import Case, draw_cp_case, model_text

TOL = 1e-10
CP, TP = MeshAxis.CP, MeshAxis.TP
K = CollectiveKind


def compile_text(text: str, mesh: str, **options):
    return compile_graph(parse_model(text, filename="m.5d"), CompileOptions(mesh=Mesh.parse(mesh), **options))


def small(*, causal: bool = True, seq: int = 8, style: str = "llama") -> str:
    return model_text(style=style, batch=2, seq=seq, heads=4, kv_heads=2, head_dim=4, ffn=8, vocab=8,
                      layers=2, causal=causal)


# ---- the chunk layout ---------------------------------------------------------------------
def test_balanced_layout_gives_rank_r_chunks_r_and_mirror() -> None:
    assert layout_order(SeqLayout.BALANCED, 8, 2) == [0, 1, 6, 7, 2, 3, 4, 5]
    assert layout_order(SeqLayout.BALANCED, 8, 4) == [0, 7, 1, 6, 2, 5, 3, 4]
    assert layout_order(SeqLayout.CONTIGUOUS, 8, 4) == list(range(8))
    assert layout_order(SeqLayout.BALANCED, 6, 1) == list(range(6))


@given(cp=st.sampled_from([2, 4, 8]), chunk=st.integers(1, 6))
def test_balanced_layout_evens_out_causal_work(cp: int, chunk: int) -> None:
    """Every rank gets the same number of (query, key) pairs under a causal mask, and
    the layout is a permutation."""
    seq = 2 * cp * chunk
    order = layout_order(SeqLayout.BALANCED, seq, cp)
    assert sorted(order) == list(range(seq))
    per_rank = seq // cp
    work = [sum(p + 1 for p in order[r * per_rank:(r + 1) * per_rank]) for r in range(cp)]
    assert len(set(work)) == 1
    contiguous = layout_order(SeqLayout.CONTIGUOUS, seq, cp)
    assert len({sum(p + 1 for p in contiguous[r * per_rank:(r + 1) * per_rank]) for r in range(cp)}) == cp


# ---- redistribution of a dim split over cp and tp -----------------------------------------
def test_plan_steps_change_only_the_inner_end_of_a_split_dim() -> None:
    mesh = Mesh.parse("1x1x2x2x1")
    seq_cp = Sharding.of(seq=(CP,))
    seq_cp_tp = Sharding.of(seq=(CP, TP))
    forward, backward = plan_steps(seq_cp.with_partial((TP,)), seq_cp_tp, (), mesh=mesh)
    assert forward == [(K.REDUCE_SCATTER, TP, "seq", None)]
    assert backward == [(K.ALL_GATHER, TP, "seq", None)]
    forward, backward = plan_steps(seq_cp_tp, Sharding(), (CP, TP), mesh=mesh)
    assert forward == [(K.ALL_GATHER, TP, "seq", None), (K.ALL_GATHER, CP, "seq", None)]  # innermost first
    assert backward == [(K.REDUCE_SCATTER, CP, "seq", None), (K.REDUCE_SCATTER, TP, "seq", None)]
    forward, _ = plan_steps(Sharding(), seq_cp_tp, (), mesh=mesh)
    assert forward == [(K.SLICE, CP, "seq", None), (K.SLICE, TP, "seq", None)]  # outermost first
    with pytest.raises(NotSupportedError, match="innermost"):
        plan_steps(seq_cp_tp, Sharding.of(seq=(TP, CP)), (), mesh=mesh)


# ---- the plan --------------------------------------------------------------------------------
def _attention_ops(plan):
    return [node for node, _ in walk_ops(plan.graph.body) if isinstance(node, Op) and node.kind == "attention"]


def test_ring_plan_streams_kv_blocks_and_never_gathers_the_sequence() -> None:
    plan = compile_text(small(), "2x1x2x2x1", sequence_parallel=True, dtype="fp32")
    assert plan.graph.seq_layout == SeqLayout.BALANCED
    hops = [c for c in plan.collectives if c.kind == K.SEND_RECV]
    # per layer: forward K/V (cp-1 hops), backward K/V (cp-1) and their gradients (cp); 2 layers
    assert sorted((c.phase, c.count) for c in hops) == [(Phase.BACKWARD, 2), (Phase.BACKWARD, 4), (Phase.FORWARD, 2)]
    # one K/V block: [batch/dp, seq/cp, kv_heads/tp, head_dim] for k and for v, fp32
    assert {c.bytes for c in hops} == {2 * (1 * 4 * 1 * 4) * 4}
    assert all("ring attention" in c.reason and c.axes == (CP,) for c in hops)
    gathered_over_cp = [c for c in plan.collectives if CP in c.axes and c.kind in (K.ALL_GATHER, K.ALL_TO_ALL)]
    assert gathered_over_cp == []
    assert all(str(op.annotation("cp")) == "@cp(ring)" for op in _attention_ops(plan))


def test_allgather_plan_gathers_kv_and_reduce_scatters_their_gradients() -> None:
    plan = compile_text(small(), "1x1x1x4x1", cp_attention="allgather", dtype="fp32")
    over_cp = [(c.phase, c.kind, c.tensor) for c in plan.collectives if c.axes == (CP,)]
    assert (Phase.FORWARD, K.ALL_GATHER, "k") in over_cp and (Phase.FORWARD, K.ALL_GATHER, "linear#2") in over_cp
    assert (Phase.BACKWARD, K.REDUCE_SCATTER, "k") in over_cp
    assert not any(c.kind == K.SEND_RECV for c in plan.collectives)
    gather = next(c for c in plan.collectives if c.kind == K.ALL_GATHER and c.tensor == "k")
    assert gather.bytes == 2 * 8 * 2 * 4 * 4  # the gathered K: batch, seq, kv_heads, head_dim in fp32
    assert "attention @cp(allgather)" in gather.reason


def test_variant_precedence_op_then_command_line_then_model() -> None:
    text = small().replace("model random_llama {", "model random_llama @cp(allgather) {")
    assert {str(op.annotation("cp")) for op in _attention_ops(compile_text(text, "1x1x1x2x1"))} == {"@cp(allgather)"}
    plan = compile_text(text, "1x1x1x2x1", cp_attention="ring")
    assert {str(op.annotation("cp")) for op in _attention_ops(plan)} == {"@cp(ring)"}
    pinned = text.replace("causal=true)", "causal=true) @cp(allgather)")
    plan = compile_text(pinned, "1x1x1x2x1", cp_attention="ring")
    assert {str(op.annotation("cp")) for op in _attention_ops(plan)} == {"@cp(allgather)"}


def test_layout_defaults_to_balanced_only_for_causal_attention() -> None:
    assert compile_text(small(causal=False), "1x1x1x2x1").graph.seq_layout == SeqLayout.CONTIGUOUS
    assert compile_text(small(causal=True), "1x1x1x2x1").graph.seq_layout == SeqLayout.BALANCED
    chosen = compile_text(small(), "1x1x1x2x1", cp_layout="contiguous")
    assert chosen.graph.seq_layout == SeqLayout.CONTIGUOUS
    text = small().replace("model random_llama {", "model random_llama @cp(contiguous) {")
    assert compile_text(text, "1x1x1x2x1").graph.seq_layout == SeqLayout.CONTIGUOUS


def test_learned_positions_split_with_the_sequence_and_plan_round_trips(tmp_path) -> None:
    plan = compile_text(small(style="gpt"), "2x1x1x2x1")
    wpe = next(p for p in plan.graph.body.params if p.name == "wpe")
    assert str(wpe.sharding) == "seq:cp" and wpe.grad_partial == (MeshAxis.DP,)
    norm = next(p for p in plan.graph.body.params if p.name == "lnf")
    assert norm.grad_partial == (CP, MeshAxis.DP)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert type(plan).load(path) == plan


# ---- bad input ----------------------------------------------------------------------------
def test_sequence_not_divisible_by_2cp_names_the_numbers_and_the_line() -> None:
    with pytest.raises(ShapeError) as error:
        compile_text(small(seq=12), "1x1x1x4x1")
    message = error.value.render()
    assert "seq=12 is not divisible by 8" in message and "balanced" in message
    assert "m.5d:5:" in message  # the `seq = 12` line
    assert "contiguous" in message  # 12 divides by cp=4 without the balanced halves
    with pytest.raises(ShapeError, match=r"seq=12 is not divisible by 8 \(the contiguous layout"):
        compile_text(small(seq=12), "1x1x1x8x1", cp_layout="contiguous")


def test_cp_annotation_on_a_non_attention_op_is_an_error_at_its_line() -> None:
    text = small().replace("x = add(x, linear(a, wo))", "x = add(x, linear(a, wo) @cp(ring))")
    with pytest.raises(ShardingError) as error:
        compile_text(text, "1x1x1x1x1")
    assert "asks for a context-parallel attention variant, but this op is linear" in str(error.value)
    assert error.value.loc.line == text.splitlines().index(
        next(line for line in text.splitlines() if "@cp(ring)" in line)) + 1


def test_unknown_cp_choices_are_errors() -> None:
    with pytest.raises(ShardingError, match="takes one of: ring, allgather"):
        compile_text(small().replace("causal=true)", "causal=true) @cp(rings)"), "1x1x1x2x1")
    with pytest.raises(ShardingError, match="not a choice"):
        compile_text(small().replace("model random_llama {", "model random_llama @cp(fast) {"), "1x1x1x2x1")
    with pytest.raises(Exception, match="unknown cp attention variant"):
        CompileOptions(mesh=Mesh.parse("1x1x1x2x1"), cp_attention="ringg")


def test_cp_on_a_model_without_a_sequence_dim_is_an_error() -> None:
    text = """model mlp {
  dims { batch = 4
    features = 8
    classes = 8 }
  input x: float[batch, features]
  input labels: int[batch]
  param w: [features, classes]
  loss = cross_entropy(linear(x, w), labels)
  return loss
}"""
    with pytest.raises(ShapeError) as error:
        compile_text(text, "1x1x1x2x1")
    assert "has no sequence dim" in str(error.value) and error.value.loc.line == 5


# ---- equivalence with the single-device run ------------------------------------------------
def check(graph, case: Case, pool) -> None:
    options = CompileOptions(mesh=Mesh.parse(case.mesh), sequence_parallel=case.sp, dtype="fp64",
                             cp_attention=case.cp_attention, cp_layout=case.cp_layout)
    plan = compile_graph(graph, options)
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    report = verify_plan(plan, reference, settings=TrainSettings(steps=2), pool=pool)
    assert report.max_error <= TOL, report
    assert report.losses[1] != report.losses[0]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=draw_cp_case())
def test_random_cp_models_match_single_device(case: Case, worker_pool) -> None:
    check(parse_model(case.text, filename="<random>"), case, worker_pool)


@pytest.mark.parametrize("mesh,sp,variant", [
    ("1x1x2x4x1", True, "ring"),
    ("2x1x2x2x1", False, "allgather"),
    ("2x1x1x4x1", False, "ring"),
])
@pytest.mark.parametrize("example", ["gpt", "tiny_llama"])
def test_examples_with_cp_match_single_device(example: str, mesh: str, sp: bool, variant: str, worker_pool) -> None:
    check(load_model(f"examples/{example}.5d"), Case("", mesh, sp, cp_attention=variant), worker_pool)


def test_a_missing_cp_gradient_reduction_is_caught(worker_pool) -> None:
    graph = load_model("examples/tiny_llama.5d")
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse("1x1x1x2x1"), dtype="fp64"))
    body = plan.graph.body
    params = tuple(replace(p, grad_partial=tuple(a for a in p.grad_partial if a != CP)) for p in body.params)
    broken = replace(plan, graph=replace(plan.graph, body=replace(body, params=params)))
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    report = verify_plan(broken, reference, settings=TrainSettings(steps=2), pool=worker_pool)
    assert report.grad_error > 1e-3


# ---- a sliding window --------------------------------------------------------------------
def windowed(window: int) -> str:
    """`small` at sequence 16 with a sliding window of `window` keys on its attention."""
    return small(seq=16).replace("causal=true)", f"causal=true, window={window})")


@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_a_sliding_window_splits_the_sequence_and_matches_single_device(variant: str, worker_pool,
                                                                       tmp_path) -> None:
    """window=3 of 16 positions: the attention keeps its window under cp (the sequence split, not
    replicated) and in the saved plan, and the run equals one device's, which computes the band itself."""
    graph = parse_model(windowed(3), filename="m.5d")
    plan = compile_text(windowed(3), "1x1x1x2x1", dtype="fp64", cp_attention=variant)
    ops = _attention_ops(plan)
    assert ops and all(op.attr("window") == 3 and str(op.annotation("cp")) == f"@cp({variant})" for op in ops)
    assert all(op.sharding.axes_of("seq") == (CP,) for op in ops), [op.sharding for op in ops]
    plan.save(tmp_path / "plan.json")
    assert type(plan).load(tmp_path / "plan.json") == plan
    check(graph, Case("", "1x1x1x2x1", False, cp_attention=variant), worker_pool)


def test_the_window_changes_the_run(worker_pool) -> None:
    """A plan whose attention lost a key of its window differs from the reference: the check can fail."""
    plan = compile_text(windowed(2), "1x1x1x2x1", dtype="fp64")
    reference = compile_graph(parse_model(windowed(3), filename="m.5d"),
                              CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    report = verify_plan(plan, reference, settings=TrainSettings(steps=1), pool=worker_pool)
    assert report.max_error > 1e-3


def test_a_window_counts_only_its_keys_in_the_estimate() -> None:
    """window W of seq: W (1 - W / 2 seq) keys a query; as long as the sequence: plain causal (seq / 2)."""
    from fivedc.estimates.costs import attended_keys

    def keys(text: str) -> float:
        return attended_keys(_attention_ops(compile_text(text, "1x1x1x2x1"))[0], 16)

    assert keys(small(seq=16)) == keys(windowed(16)) == keys(windowed(40)) == 8.0
    assert keys(windowed(4)) == 3.5 and keys(windowed(1)) == 1 - 1 / 32


@pytest.mark.parametrize("attrs, message", [("causal=false, window=3", "needs causal=true"),
                                            ("causal=true, window=-1", "got -1")])
def test_a_bad_window_is_an_error_at_its_line(attrs: str, message: str) -> None:
    text = small(seq=16).replace("causal=true)", f"{attrs})")
    with pytest.raises(ShapeError) as error:
        compile_text(text, "1x1x1x1x1")
    assert message in str(error.value) and error.value.loc.line == 27  # the attention's line
