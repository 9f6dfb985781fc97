"""Worker processes that run multi-rank jobs, each on a fresh process group.

Starting a Python process with torch takes seconds, and tests and the CLI run many
small multi-rank jobs, so `WorkerPool` keeps spawned workers alive and, per job,
has workers 0..world-1 rendezvous on a new FileStore, run `fn(RankInfo, payload)`,
and destroy the process group again. A rank that raises becomes a `WorkerError`
in the parent naming that rank, with its traceback; ranks still blocked after the
error (or past the timeout) and dead workers are terminated and replaced before
the next job. `fn` must be a module-level function (it is pickled by reference)
and payloads and results must pickle (tensors are copied by value; return CPU
tensors). `init_from_env` and `check_world` serve torchrun-style launches instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from fivedc.errors import FivedcError, MeshError
from fivedc.mesh import Mesh

_ERROR_GRACE_S = 5.0  # after one rank fails, how long the others get to report
_STARTUP_S = 300.0  # for a new worker to import torch (not counted in a job's timeout)
Errors = dict[int, tuple[int, float, str]]  # rank -> (0 died / 1 raised, when, text)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world: int
    device: str  # "cpu" or "cuda:N"


class WorkerError(FivedcError):
    """A rank of a multi-rank job raised, hung or died."""

    exit_code = 1

    def __init__(self, message: str, *, rank: int | None = None, hint: str = "") -> None:
        super().__init__(message, hint=hint)
        self.rank = rank


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _device(backend: str, local_rank: int) -> str:
    if backend != "nccl":
        return "cpu"
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


# ---- the worker side ----------------------------------------------------------------
def _run_job(slot: int, job_bytes: bytes, returned: Callable[[], None]) -> tuple[str, Any, float]:
    """(status, result or traceback, when it failed): the time orders the ranks' errors."""
    try:
        fn, payload, world, store_path, backend, timeout_s = pickle.loads(job_bytes)
        device = _device(backend, slot)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            backend, store=store, rank=slot, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        result = fn(RankInfo(slot, world, device), payload)
        returned()  # so a hang in the barrier below blames the ranks that never got here
        dist.barrier()  # gloo: a rank that tears down early breaks peers still connecting
        return "ok", result, 0.0
    except BaseException:
        return "error", traceback.format_exc(), time.time()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker_main(slot: int, conn: Connection) -> None:
    """Loop: receive a pickled job, run it, send back (status, value, time)."""
    torch.set_num_threads(1)
    conn.send_bytes(b"ready")  # torch is imported: job timeouts start counting from here
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            return
        if not message:
            return
        job_id, job_bytes = pickle.loads(message)
        notice = pickle.dumps((job_id, "returned", None, 0.0))
        status, value, when = _run_job(slot, job_bytes, lambda: conn.send_bytes(notice))
        try:
            reply = pickle.dumps((job_id, status, value, when))
        except BaseException:
            reply = pickle.dumps((job_id, "error", traceback.format_exc(), time.time()))
        conn.send_bytes(reply)
        if dist.is_initialized():  # could not clean up: let the parent replace this worker
            return


