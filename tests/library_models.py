"""The rule every model written by others is held to (tests/test_hf_models.py,
tests/test_titan_tune_models.py): it compiles on one rank and then verifies there in
float64, or it is refused with a located bad-input error (exit 2, a file and line),
never an internal error or a traceback."""

from __future__ import annotations

from fivedc.cli.main import load_graph
from fivedc.errors import FivedcError
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph


def assert_compiles_or_is_refused_at_its_line(spec: str, *, verify: bool = True) -> None:
    try:
        compile_graph(load_graph(spec), CompileOptions(mesh=Mesh.parse("1x1x1x1x1"), dtype="fp64"))
    except FivedcError as error:
        assert error.exit_code == 2, error.render()
        assert error.loc is not None and error.loc.line > 0, error.render()
        return
    if not verify:
        return
    from fivedc.parallel.check import check_module

    report = check_module(spec, mesh="1x1x1x1x1", steps=2, dtype="fp64")
    assert report.max_error <= 1e-10, report
