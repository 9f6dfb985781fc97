"""The local resource guard: which worlds a machine of given cores and memory refuses,
what the refusal says, and how this machine's cores and free memory are read.

The rule is tested on made-up `Machine`s so the results do not depend on the machine
running the tests; the readers of /proc/meminfo and the cgroup files are pointed at
files written here.
"""

from __future__ import annotations

import pytest

from fivedc.errors import FivedcError
from fivedc.runtime.resources import (
    PROCESS_BYTES, Machine, ResourceError, available_memory, check_local_resources, check_resources,
    max_local_ranks, usable_cores,
)

GiB = 2**30
LAPTOP = Machine(cores=2, available_bytes=64 * GiB)


def test_the_test_suites_worlds_fit_two_cores() -> None:
    for world in (1, 2, 4, 8, 16):
        check_resources(LAPTOP, world=world, bytes_per_rank=10 * 2**20)
    assert max_local_ranks(LAPTOP, bytes_per_rank=0) == 16


def test_too_many_processes_for_the_cores() -> None:
    with pytest.raises(ResourceError) as caught:
        check_resources(LAPTOP, world=32, bytes_per_rank=0, what="the mesh 4x1x8x1x1")
    error = caught.value
    assert isinstance(error, FivedcError) and error.exit_code == 2
    assert error.message == ("the mesh 4x1x8x1x1 needs 32 local processes, but this machine runs at most 16 "
                             "(2 cores x 8 per core, and never more than 256)")
    assert "torchrun --nnodes 2 --nproc-per-node 16 ... -m fivedc.cli.main run PLAN.json" in error.hint
    assert "smaller mesh" in error.hint and "--force" in error.hint


def test_never_more_than_256_local_ranks() -> None:
    big = Machine(cores=128, available_bytes=10_000 * GiB)
    check_resources(big, world=256, bytes_per_rank=GiB)
    with pytest.raises(ResourceError, match="512 local processes, but this machine runs at most 256") as caught:
        check_resources(big, world=512, bytes_per_rank=GiB)
    assert "--nnodes 2 --nproc-per-node 256" in caught.value.hint


def test_memory_counts_each_process_and_the_reference() -> None:
    machine = Machine(cores=64, available_bytes=4 * GiB)
    per_rank = GiB - PROCESS_BYTES  # with Python and torch, 1 GiB a process
    check_resources(machine, world=4, bytes_per_rank=per_rank)
    with pytest.raises(ResourceError) as caught:
        check_resources(machine, world=4, bytes_per_rank=per_rank, reference_bytes=GiB // 2)
    assert caught.value.message == (
        "this run needs about 4.5 GiB of memory, 4 processes x (724.0 MiB + 300.0 MiB for Python and torch)"
        " + 512.0 MiB for the reference run, but 4.0 GiB is available")
    assert "--nnodes 2 --nproc-per-node 2" in caught.value.hint  # 3 fit; 4 ranks split as 2 x 2
    assert max_local_ranks(machine, bytes_per_rank=per_rank, reference_bytes=5 * GiB) == 0


def test_unknown_memory_is_not_checked() -> None:
    check_resources(Machine(cores=2, available_bytes=None), world=16, bytes_per_rank=1000 * GiB)


def test_force_skips_the_check() -> None:
    with pytest.raises(ResourceError):
        check_local_resources(world=100_000, bytes_per_rank=0)  # more than 256 on any machine
    check_local_resources(world=100_000, bytes_per_rank=0, force=True)
    check_local_resources(world=1, bytes_per_rank=0)


def test_reading_cores_and_memory(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  8000 kB\nMemFree:  2000 kB\nMemAvailable:  5000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_memory(str(meminfo), str(cgroup)) == 5000 * 1024
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("1000\n")
    assert available_memory(str(meminfo), str(cgroup)) == 5000 * 1024
    (cgroup / "memory.max").write_text("3001000\n")
    assert available_memory(str(meminfo), str(cgroup)) == 3_000_000  # the container's limit is lower
    (cgroup / "cpu.max").write_text("50000 100000\n")
    assert usable_cores(str(cgroup)) == 1
    (cgroup / "cpu.max").write_text("max 100000\n")
    assert usable_cores(str(cgroup)) >= 1