# ---- the parent side ----------------------------------------------------------------
class WorkerPool:
    """Up to `size` long-lived worker processes; each started on first use."""

    def __init__(self, size: int, *, backend: str | None = None, timeout_s: float = 120.0) -> None:
        self.size = size
        self.backend = backend or default_backend()
        self.timeout_s = timeout_s
        self._ctx = mp.get_context("spawn")
        self._procs: dict[int, Any] = {}
        self._conns: dict[int, Connection] = {}
        self._tmp = tempfile.mkdtemp(prefix="fivedc-pool-")
        self._jobs = 0

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, fn: Callable[[RankInfo, Any], Any], *, world: int, payload: Any) -> list[Any]:
        """Run `fn(RankInfo, payload)` on ranks 0..world-1; returns the results by rank."""
        if not 1 <= world <= self.size:
            raise MeshError(f"a job of {world} ranks does not fit a pool of {self.size} workers")
        self._jobs += 1
        store = os.path.join(self._tmp, f"store-{self._jobs}")
        try:
            job = pickle.dumps((fn, payload, world, store, self.backend, self.timeout_s))
            message = pickle.dumps((self._jobs, job))
        except Exception as exc:
            raise WorkerError(
                f"cannot send job {getattr(fn, '__qualname__', fn)!r} to the workers: {exc}",
                hint="fn must be a module-level function, and payload must pickle",
            ) from exc
        os.makedirs(self._tmp, exist_ok=True)  # in case the pool was closed and is used again
        self._start(range(world))
        for slot in range(world):
            try:
                self._conns[slot].send_bytes(message)
            except OSError:  # the worker just died: _collect reports it
                pass
        return self._collect(self._jobs, world, name=getattr(fn, "__qualname__", repr(fn)))

    def close(self) -> None:
        for conn in self._conns.values():  # ask every worker to exit, then wait for each
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        for slot in list(self._procs):
            self._stop(slot)
        shutil.rmtree(self._tmp, ignore_errors=True)

    # ---- internals ----------------------------------------------------------------
    def _start(self, slots: range) -> None:
        """Start the workers in `slots` that are not running and wait until they are ready."""
        new: list[int] = []
        for slot in slots:
            proc = self._procs.get(slot)
            if proc is not None and proc.is_alive():
                continue
            if proc is not None:
                self._stop(slot, wait_s=0)
            parent, child = self._ctx.Pipe()
            proc = self._ctx.Process(target=_worker_main, args=(slot, child), daemon=True)
            proc.start()
            child.close()
            self._procs[slot], self._conns[slot] = proc, parent
            new.append(slot)
        for slot in new:
            conn = self._conns[slot]
            try:
                ready = conn.poll(_STARTUP_S) and conn.recv_bytes() == b"ready"
            except (EOFError, OSError):
                ready = False
            if not ready:
                code = self._procs[slot].exitcode
                self._stop(slot, wait_s=0)
                why = f"exited with code {code}" if code is not None else f"was not up in {_STARTUP_S:g} s"
                raise WorkerError(f"worker {slot} did not start: it {why}", rank=slot)

    def _stop(self, slot: int, *, wait_s: float = 5.0) -> None:
        """Wait up to `wait_s` for the worker to exit, then terminate it, then kill it."""
        proc, conn = self._procs.pop(slot), self._conns.pop(slot)
        proc.join(timeout=wait_s)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        conn.close()

    def _collect(self, job_id: int, world: int, *, name: str) -> list[Any]:
        results: dict[int, Any] = {}
        errors: Errors = {}
        returned: set[int] = set()  # ranks whose fn returned (they may wait in the closing barrier)
        pending = set(range(world))
        deadline = time.monotonic() + self.timeout_s
        limit = deadline
        while pending and time.monotonic() < limit:
            objs = [self._conns[s] for s in pending] + [self._procs[s].sentinel for s in pending]
            wait(objs, timeout=max(0.0, limit - time.monotonic()))
            for slot in sorted(pending):
                self._poll(slot, job_id, results, errors, returned)
            pending -= results.keys() | errors.keys()
            if errors and limit == deadline:  # once a rank failed, the others get a short grace
                limit = min(deadline, time.monotonic() + _ERROR_GRACE_S)
        for slot in pending:  # still blocked after an error or the timeout
            self._stop(slot, wait_s=0)
        if errors or pending:
            timed_out = bool(pending) and time.monotonic() >= deadline
            raise self._error(name, world, errors, pending, returned, timed_out=timed_out)
        return [results[s] for s in range(world)]

    def _poll(
        self, slot: int, job_id: int, results: dict[int, Any], errors: Errors, returned: set[int]
    ) -> None:
        """Read what worker `slot` sent for this job; note it if the process died."""
        conn, proc = self._conns[slot], self._procs[slot]
        try:
            while conn.poll():
                got_id, status, value, when = pickle.loads(conn.recv_bytes())
                if got_id != job_id:
                    continue
                if status == "returned":
                    returned.add(slot)
                    continue
                if status == "ok":
                    results[slot] = value
                else:
                    errors[slot] = (1, when, value)
                return
        except (EOFError, OSError):
            pass
        if not proc.is_alive():
            errors[slot] = (0, time.time(), f"the worker process died (exit code {proc.exitcode})")
            self._stop(slot, wait_s=0)

    def _error(
        self, name: str, world: int, errors: Errors, hung: set[int], returned: set[int],
        *, timed_out: bool,
    ) -> WorkerError:
        """Blame hung ranks after a timeout (those whose fn did not return), else a dead
        worker, else the earliest error."""
        def ranks(slots: set[int]) -> str:
            return ", ".join(map(str, sorted(slots)))

        notes = []
        if timed_out or not errors:
            culprits = hung - returned or hung
            first = min(culprits)
            head = f"rank(s) {ranks(culprits)} of {world} did not finish {name} in {self.timeout_s:g} s"
            notes.append("a collective is probably waiting for a rank that never joins it")
            if waited := hung & returned:
                notes.append(f"rank(s) {ranks(waited)} returned and waited for them")
        else:
            first = min(errors, key=lambda s: errors[s][:2])
            head = f"rank {first} of {world} failed in {name}:\n{errors[first][2].rstrip()}"
            if hung:
                notes.append(f"rank(s) {ranks(hung)} hung and were restarted")
        if others := set(errors) - {first}:
            notes.append(f"rank(s) {ranks(others)} failed too")
        return WorkerError(head, rank=first, hint="; ".join(notes))


