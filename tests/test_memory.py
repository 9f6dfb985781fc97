"""Memory per class of ranks in the plan: its JSON shape, its classes, and the transient parts.

Plan-level, no processes. The transient parts are held against what each buffer is
(`fivedc/estimates/transient.py`): ZeRO-3's gathered groups and the prefetched next one, the
logits' gradient beside the kept softmax, ZeRO-2's whole buckets in flight, ring
attention's K/V blocks, computed by hand from the model's dims.
"""

from __future__ import annotations

import json

from fivedc.frontends.dsl_file import load_model, parse_model
from fivedc.estimates.memory import CATEGORIES, rank_activations
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.plan.summary import format_bytes
from fivedc.estimates.transient import transients
from random_models import model_text

TEXT = model_text(style="llama", batch=8, seq=32, heads=4, kv_heads=2, head_dim=8, ffn=64, vocab=512, layers=4,
                  causal=True)


def compile_text(mesh: str, **options):
    return compile_graph(parse_model(TEXT, filename="m.5d"), CompileOptions(mesh=Mesh.parse(mesh), **options))


def parts_of(plan) -> list[dict[str, int]]:
    kw = dict(dtype=plan.dtype, dtype_bytes=2 if plan.dtype == "bf16" else 4, pipeline=plan.pipeline,
              recompute=plan.recompute)
    _, regions = rank_activations(plan.graph, plan.mesh, **kw)
    return transients(plan.graph, plan.mesh, zero=plan.zero, regions=regions, buckets=plan.buckets, **kw)


def test_the_plan_json_has_one_entry_per_class_of_ranks(tmp_path) -> None:
    plan = compile_text("2x4x1x1x1", schedule="1f1b", microbatches=4)
    path = tmp_path / "p.json"
    plan.save(path)
    entries = json.loads(path.read_text())["memory"]["ranks"]
    assert {tuple(e) for e in entries} == {("ranks", *CATEGORIES)}
    for e in entries:
        assert e["total"] == sum(e[k] for k in CATEGORIES[:-1]) and all(isinstance(e[k], int) for k in CATEGORIES[1:])
    covered = [r for e in plan.memory.ranks for r in e.pp_ranks(4)]
    assert sorted(covered) == [0, 1, 2, 3]  # each pp rank in exactly one class
    first, last = plan.memory.of_pp_rank(0, 4), plan.memory.of_pp_rank(3, 4)
    assert first.activations > last.activations  # 1F1B: stage 0 keeps p microbatches, the last one
    assert plan.memory.total == max(e.total for e in plan.memory.ranks)


def test_the_plan_stays_flat_in_the_world_size() -> None:
    """Llama 3 405B on 16384 ranks: one class per pp rank at most (16), whatever dp; with
    the same microbatch (one sequence) a pp rank keeps the same activations at dp=8."""
    a = compile_graph(load_model("examples/llama3_405b.5d"),
                      CompileOptions(mesh=Mesh.parse("128x16x8x1x1"), sequence_parallel=True, zero=1))
    b = compile_graph(load_model("examples/llama3_405b.5d"),
                      CompileOptions(mesh=Mesh.parse("8x16x8x1x1"), sequence_parallel=True, zero=1, microbatches=256))
    assert 1 < len(a.memory.ranks) <= 16 and len(b.memory.ranks) <= 16
    assert all(x.activations == y.activations for x, y in zip(a.memory.ranks, b.memory.ranks))


def test_zero3_transient_is_a_unit_of_groups_and_the_next_group() -> None:
    """ZeRO-3 without a pipeline gathers by group (the buckets): in forward the groups of
    the running unit and the next group, prefetched; in backward a group gathered again,
    its gradients and their reduce-scatter buffer (3 x the group). Here the top level's
    groups are the vocab table (512 x 32) and the head with the final norm (32 x 512 + 32),
    bf16, and the largest group is the head's."""
    plan = compile_text("4x1x1x1x1", zero=3)
    table, head = 512 * 32 * 2, (32 * 512 + 32) * 2
    layer = (32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 64 + 2 * 32) * 2
    assert sorted(b.bytes for b in plan.buckets) == sorted([table, head, layer])
    assert parts_of(plan)[0]["ZeRO-3 gathers"] == max(table + head + head, 3 * head)
    piped = compile_text("2x2x1x1x1", zero=3, schedule="1f1b", microbatches=2)
    for r, parts in enumerate(parts_of(piped)):  # under a pipeline: the rank's whole parameters and gradients
        assert parts["ZeRO-3 gathers"] == 2 * piped.memory.of_pp_rank(r, 2).params * 2 // 2 * 2  # chunk x dp=2, x2


def test_the_loss_transient_is_twice_the_logits() -> None:
    """The logits' gradient in backward beside the kept softmax, and one temporary: 2 x
    batch x seq x vocab/t in float32 (bf16 logits: the loss computes in float32)."""
    plan = compile_text("2x1x2x1x1", sequence_parallel=True)
    assert plan.dtype == "bf16"
    assert parts_of(plan)[0]["loss"] == 2 * (8 // 2) * 32 * (512 // 2) * 4


def test_zero2_keeps_two_whole_buckets_in_flight() -> None:
    plan = compile_text("4x1x1x1x1", zero=2, bucket_mb=0.01)
    assert parts_of(plan)[0]["gradient buckets"] == 2 * max(b.bytes for b in plan.buckets)
    one = compile_text("4x1x1x1x1", zero=1, bucket_mb=0.01)
    assert parts_of(one)[0]["gradient buckets"] == max(b.bytes for b in one.buckets)


def test_ring_attention_holds_two_kv_blocks_and_their_gradients() -> None:
    """The packed K/V block in hand and the one arriving (4 x the block at bf16), and in
    backward the accumulators (6 x at float32); a block is 2 x batch x seq/cp x kv_heads x d."""
    plan = compile_text("1x1x1x2x1", cp_attention="ring")
    kv = 2 * 8 * (32 // 2) * 2 * 8
    assert parts_of(plan)[0]["attention buffers"] == 4 * kv * 2 + 6 * kv * 4
    assert parts_of(compile_text("1x1x1x2x1", cp_attention="allgather"))[0]["attention buffers"] == 0


def test_the_transient_is_the_largest_part_and_the_summary_names_it() -> None:
    from io import StringIO

    from rich.console import Console

    from fivedc.plan.summary import render_summary

    plan = compile_text("1x2x1x1x1", schedule="gpipe", microbatches=2)
    for r, parts in enumerate(parts_of(plan)):
        assert plan.memory.of_pp_rank(r, 2).transient == max(parts.values())
    out = StringIO()
    render_summary(plan, console=Console(file=out, width=80, color_system=None))
    text = " ".join(out.getvalue().split())
    busiest = plan.memory.busiest
    assert "Memory per class of ranks" in text and f"Memory per rank ({busiest.ranks})" in text
    name, value = max(parts_of(plan)[busiest.pp_ranks(2)[0]].items(), key=lambda item: item[1])
    assert f"here the {name} ({format_bytes(value)})" in text
