"""The worker pool: results by rank, errors naming the failing rank, recovery, and launcher checks.

Job functions live at module level because the pool pickles them by reference.
Failing jobs are followed by a normal one to show the pool recovers; the hung and
dead-worker cases cost a worker restart each, so they run on two ranks only.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from fivedc.errors import FivedcError, MeshError
from fivedc.mesh import Mesh
from fivedc.runtime.pool import RankInfo, WorkerError, WorkerPool, check_world, init_from_env, run_once


def identify(info: RankInfo, payload: int) -> tuple[int, int, str, int, float]:
    total = torch.tensor([float(info.rank)])
    dist.all_reduce(total)
    return info.rank, info.world, info.device, payload, total.item()


def fail_on_one(info: RankInfo, blocked: bool) -> int:
    """Rank 1 raises; with `blocked` the others wait in a collective it never joins."""
    if info.rank == 1:
        raise ValueError("rank one is broken")
    if blocked:
        dist.all_reduce(torch.ones(1))
    return info.rank


def hang_or_die(info: RankInfo, how: str) -> int:
    if info.rank == 1 and how == "hang":
        time.sleep(600)
    if info.rank == 1 and how == "die":
        os._exit(3)
    return info.rank


def check_ok(pool: WorkerPool, world: int) -> None:
    expected = [(r, world, "cpu", 7, float(sum(range(world)))) for r in range(world)]
    assert pool.run(identify, world=world, payload=7) == expected


def test_results_by_rank_for_each_world(worker_pool: WorkerPool) -> None:
    for world in (2, 4, 8, 2):
        check_ok(worker_pool, world)


@pytest.mark.parametrize("blocked", [False, True], ids=["alone", "others-blocked"])
def test_error_names_rank_and_pool_recovers(worker_pool: WorkerPool, blocked: bool) -> None:
    started = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        worker_pool.run(fail_on_one, world=4, payload=blocked)
    assert time.monotonic() - started < 30
    assert caught.value.rank == 1
    assert "rank 1 of 4 failed in fail_on_one" in str(caught.value)
    assert "ValueError: rank one is broken" in str(caught.value)
    assert isinstance(caught.value, FivedcError)
    check_ok(worker_pool, 4)


@pytest.mark.parametrize("how", ["hang", "die"])
def test_hung_or_dead_worker_is_replaced(worker_pool: WorkerPool, how: str) -> None:
    saved, worker_pool.timeout_s = worker_pool.timeout_s, 2.0
    try:
        with pytest.raises(WorkerError) as caught:
            worker_pool.run(hang_or_die, world=2, payload=how)
    finally:
        worker_pool.timeout_s = saved
    assert caught.value.rank == 1
    assert ("did not finish" if how == "hang" else "died (exit code 3)") in str(caught.value)
    check_ok(worker_pool, 2)


def test_unpicklable_job_and_oversized_world(worker_pool: WorkerPool) -> None:
    with pytest.raises(WorkerError, match="module-level"):
        worker_pool.run(lambda info, payload: None, world=2, payload=None)
    with pytest.raises(MeshError, match="does not fit"):
        worker_pool.run(identify, world=9, payload=None)


def test_run_once() -> None:
    assert run_once(identify, world=1, payload=3) == [(0, 1, "cpu", 3, 0.0)]


def test_check_world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    check_world(4)
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_world(4)
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(MeshError) as caught:
        check_world(4, mesh=Mesh.parse("2x1x2x1x1"))
    assert caught.value.message == "the mesh 2x1x2x1x1 needs 4 processes but the launcher started 8"
    assert "--nproc-per-node=4" in caught.value.hint


def test_init_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(MeshError, match="RANK is not set"):
        init_from_env()
    with socket.socket() as probe:  # a free port for the env:// rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**env, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    try:
        assert init_from_env() == RankInfo(0, 1, "cpu")
        assert dist.get_world_size() == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
