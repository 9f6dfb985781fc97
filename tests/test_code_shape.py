"""The package's functions stay short: none over 60 lines.

Every module of `fivedc` is parsed and every function in it (methods and nested functions
included) measured from its `def` line to its last line, decorators left out. A function
over the limit is named with its file, line and length, so the one to split is plain.
"""

from __future__ import annotations

import ast
from pathlib import Path

from package_files import package_files

ROOT = Path(__file__).resolve().parent.parent
MOST_LINES = 60


def function_lengths(path: Path) -> list[tuple[int, str, int]]:
    """(line, name, length in lines) of every function defined in the module at `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.lineno, node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_the_measure_counts_from_the_def_line_to_the_last(tmp_path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import functools\n\n\n@functools.cache\ndef f(x):\n    def g():\n        return x\n\n"
                      "    return g\n\n\nclass C:\n    async def h(self):\n        pass\n")
    assert sorted(function_lengths(module)) == [(5, "f", 5), (6, "g", 2), (13, "h", 2)]


def test_no_function_in_the_package_is_over_60_lines() -> None:
    modules = [path for _, path in package_files()]
    assert len(modules) > 50  # the package itself, not an empty folder
    long = [f"{path.relative_to(ROOT)}:{line} {name} {length} lines"
            for path in modules for line, name, length in function_lengths(path) if length > MOST_LINES]
    assert not long, f"functions over {MOST_LINES} lines (split them into named steps):\n" + "\n".join(long)
