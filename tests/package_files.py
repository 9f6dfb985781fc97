"""The package's source files wherever they stand: `fivedc/` and, in a source tree, the top
level's `passes/`, `runtime/` and `grammars/` (`fivedc.folders()`), each named as it is
inside the package (`ir/graph.py`, `passes/stages.py`), for the tests that read the source."""

from __future__ import annotations

from pathlib import Path

import fivedc


def package_files() -> list[tuple[str, Path]]:
    """(name inside the package, path) of every module, in name order."""
    found = []
    for folder in fivedc.folders():
        base = folder if folder.name == "fivedc" else folder.parent
        found += [(path.relative_to(base).as_posix(), path) for path in folder.rglob("*.py")]
    return sorted(found)
