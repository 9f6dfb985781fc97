"""fivedc: a declarative compiler from a model graph to a 5-D parallel execution plan."""

import sys
from importlib.machinery import PathFinder
from pathlib import Path

__version__ = "0.1.0"

# The design card's top level: `passes/`, `runtime/` and `grammars/` stand beside this folder
# and are installed into this package (pyproject's `package-dir`: `passes/` is
# `fivedc.passes`), so no bare `passes` or `runtime` module exists. Run from a source tree
# without installing (a worktree on PYTHONPATH, a copy on another machine) they are found
# beside this folder by `_SourceTree`.
TOP_LEVEL = {"fivedc.passes": "passes", "fivedc.runtime": "runtime", "fivedc.grammars": "grammars"}
_SOURCE = Path(__file__).resolve().parent.parent


class _SourceTree:
    """Finds `fivedc.passes`, `fivedc.runtime` and `fivedc.grammars` in the source tree this
    `fivedc/` folder stands in, where they are not inside it (an installed wheel has them there)."""

    @staticmethod
    def find_spec(fullname: str, path=None, target=None):
        return PathFinder.find_spec(fullname, [str(_SOURCE)]) if fullname in TOP_LEVEL else None


def folders() -> tuple[Path, ...]:
    """The folders the package's modules are in: `fivedc/` and, from a source tree, the top
    level's `passes/`, `runtime/` and `grammars/`."""
    here = Path(__file__).resolve().parent
    return (here, *(_SOURCE / name for name in TOP_LEVEL.values() if not _package(here / name)))


def _package(folder: Path) -> bool:
    return (folder / "__init__.py").is_file()


# A folder `fivedc/passes` left from an older tree (its `__pycache__` only) is no package.
if not _package(Path(__file__).resolve().parent / "passes") and _package(_SOURCE / "passes"):
    sys.meta_path.insert(0, _SourceTree)  # before an editable install's finder, which may be another tree's

__all__ = ["parallelize", "empty_weights"]


def __getattr__(name: str):
    """`fivedc.parallelize` (and `fivedc.empty_weights`) import torch and the compiler only when first used."""
    if name == "parallelize":
        from fivedc.parallel.parallelize import parallelize

        globals()["parallelize"] = parallelize
        return parallelize
    if name == "empty_weights":
        from fivedc.frontends.weightless import empty_weights

        globals()["empty_weights"] = empty_weights
        return empty_weights
    raise AttributeError(f"module 'fivedc' has no attribute {name!r}")
