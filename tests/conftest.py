"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fivedc.runtime.pool import WorkerPool


@pytest.fixture(scope="session")
def worker_pool() -> Iterator[WorkerPool]:
    """One pool of 8 worker processes for the whole session (workers start on first use)."""
    with WorkerPool(8) as pool:
        yield pool


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
