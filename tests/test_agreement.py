"""Every process group's ranks agree: the proof, held against the runtime and against broken programs.

The class programs (`fivedc/instructions/comm_program.py`) must be what the runtime really calls:
one step of real plans on gloo is recorded call by call and, group by group, must
equal the expansion of the rank's class. The proof (`fivedc/proof/agreement.py`) must
reject what would hang or corrupt: two collectives swapped on one rank, a transfer
whose sizes differ, a send dropped, the loss's sum moved before the last send, a
gradient bucket that spans two pipeline stages. The programs are built as shared runs (a
repeat's layer once for all its layers, a chunk's runs once for every microbatch): they
must be what a site-by-site build gives, a fault in one layer of one class must still be
found, and the proof's work must not grow with the world size or the microbatches.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from fivedc.proof.agreement import AgreementError, RankClasses, prove_agreement
from fivedc.cli.main import main
from fivedc.cli.shared import load_graph
from fivedc.instructions.comm_program import Run, class_programs, class_runs, flatten
from fivedc.frontends.dsl_file import load_model, parse_model
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.overlap import expand_buckets, plan_buckets
from fivedc.passes.param_sync import sync_bytes
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from wire_log import assert_calls_match


def compiled(model: str, mesh: str, stage_boundaries: tuple[str, ...] = (), **options):
    graph = load_model(model) if model.endswith(".5d") else load_graph(model, stage_boundaries)
    return compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), dtype="fp64", **options))


@pytest.mark.parametrize("model,mesh,options", [
    ("examples/tiny_llama.5d", "2x1x2x1x1", dict(sequence_parallel=True, zero=1)),
    # SP's gathers in rings of 3 hops (collective matmul), again in a recomputed layer's backward
    ("examples/gpt.5d", "1x1x4x1x1", dict(sequence_parallel=True, recompute="full")),
    ("examples/tiny_llama.5d", "2x1x2x1x1", dict(sequence_parallel=True, zero=3)),
    ("examples/tiny_llama.5d", "2x1x1x2x1", dict(zero=2, recompute="full")),
    ("examples/gpt.5d", "2x1x2x1x1", dict(zero=3)),
    ("examples/tiny_llama.5d", "1x1x2x2x1", dict(cp_attention="allgather", recompute="selective")),
    ("examples/moe.5d", "2x1x1x1x2", {}),
    ("examples/tiny_llama.5d", "2x2x1x1x1", dict(schedule="zb-h1", microbatches=2, zero=1)),
    ("examples/tiny_llama.5d", "1x2x2x1x1", dict(schedule="interleaved", microbatches=2, sequence_parallel=True)),
    ("examples/tiny_llama.5d", "1x2x1x1x1", dict(schedule="dualpipe", microbatches=4, zero=1)),  # two copies
    # the library's loss: its shifted labels (pad, slice along the sequence under cp) counted for the step up front
    ("examples/hf_models.py:llama", "1x2x1x2x1", dict(schedule="1f1b", microbatches=2)),
    # class weights and label smoothing folded into the vocab-parallel loss's 3 all-reduces; the weights' sum over dp
    ("tests/test_fx_losses.py:weighted_smoothed", "2x1x2x1x1", {}),
    # transformers' loss with num_items_in_batch: a sum (no count up front) divided by that number, under 1f1b
    ("tests/test_fx_losses.py:hf_items_in_batch", "1x2x1x2x1", dict(schedule="1f1b", microbatches=2)),
    # a tied table on both stages: its copies' gradients summed over pp, then each stage's ZeRO-1 buckets over dp
    ("tests/replicated_models.py:tied_targets", "2x2x1x1x1", dict(stage_boundaries=("head",), microbatches=2, zero=1)),
])
def test_the_programs_are_what_the_runtime_calls(model, mesh, options, worker_pool) -> None:
    assert_calls_match(compiled(model, mesh, **options), worker_pool)


def _pipeline_plan():
    return compiled("examples/tiny_llama.5d", "2x2x1x1x1", schedule="1f1b", microbatches=2)


def test_two_collectives_swapped_on_one_rank_are_named_with_both_sequences() -> None:
    plan = compiled("examples/tiny_llama.5d", "1x1x2x1x1", sequence_parallel=True)
    program = class_programs(plan)[0]
    tp = [i for i, e in enumerate(program) if e.axes == (MeshAxis.TP,)]
    first = next(i for i in tp if program[i].op != program[tp[0]].op)  # two of different kinds
    swapped = list(program)
    swapped[tp[0]], swapped[first] = swapped[first], swapped[tp[0]]
    classes = RankClasses(plan.mesh, {0: "base", 1: "swapped"})
    with pytest.raises(AgreementError) as caught:
        prove_agreement(plan, programs={"base": program, "swapped": tuple(swapped)}, classes=classes)
    text = caught.value.message
    assert "the ranks of a tp group disagree at its collective #1" in text
    assert "class base (rank 0) issues" in text and "class swapped (rank 1) issues" in text
    assert text.count("> #1") == 2 and caught.value.exit_code == 4


def test_a_transfer_whose_sizes_differ_is_rejected() -> None:
    plan = _pipeline_plan()
    programs = dict(class_programs(plan))
    index = next(i for i, e in enumerate(programs[0]) if e.op == "send")
    programs[0] = tuple(replace(e, numel=e.numel // 2) if i == index else e for i, e in enumerate(programs[0]))
    with pytest.raises(AgreementError, match=r"pp rank 0 sends 128 x float64 .* where pp rank 1 receives 256 x float64"):
        prove_agreement(plan, programs=programs)


def test_a_dropped_send_is_a_deadlock_naming_the_waiting_receive() -> None:
    plan = _pipeline_plan()
    programs = dict(class_programs(plan))
    index = next(i for i, e in enumerate(programs[0]) if e.op == "send")
    programs[0] = programs[0][:index] + programs[0][index + 1:]
    with pytest.raises(AgreementError, match="would deadlock") as caught:
        prove_agreement(plan, programs=programs)
    assert "pp rank 1 waits in #" in caught.value.message and "recv over pp with pp rank 0" in caught.value.message


def test_the_loss_sum_before_the_last_send_is_a_deadlock() -> None:
    plan = _pipeline_plan()
    programs = dict(class_programs(plan))
    last = list(programs[1])
    loss = next(i for i, e in enumerate(last) if MeshAxis.PP in e.axes and e.op == "all_reduce")
    send = max(i for i, e in enumerate(last) if e.op == "send")
    last.insert(send, last.pop(loss))
    programs[1] = tuple(last)
    with pytest.raises(AgreementError, match="would deadlock"):
        prove_agreement(plan, programs=programs)


def test_a_gradient_bucket_across_stages_is_rejected() -> None:
    """The bug this proof would have caught: a model without a repeat kept one bucket over
    both stages, which neither stage ran, so no gradient was summed over dp."""
    from test_pipeline import FLAT
    from fivedc.frontends.dsl_file import parse_model

    graph = parse_model(FLAT, filename="<flat>")
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse("2x2x1x1x1"), dtype="fp64"))
    spanning = plan_buckets(plan.graph, plan.mesh, param_bytes=lambda p: sync_bytes(plan.graph, plan.mesh, p, 8, 0),
                            bucket_bytes=plan.bucket_bytes)
    with pytest.raises(AgreementError, match="which another pp rank holds: no rank would sum it"):
        prove_agreement(replace(plan, buckets=spanning))


def test_the_proof_is_fast_at_16384_ranks() -> None:
    """Timed side by side, the fastest of three (a loaded machine slows some runs, not the
    fastest): 16384 ranks within a generous factor of 16 (or 128) ranks of the same layout,
    and under a second. `test_the_proofs_work_does_not_grow_with_the_world_size_or_the_microbatches`
    counts the work itself."""
    graph = load_model("examples/llama3_405b.5d")

    def fastest(mesh: str):
        plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=True))
        proofs = [prove_agreement(plan) for _ in range(3)]
        return min(proofs, key=lambda proof: proof.seconds)

    small, large = fastest("2x1x8x1x1"), fastest("2048x1x8x1x1")
    assert large.classes == 1 and large.events > 1000 and large.seconds < max(3 * small.seconds, 0.05)
    small, large = fastest("1x16x8x1x1"), fastest("128x16x8x1x1")
    assert (large.classes, large.across) == (16, 1) and large.transfers > 0
    assert large.seconds < max(3 * small.seconds, 0.05) and large.seconds < 1.0


@pytest.mark.parametrize("model,mesh,options", [
    ("examples/tiny_llama.5d", "2x1x2x1x1", dict(sequence_parallel=True, zero=1)),
    ("examples/gpt.5d", "1x1x4x1x1", dict(sequence_parallel=True, recompute="full")),
    ("examples/tiny_llama.5d", "2x1x2x1x1", dict(sequence_parallel=True, zero=3, recompute="selective")),
    ("examples/tiny_llama.5d", "1x1x2x2x1", dict(recompute="full")),
    ("examples/moe.5d", "2x1x1x1x2", {}),
    ("examples/tiny_llama.5d", "2x2x2x2x1", dict(sequence_parallel=True, recompute="full", zero=3, microbatches=2)),
    ("examples/tiny_llama.5d", "1x2x2x1x1", dict(schedule="interleaved", microbatches=2, sequence_parallel=True)),
    ("examples/tiny_llama.5d", "1x2x1x1x1", dict(schedule="dualpipe", microbatches=4, zero=1)),
    ("examples/mixtral_8x22b.5d", "8x4x8x1x8", dict(recompute="selective")),
])
def test_the_shared_runs_are_the_programs_built_site_by_site(model, mesh, options) -> None:
    """A repeat's layers share one run only if every layer issues the same events: the
    shared build must equal one that computes every site of every layer apart."""
    plan = compiled(model, mesh, **options)
    shared, apart = class_runs(plan), class_runs(plan, shared=False)
    assert {k: flatten(v) for k, v in shared.items()} == {k: flatten(v) for k, v in apart.items()}
    assert all("{layer}" not in e.what for events in class_programs(plan).values() for e in events)


def _first_layer_run(runs, layer: int, axes) -> int:
    """The first run of `layer` with collectives of two kinds over `axes`."""
    return next(i for i, r in enumerate(runs) if r.layer == layer
                and len({e.signature for e in r.events if e.axes == axes}) > 1)


def test_a_fault_in_one_layer_of_one_class_is_found_in_the_shared_runs() -> None:
    """Layers 0 and 1 share one tuple of events; a class whose layer 1 alone differs (two of
    its collectives swapped) must not pass for the shared run: the proof names layer 1. (No
    overlap: the gradient buckets start after backward, so each layer's backward is shared.)"""
    plan = compiled("examples/tiny_llama.5d", "1x1x2x1x1", sequence_parallel=True, overlap=False)
    runs = class_runs(plan)[0]
    index = _first_layer_run(runs, 1, (MeshAxis.TP,))
    assert runs[index].events is runs[_first_layer_run(runs, 0, (MeshAxis.TP,))].events  # shared
    events = list(runs[index].events)
    tp = [i for i, e in enumerate(events) if e.axes == (MeshAxis.TP,)]
    other = next(i for i in tp if events[i].signature != events[tp[0]].signature)
    events[tp[0]], events[other] = events[other], events[tp[0]]
    faulty = runs[:index] + (Run(tuple(events), 1),) + runs[index + 1:]
    classes = RankClasses(plan.mesh, {0: "base", 1: "faulty"})
    assert prove_agreement(plan, runs={"base": runs, "faulty": runs}, classes=classes).across == 1
    with pytest.raises(AgreementError, match="disagree") as caught:
        prove_agreement(plan, runs={"base": runs, "faulty": faulty}, classes=classes)
    assert "layers.1." in caught.value.message and "{layer}" not in caught.value.message


def test_a_transfer_of_one_microbatch_changed_in_the_shared_runs_is_rejected() -> None:
    plan = _pipeline_plan()
    programs = dict(class_runs(plan))
    runs = programs[0]
    index = [i for i, r in enumerate(runs) if r.events[0].op == "send"][-1]  # the last microbatch's
    sent = runs[index].events[0]
    assert any(r.events is runs[index].events for r in runs[:index])  # shared with microbatch 0's
    programs[0] = runs[:index] + (runs[index]._replace(events=(replace(sent, numel=sent.numel // 2),)),) \
        + runs[index + 1:]
    with pytest.raises(AgreementError, match=r"pp rank 0 sends 128 x float64 \(activations of .* \(microbatch 1,") \
            as caught:
        prove_agreement(plan, runs=programs)
    assert "{microbatch}" not in caught.value.message


def test_the_proofs_work_does_not_grow_with_the_world_size_or_the_microbatches() -> None:
    """Counted, not timed (a loaded machine cannot make it fail): the events the proof builds
    are those of the distinct runs. 16 and 16384 ranks of one layout build the same, and so
    do 1024 and 16384 with 16 pipeline stages; four times the microbatches build nothing
    more (a chunk's runs and its transfers are shared by the microbatches); a stage's layers
    are built once, so the events built are a small part of those proved."""
    graph = load_model("examples/llama3_405b.5d")

    def proof(mesh: str, **options):
        return prove_agreement(compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=True,
                                                                   **options)))

    small, large = proof("2x1x8x1x1"), proof("2048x1x8x1x1")
    assert (small.events, small.built) == (large.events, large.built)
    small, large = proof("8x16x8x1x1"), proof("128x16x8x1x1")
    assert (small.classes, small.events, small.built, small.transfers) == \
        (large.classes, large.events, large.built, large.transfers) and large.classes == 16
    few, many = proof("8x16x8x1x1", microbatches=16), proof("8x16x8x1x1", microbatches=64)
    assert many.events > 3.9 * few.events and many.transfers == 4 * few.transfers
    assert many.built == few.built and few.built * 50 < few.events


def test_the_proof_does_not_grow_with_the_layers() -> None:
    """Stages of 8 layers and of 2 (pp 16, 126 and 32 layers) build one run per repeat for
    their layers: what grows is the gradient buckets' sums after the step, each layer's own."""
    text = open("examples/llama3_405b.5d").read()
    built = {}
    for layers in (32, 126):
        graph = parse_model(text.replace("layers = 126", f"layers = {layers}"), filename="llama3_405b.5d")
        plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse("8x16x8x1x1"), sequence_parallel=True))
        built[layers] = prove_agreement(plan).built, len(expand_buckets(plan.buckets))
    assert built[126][0] - built[32][0] == built[126][1] - built[32][1]  # a sum per bucket of each layer


def test_compile_and_check_print_the_proof(tmp_path, capsys) -> None:
    plan = tmp_path / "p.json"
    assert main(["compile", "examples/tiny_llama.5d", "--mesh", "2x2x1x1x1", "-o", str(plan)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the line wraps at the terminal's width
    assert "every group's ranks issue the same collectives (proved over 2 rank classes" in out
    assert main(["check", str(plan), "--collectives"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "no deadlock" in out and "pp rank 1:" in out and "send over pp with pp rank 1" in out
