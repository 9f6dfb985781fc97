"""Every process group's ranks agree: the proof, held against the runtime and against broken programs.

The class programs (`fivedc/proof/comm_program.py`) must be what the runtime really calls:
one step of real plans on gloo is recorded call by call and, group by group, must
equal the expansion of the rank's class. The proof (`fivedc/proof/agreement.py`) must
reject what would hang or corrupt: two collectives swapped on one rank, a transfer
whose sizes differ, a send dropped, the loss's sum moved before the last send, a
gradient bucket that spans two pipeline stages; and it stays fast at 16384 ranks.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from fivedc.proof.agreement import AgreementError, RankClasses, prove_agreement
from fivedc.cli.main import main
from fivedc.cli.shared import load_graph
from fivedc.proof.comm_program import class_programs
from fivedc.frontends.dsl_file import load_model
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.overlap import plan_buckets
from fivedc.passes.param_sync import sync_bytes
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.train import TrainSettings
from wire_log import by_group, expected_calls, record_step, same_call


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
    # a tied table on both stages: its copies' gradients summed over pp, then each stage's ZeRO-1 buckets over dp
    ("tests/replicated_models.py:tied_targets", "2x2x1x1x1", dict(stage_boundaries=("head",), microbatches=2, zero=1)),
])
def test_the_programs_are_what_the_runtime_calls(model, mesh, options, worker_pool) -> None:
    plan = compiled(model, mesh, **options)
    programs = class_programs(plan)
    calls = worker_pool.run(record_step, world=plan.mesh.world, payload=(plan, TrainSettings(steps=1, keep_grads=False)))
    for rank, got in enumerate(calls):
        want = by_group(expected_calls(programs[plan.mesh.coords(rank)[MeshAxis.PP]]))
        got = by_group(got)
        assert set(got) == set(want), (rank, set(got) ^ set(want))
        for group in want:
            assert len(got[group]) == len(want[group]) and all(map(same_call, got[group], want[group])), \
                (rank, group, got[group], want[group])


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
    plan = compile_graph(load_model("examples/llama3_405b.5d"),
                         CompileOptions(mesh=Mesh.parse("2048x1x8x1x1"), sequence_parallel=True))
    proof = prove_agreement(plan)
    assert proof.classes == 1 and proof.events > 1000 and proof.seconds < 1.0
    piped = compile_graph(load_model("examples/llama3_405b.5d"),
                          CompileOptions(mesh=Mesh.parse("128x16x8x1x1"), sequence_parallel=True))
    proof = prove_agreement(piped)
    assert (proof.classes, proof.across) == (16, 1) and proof.transfers > 0 and proof.seconds < 2.0


def test_compile_and_check_print_the_proof(tmp_path, capsys) -> None:
    plan = tmp_path / "p.json"
    assert main(["compile", "examples/tiny_llama.5d", "--mesh", "2x2x1x1x1", "-o", str(plan)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the line wraps at the terminal's width
    assert "every group's ranks issue the same collectives (proved over 2 rank classes" in out
    assert main(["check", str(plan), "--collectives"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "no deadlock" in out and "pp rank 1:" in out and "send over pp with pp rank 1" in out