def run_once(fn: Callable[[RankInfo, Any], Any], *, world: int, payload: Any) -> list[Any]:
    """One job on a temporary pool of `world` processes (for the CLI)."""
    with WorkerPool(world) as pool:
        return pool.run(fn, world=world, payload=payload)


# ---- torchrun-style launches --------------------------------------------------------
def init_from_env(*, backend: str | None = None, timeout_s: float = 600.0) -> RankInfo:
    """Join the process group a launcher such as torchrun describes (RANK, WORLD_SIZE, ...)."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError as exc:
        raise MeshError(
            f"{exc.args[0]} is not set, so this process was not started by a launcher",
            hint="start it with torchrun, e.g. torchrun --nproc-per-node=4 ...",
        ) from None
    backend = backend or default_backend()
    device = _device(backend, int(os.environ.get("LOCAL_RANK", rank)))
    if not dist.is_initialized():
        dist.init_process_group(
            backend, init_method="env://", rank=rank, world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
    return RankInfo(rank, world, device)


def run_as_launched_rank(fn: Callable[[RankInfo, Any], Any], *, mesh: Mesh, payload: Any) -> list[Any] | None:
    """`fn(info, payload)` as this rank of a torchrun job of the mesh's size (checked):
    every rank's result, in rank order, on rank 0; None on the others. The process
    group is gone when this returns."""
    check_world(mesh.world, mesh=mesh)
    info = init_from_env()
    try:
        result = fn(info, payload)
        gathered: list[Any] = [None] * info.world
        dist.all_gather_object(gathered, result)
    finally:
        dist.destroy_process_group()
    return gathered if info.rank == 0 else None


def check_world(expected: int, *, mesh: Mesh | str | None = None) -> None:
    """Raise MeshError when a launcher's WORLD_SIZE differs from the `expected` ranks."""
    started = os.environ.get("WORLD_SIZE")
    if started is None or int(started) == expected:
        return
    what = f"the mesh {mesh}" if mesh is not None else "this run"
    raise MeshError(
        f"{what} needs {expected} processes but the launcher started {started}",
        hint=f"start {expected} processes (e.g. torchrun --nproc-per-node={expected}) "
        f"or change the mesh so its sizes multiply to {started}",
    )
