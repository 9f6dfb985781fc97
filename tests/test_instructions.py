"""Each class of ranks' step as one instruction list (issue 39): its computations and, between
them, the collectives and transfers the agreement proof checks, which `tests/test_agreement.py`
holds to what the runtime calls. `fivedc show PLAN --program --rank R` prints it."""

from __future__ import annotations

import pytest
from rich.console import Console

from fivedc.cli.show_program import render_program
from fivedc.errors import FivedcError
from fivedc.frontends.dsl_file import load_model
from fivedc.ir.graph import Op
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.instructions.sites import sites
from fivedc.instructions.comm_program import class_instructions, class_runs, flatten, rank_instructions
from fivedc.instructions.events import COMPUTE

PLANS = {
    "sp-zero1": ("examples/tiny_llama.5d", "2x1x2x1x1", dict(sequence_parallel=True, zero=1)),
    "sp-rings-full": ("examples/gpt.5d", "1x1x4x1x1", dict(sequence_parallel=True, recompute="full")),
    "zero3-full": ("examples/tiny_llama.5d", "2x1x2x1x1", dict(sequence_parallel=True, zero=3, recompute="full")),
    "zb-h1": ("examples/tiny_llama.5d", "2x2x1x1x1", dict(schedule="zb-h1", microbatches=2, zero=1)),
    "interleaved": ("examples/tiny_llama.5d", "1x2x2x1x1", dict(schedule="interleaved", microbatches=2,
                                                                 sequence_parallel=True)),
    "dualpipe": ("examples/tiny_llama.5d", "1x2x1x1x1", dict(schedule="dualpipe", microbatches=4, zero=1)),
    "experts": ("examples/moe.5d", "2x1x1x1x2", {}),
}


def compiled(name: str):
    model, mesh, options = PLANS[name]
    return compile_graph(load_model(model), CompileOptions(mesh=Mesh.parse(mesh), dtype="fp64", **options))


def computations(events) -> list[str]:
    return [e.what for e in events if e.op == COMPUTE]


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_proofs_events_are_the_instruction_lists_collectives_and_transfers(name):
    plan = compiled(name)
    instructions, proved = class_instructions(plan), class_runs(plan)
    assert instructions.keys() == proved.keys()
    for rank, runs in instructions.items():
        assert rank_instructions(plan, rank) == runs  # one class alone, as `show --program` builds it
        listed = flatten(runs)
        assert [e for e in listed if e.op != COMPUTE] == list(flatten(proved[rank]))
        assert sum(e.op == COMPUTE for e in listed) > 0


def test_without_a_pipeline_every_op_runs_forward_then_backward_then_the_optimizer_step():
    plan = compiled("sp-zero1")
    [listed] = [flatten(runs) for runs in class_instructions(plan).values()]
    ops = [s for s in sites(plan.graph) if isinstance(s.node, Op)]
    done = computations(listed)
    forward = [w for w in done if w.startswith("forward of")]
    backward = [w for w in done if w.startswith("backward of")]
    assert len(forward) == len(ops) and 0 < len(backward) <= len(ops)
    assert done[-1].startswith("optimizer step") and done.count(done[-1]) == 1
    step = next(i for i, e in enumerate(listed) if e.op == COMPUTE and e.what.startswith("optimizer step"))
    assert [e.what for e in listed[step + 1:]] == ["gather the updated parameters (ZeRO-1/2)"] * len(listed[step + 1:])
    assert len(listed[step + 1:]) > 0  # ZeRO-1 gathers what the step updated, after it


def test_a_recomputed_layer_runs_its_forward_again_in_backward():
    plan = compiled("sp-rings-full")
    [listed] = [flatten(runs) for runs in class_instructions(plan).values()]
    layer_ops = [s for s in sites(plan.graph) if isinstance(s.node, Op) and s.repeat is not None]
    again = [w for w in computations(listed) if w.startswith("forward again of")]
    assert len(again) == len(layer_ops)
    first_again = next(i for i, e in enumerate(listed) if e.op == COMPUTE and e.what.startswith("forward again"))
    assert any(e.op == COMPUTE and e.what.startswith("backward of") for e in listed[:first_again])  # the head's


def test_a_split_backward_lists_input_gradients_then_each_microbatchs_weight_gradients():
    plan = compiled("zb-h1")
    m = plan.pipeline.microbatches
    for rank, runs in class_instructions(plan).items():
        done = computations(flatten(runs))
        chunks = [c for c in plan.pipeline.chunks if c.rank == rank]
        weights = [w for w in done if w.startswith("weight gradients of chunk")]
        assert len(weights) == m * len(chunks)
        assert any(w.startswith("input gradient of") for w in done)
        assert not any(w.startswith("backward of") for w in done)


def test_show_program_prints_one_ranks_step_within_100_columns():
    plan = compiled("sp-rings-full")
    console = Console(record=True, width=100)
    render_program(plan, 3, console=console)
    text = console.export_text()
    lines = text.splitlines()
    assert lines[0].startswith("rank 3 runs the program of pp rank 0")
    assert "layers 0-1, each (N the layer)" in lines
    assert any(line.lstrip().startswith("send_recv") for line in lines) and "(collective matmul)" in text
    assert "layer 1" in lines and any("forward again of linear layers.1." in line for line in lines)
    assert max(map(len, lines)) <= 100


def test_show_program_of_a_pipeline_names_the_rank_class_and_microbatches():
    plan = compiled("zb-h1")
    console = Console(record=True, width=100)
    render_program(plan, 3, console=console)  # dp=2 x pp=2: rank 3 is pp rank 1
    text = console.export_text()
    assert text.startswith("rank 3 runs the program of pp rank 1 (the 2 ranks with pp = 1 run the same)")
    assert "microbatch 1, layer 1" in text and "weight gradients of chunk 1 (microbatch 1)" in text
    with pytest.raises(FivedcError, match=r"--rank 4 is not a rank of mesh .* \(4 ranks\)"):
        render_program(plan, 4, console=console)


def test_the_show_command_prints_a_ranks_program_and_refuses_a_rank_off_the_mesh(tmp_path, capsys):
    from fivedc.cli.main import main

    plan = tmp_path / "p.plan.json"
    assert main(["compile", "examples/tiny_llama.5d", "--mesh", "2x2x1x1x1", "--schedule", "1f1b",
                 "--microbatches", "2", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["show", str(plan), "--program", "--rank", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rank 3 runs the program of pp rank 1") and "optimizer step" in out
    assert "recv           over pp with pp rank 0" in out and "forward of linear layers.1." in out
    assert main(["show", str(plan), "--program", "--rank", "4"]) == 2
    err = capsys.readouterr().err
    assert "--rank 4 is not a rank of mesh 2x2x1x1x1 (4 ranks)" in err and "Traceback" not in err
