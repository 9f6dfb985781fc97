"""Golden plans: the examples' plan JSON, byte for byte, as committed in tests/golden/.

A change that means to change plans (a new collective, a better memory figure)
regenerates them with `python -m pytest tests/test_golden_plans.py --update-golden`
and shows the difference in its diff; a change that means to change nothing (a
restructuring) must leave them equal. Paths are written relative to the repository.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fivedc.cli.shared import load_graph
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.cli.plan_check import check_plan
from fivedc.ir.serialize import encode

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
CASES = {  # file name -> (example, mesh, options)
    "gpt-dp2-tp2-sp": ("gpt.5d", "2x1x2x1x1", dict(sequence_parallel=True)),
    "tiny_llama-dp2-cp4-zero3": ("tiny_llama.5d", "2x1x1x4x1", dict(zero=3)),
    "tiny_llama-pp2-tp2-interleaved": ("tiny_llama.5d", "1x2x2x1x1", dict(schedule="interleaved", microbatches=4)),
    "moe-dp2-ep2-zero1": ("moe.5d", "2x1x1x1x2", dict(zero=1)),
    "deepseek_v3-pp2-tp8-ep32-dualpipev": ("deepseek_v3.5d", "1x2x8x1x32", dict(schedule="dualpipev")),
    "llama3_405b-16384-ranks": ("llama3_405b.5d", "2048x1x8x1x1", dict(sequence_parallel=True)),
    "nanogpt-one-rank": ("nanogpt.5d", "1x1x1x1x1", {}),
}


def plan_text(example: str, mesh: str, options: dict) -> str:
    plan = compile_graph(load_graph(str(ROOT / "examples" / example)), CompileOptions(mesh=Mesh.parse(mesh), **options))
    return json.dumps(encode(plan), indent=1).replace(str(ROOT) + "/", "") + "\n"


@pytest.mark.parametrize("name", list(CASES))
def test_the_examples_compile_to_their_golden_plans(name: str, request) -> None:
    text = plan_text(*CASES[name])
    path = GOLDEN / f"{name}.plan.json"
    if request.config.getoption("--update-golden"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden plan {path.name}: run pytest {__file__} --update-golden"
    assert text == path.read_text(), (f"{name}: the plan changed; if that is meant, rerun with --update-golden "
                                      "and commit the diff of tests/golden/")
    check_plan(ExecutionPlan.from_json(json.loads(text)), source=path.name)  # and it loads as a valid plan
