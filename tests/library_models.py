"""The rule every model written by others is held to (tests/test_hf_models.py,
tests/test_titan_tune_models.py), against what docs/compatibility.md says of it: its measured
rows (`docs/compatibility.json`, written by `benchmarks/compatibility.py --write`, never by
hand). A model whose "1 rank" cell is `ok` must verify on one rank in float64 (the plain module
against `parallelize(module, mesh="1x1x1x1x1")`, both trained two AdamW steps in this process:
`fivedc.parallel.check.check_module_here`) and compile at a multi-axis layout (agreement proof
included); a model the table records as stopped must stop with the error the table gives. So a
change of either kind fails: an ok model refused, or a refused one that now works (then measure
its row again and commit the table)."""

from __future__ import annotations

import json
from pathlib import Path

from fivedc.errors import FivedcError

ROOT = Path(__file__).resolve().parent.parent
CELLS = ROOT / "docs" / "compatibility.json"
TOL = 1e-10


def table_row(arch: str) -> dict[str, str]:
    """The measured cells of `arch` (docs/compatibility.json); a model without a row fails."""
    rows = json.loads(CELLS.read_text())
    if arch not in rows:
        raise AssertionError(f"docs/compatibility.json has no row {arch!r}: measure it "
                             f"(python benchmarks/compatibility.py --write --arch {arch}) and commit the table")
    return rows[arch]["cells"]


def expected_error(cell: str) -> str:
    """The error text a stopped cell records (`compile: MESSAGE (file:line)` or `MESSAGE`), without
    its stage and its site."""
    text = cell.removeprefix("compile: ")
    return text.rsplit(" (", 1)[0] if text.endswith(")") else text


def assert_as_the_table_says(spec: str, arch: str, *, mesh: str) -> None:
    """`spec` verifies on one rank and compiles at `mesh`, or stops with the table's error."""
    from fivedc.parallel.check import check_module_here

    cell = table_row(arch)["1 rank"]
    if cell.startswith("ok"):
        report = check_module_here(spec, steps=2, dtype="fp64", meshes=(mesh,))
        assert report.max_error <= TOL and report.dtype == "fp64", report
        return
    want = expected_error(cell)
    try:
        report = check_module_here(spec, steps=2, dtype="fp64", meshes=(mesh,))
    except FivedcError as error:
        got = error.message
        assert error.exit_code == 2 and error.loc is not None and error.loc.line > 0, error.render()
    except Exception as error:  # noqa: BLE001: the table records an internal error as it is; compared below
        got = f"{type(error).__name__}: {error}"
    else:
        raise AssertionError(f"{arch} verifies now (error {report.max_error:.1e}), the table says {cell!r}: "
                             f"measure its row again (python benchmarks/compatibility.py --write --arch {arch})")
    assert want in got, f"{arch} stops with {got!r}, the table says {want!r}"
