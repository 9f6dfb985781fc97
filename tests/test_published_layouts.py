"""Published layouts (benchmarks/published_layouts.py): every example parses, every
published layout compiles at the plan level (every pass but the agreement proof, no
processes), and the layouts run as published fit their GPUs by fivedc's estimate;
the two that do not are the ones docs/search.md explains. `fivedc compile` takes the
search's shape overrides (--seq, --global-batch) and its plan checks.

The searches themselves (up to 16384 GPUs) are the benchmark's, not the tests'.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from fivedc.cli.main import main
from fivedc.cli.plan_check import load_plan
from fivedc.frontends.dsl_file import load_model
from fivedc.ir.hardware import hardware

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from published_layouts import CASES, Case, published_plan  # noqa: E402

# Published layouts fivedc estimates over the GPU's memory, with the part that does not
# fit (docs/search.md, "Published layouts against the search", says why).
OVER = {"mixtral-8x22b": "activations", "palm-540b": "activations"}
DOC = ROOT / "docs" / "search.md"  # its table of the published layouts: benchmarks/published_layouts.py --write


def tabulated(title: str) -> tuple[float, float, float]:
    """The published layout's step (s), MFU (%) and memory (GiB) as docs/search.md's table gives them."""
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == title:
            step, mfu, memory = cells[3:6]
            return float(step.removesuffix(" s")), float(mfu.removesuffix("%")), float(memory.split(" GiB")[0])
    raise AssertionError(f"docs/search.md has no row {title!r}: python benchmarks/published_layouts.py --write")


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*.5d")))
def test_every_example_parses(path: str) -> None:
    graph = load_model(str(ROOT / path))
    assert graph.dim(graph.batch_dim) >= 1 and graph.body.items


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.key)
def test_published_layout_compiles_and_fits_as_run(case: Case) -> None:
    start = time.perf_counter()
    plan = published_plan(case, prove=False)
    assert time.perf_counter() - start < 15
    assert plan.mesh.world == case.gpus and plan.time is not None
    if case.seq is not None:
        assert plan.graph.dim(plan.graph.seq_dim) == case.seq
    usable = hardware(case.gpu).usable_bytes
    memory = plan.memory
    if case.key in OVER:
        part = OVER[case.key]
        assert memory.total > usable, f"{case.key} fits now: update docs/search.md and OVER"
        assert memory.total - getattr(memory, part) < usable  # without that part it would fit
    elif case.ran:
        assert memory.total <= usable, f"{case.key}: {memory.total / 2**30:.1f} GiB of {usable / 2**30:.1f}"
    # the figures docs/search.md prints, to the digits it prints (a change of the estimate must
    # regenerate the table: python benchmarks/published_layouts.py --write)
    step, mfu, gib = tabulated(case.title)
    assert abs(plan.time.mfu * 100 - mfu) <= 0.051, f"{case.key}: MFU {plan.time.mfu:.1%}, the table {mfu}%"
    assert abs(plan.time.step_seconds - step) <= 0.0051 * step, f"{case.key}: {plan.time.step_seconds:.3g} s, the table {step} s"
    assert abs(memory.total / 2**30 - gib) <= 0.051, f"{case.key}: {memory.total / 2**30:.1f} GiB, the table {gib}"


def test_reported_figures_are_only_where_a_source_gives_them() -> None:
    keys = {c.key for c in CASES}
    assert {"gpt3-175b", "llama3-405b-8k", "llama3-405b-128k", "deepseek-v3", "mixtral-8x22b", "palm-540b"} <= keys
    for case in CASES:
        assert (case.reported_mfu is None) or (0 < case.reported_mfu < 1 and "%" in case.reported)
        assert (ROOT / case.model).exists()


def test_compile_takes_the_shape_overrides_and_its_plan_checks(tmp_path, capsys) -> None:
    out = tmp_path / "long.plan.json"
    argv = ["compile", "examples/tiny_llama.5d", "--mesh", "1x1x1x2x1", "--seq", "32", "--global-batch", "6",
            "-q", "-o", str(out)]
    assert main(argv) == 0
    plan = load_plan(out)  # what `fivedc check` runs: the plan's own graph, recompiled, equals it
    assert plan.graph.dim(plan.graph.seq_dim) == 32 and plan.graph.dim(plan.graph.batch_dim) == 6
    assert main(["compile", "examples/tiny_llama.5d", "--mesh", "1x1x1x1x1", "--seq", "0", "-q",
                 "-o", str(tmp_path / "x.json")]) == 2
    assert "--seq 0 must be at least 1" in " ".join(capsys.readouterr().err.split())
