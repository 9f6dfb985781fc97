"""Refuse a local multi-rank run that this machine cannot hold, before any worker starts.

`fivedc verify` and `fivedc run` start one process per rank on this machine. A mesh
meant for a cluster (thousands of ranks) would start thousands of Python processes
with torch and bring the machine down, so `check_local_resources` refuses, with the
numbers and what to do instead, a world that exceeds either rule:
- processes: at most `RANKS_PER_CORE` ranks per usable core (gloo ranks mostly wait
  on each other, so a few per core are fine: the tests run 8 ranks on 2 cores) and
  never more than `MAX_LOCAL_RANKS` (each rank holds a connection to every other);
- memory: world x (bytes per rank + `PROCESS_BYTES` for a Python process with torch)
  + the bytes of a single-device reference run must fit the available memory
  (MemAvailable, or the container's memory limit if lower; unknown: not checked).
`force=True` (the CLI's --force) skips the check. `check_resources` is the pure rule,
taking a `Machine`, so it can be tested on machines of any size.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from fivedc.errors import FivedcError
from fivedc.plan.summary import format_bytes

RANKS_PER_CORE = 8
MAX_LOCAL_RANKS = 256
PROCESS_BYTES = 300 * 2**20  # a Python process that imported torch, before any tensor


class ResourceError(FivedcError):
    """A local run needs more processes or memory than this machine has."""

    exit_code = 2


@dataclass(frozen=True)
class Machine:
    cores: int
    available_bytes: int | None  # None: unknown, so memory is not checked


def check_local_resources(
    *, world: int, bytes_per_rank: int, reference_bytes: int = 0, force: bool = False, what: str = "this run"
) -> None:
    """Raise ResourceError when `world` local ranks of `bytes_per_rank` each (and a
    reference run of `reference_bytes`) do not fit this machine, unless `force`."""
    if not force:
        check_resources(this_machine(), world=world, bytes_per_rank=bytes_per_rank,
                        reference_bytes=reference_bytes, what=what)


def check_resources(
    machine: Machine, *, world: int, bytes_per_rank: int, reference_bytes: int = 0, what: str = "this run"
) -> None:
    """The rule of `check_local_resources`, on a given machine."""
    fit = max_local_ranks(machine, bytes_per_rank=bytes_per_rank, reference_bytes=reference_bytes)
    if world <= fit:
        return
    cap = min(RANKS_PER_CORE * machine.cores, MAX_LOCAL_RANKS)
    if world > cap:
        why = (f"{what} needs {world} local processes, but this machine runs at most {cap} "
               f"({machine.cores} cores x {RANKS_PER_CORE} per core, and never more than {MAX_LOCAL_RANKS})")
    else:
        need = world * (bytes_per_rank + PROCESS_BYTES) + reference_bytes
        why = (f"{what} needs about {format_bytes(need)} of memory, {world} processes x "
               f"({format_bytes(bytes_per_rank)} + {format_bytes(PROCESS_BYTES)} for Python and torch)"
               + (f" + {format_bytes(reference_bytes)} for the reference run" if reference_bytes else "")
               + f", but {format_bytes(machine.available_bytes or 0)} is available")
    raise ResourceError(why, hint=_advice(world, fit))


def max_local_ranks(machine: Machine, *, bytes_per_rank: int, reference_bytes: int = 0) -> int:
    """The most ranks `machine` runs by both rules (0 when not even one fits in memory)."""
    fit = min(RANKS_PER_CORE * max(machine.cores, 1), MAX_LOCAL_RANKS)
    if machine.available_bytes is not None:
        room = machine.available_bytes - reference_bytes
        fit = min(fit, max(room, 0) // (bytes_per_rank + PROCESS_BYTES))
    return fit


def _advice(world: int, fit: int) -> str:
    if fit == 0:
        return ("not one rank fits in this machine's memory: run it on machines with more memory per rank "
                "(torchrun across machines, -m fivedc.cli.main run PLAN.json), shard more (a larger mesh, ZeRO), "
                "use a smaller model, or pass --force to try anyway")
    per_node = max((d for d in range(1, max(fit, 1) + 1) if world % d == 0), default=1)
    launch = (f"launch it across machines with torchrun (torchrun --nnodes {world // per_node} "
              f"--nproc-per-node {per_node} ... -m fivedc.cli.main run PLAN.json)")
    return f"{launch}, use a smaller mesh, or pass --force to try anyway"


# ---- this machine -----------------------------------------------------------------
def this_machine() -> Machine:
    return Machine(cores=usable_cores(), available_bytes=available_memory())


def usable_cores(cgroup: str = "/sys/fs/cgroup") -> int:
    """Cores this process may run on, capped by a container's CPU quota (cgroup v2)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _read(os.path.join(cgroup, "cpu.max")).split()
    if len(quota) == 2 and quota[0].isdigit() and quota[1].isdigit() and int(quota[1]) > 0:
        cores = min(cores, max(1, math.ceil(int(quota[0]) / int(quota[1]))))
    return cores


def available_memory(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Bytes that can be allocated without swapping: MemAvailable (else free pages),
    or what is left under a container's memory limit (cgroup v2) if that is less."""
    found = None
    for line in _read(meminfo).splitlines():
        if line.startswith("MemAvailable:"):
            found = int(line.split()[1]) * 1024
    if found is None:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            found = None
    limit, used = _read(os.path.join(cgroup, "memory.max")).strip(), _read(os.path.join(cgroup, "memory.current"))
    if limit.isdigit() and used.strip().isdigit():
        left = max(int(limit) - int(used), 0)
        found = left if found is None else min(found, left)
    return found


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return ""
