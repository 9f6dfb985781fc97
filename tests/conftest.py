"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fivedc.runtime.pool import WorkerPool


@pytest.fixture(scope="session")
def worker_pool() -> Iterator[WorkerPool]:
    """One pool of 8 worker processes for the whole session (workers start on first use)."""
    with WorkerPool(8) as pool:
        yield pool


SOURCE = Path(__file__).resolve().parent.parent
WATCHED = ("", "examples", "tests", "benchmarks", "docs", "fivedc", "passes", "runtime", "grammars")
SCRATCH = {"__pycache__", ".hypothesis", ".pytest_cache"}  # what Python, hypothesis and pytest keep


def _tree_entries() -> set[str]:
    return {f"{folder}/{p.name}".lstrip("/") for folder in WATCHED if (SOURCE / folder).is_dir()
            for p in (SOURCE / folder).iterdir() if p.name not in SCRATCH}


@pytest.fixture(scope="session", autouse=True)
def nothing_written_into_the_source_tree() -> Iterator[None]:
    """A test writes under its tmp_path only: a file or folder that appears in the source tree's
    folders during the session is an error at its end, named (a command run without -o, say)."""
    before = _tree_entries()
    yield
    made = sorted(_tree_entries() - before)
    assert not made, f"the tests wrote into the source tree (write under tmp_path): {made}"


def pytest_addoption(parser) -> None:
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite tests/golden/*.plan.json from the compiler (review the diff before committing)")
    parser.addoption("--all-library-models", action="store_true",
                     help="hold every torchtitan/torchtune model to docs/compatibility.md, not only "
                          "tests/test_titan_tune_models.py's IN_EVERY_RUN")


def pytest_terminal_summary(terminalreporter, config) -> None:
    """The seed of a shuffled order (pytest-randomly, of the `test` extra), printed last even under -q,
    so that a failure that depends on the order can be run again in the same order."""
    seed = getattr(config.option, "randomly_seed", None)
    if config.pluginmanager.hasplugin("randomly") and isinstance(seed, int):
        terminalreporter.write_line(f"tests ran in a shuffled order: the same order again with -p randomly "
                                    f"--randomly-seed={seed} (-p no:randomly: in file order)")
