"""Worker processes that run multi-rank jobs, each on a fresh process group.

Starting a Python process with torch takes seconds, and tests and the CLI run many
small multi-rank jobs, so `WorkerPool` keeps spawned workers alive and, per job,
has workers 0..world-1 rendezvous on a new FileStore, run `fn(RankInfo, payload)`,
and destroy the process group again (the worker side is `pool_worker`). A job may
run as long as it computes; `timeout_s` bounds only how long a rank waits in a
collective for its peers. A rank that raises becomes a `WorkerError` (exit code 3)
naming that rank, with its traceback, or a `RankError` with the exit code and message
of the `FivedcError` it raised; ranks still blocked after an error and dead workers
are terminated and replaced before the next job. Workers ignore Ctrl-C and die with
the parent, and the pool's temporary folder goes on every exit (a pool removes those
left by killed processes). `fn` must be a module-level function (it is pickled by
reference) and payloads and results must pickle (tensors are copied by value; return
CPU tensors). `init_from_env` and `check_world` serve torchrun-style launches instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist

from fivedc.errors import FivedcError, MeshError, SourceLoc
from fivedc.ir.mesh import Mesh
from fivedc.runtime import DEFAULT_TIMEOUT_S
from fivedc.runtime.pool_cleanup import abandon_on_sigterm, new_folder, sigint_blocked
from fivedc.runtime.pool_worker import Failure, RankInfo, default_backend, device_for, worker_main

__all__ = ["DEFAULT_TIMEOUT_S", "RankError", "RankInfo", "WorkerError", "WorkerPool", "check_world", "default_backend",
           "init_from_env", "run_as_launched_rank", "run_once"]

_ERROR_GRACE_S = 5.0  # after one rank fails, how long the others get to report
_STARTUP_S = 300.0  # for a new worker to import torch (not counted in a job's timeout)
_BLAME = {"died": 0, "user": 1, "raised": 1, "timeout": 2}  # which failure explains the others


class WorkerError(FivedcError):
    """A rank of a multi-rank job raised, hung, timed out or died."""

    exit_code = 3

    def __init__(self, message: str, *, rank: int | None = None, hint: str = "") -> None:
        super().__init__(message, hint=hint)
        self.rank = rank


class RankError(WorkerError):
    """A rank raised a FivedcError (bad input found inside a worker): its message,
    location, hint and exit code, and the rank."""

    def __init__(self, failure: Failure, *, rank: int, where: str) -> None:
        loc = SourceLoc(*failure.loc) if failure.loc is not None else None
        super().__init__(f"{failure.message} ({where})", rank=rank, hint=failure.hint)
        self.loc = loc
        self.exit_code = failure.exit_code


# ---- the parent side ----------------------------------------------------------------
class WorkerPool:
    """Up to `size` long-lived worker processes; each started on first use."""

    def __init__(
        self, size: int, *, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        if not timeout_s > 0:
            raise FivedcError(f"the timeout must be more than 0 seconds, not {timeout_s:g}",
                              hint="pass --timeout SECONDS with SECONDS > 0, e.g. --timeout 300")
        self.size = size
        self.backend = backend or default_backend()
        self.timeout_s = timeout_s
        self._ctx = mp.get_context("spawn")
        self._procs: dict[int, Any] = {}
        self._conns: dict[int, Connection] = {}
        self._busy: set[int] = set()  # workers with a job in flight
        self._tmp = new_folder()
        weakref.finalize(self, shutil.rmtree, self._tmp, ignore_errors=True)  # if never closed
        abandon_on_sigterm(self)
        self._jobs = 0

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        # Ctrl-C or SystemExit: stop at once rather than wait for the workers to exit
        self.close(wait_s=0.0 if kind is not None and not issubclass(kind, Exception) else 5.0)

    def run(
        self, fn: Callable[[RankInfo, Any], Any], *, world: int, payload: Any,
        on_progress: Callable[[str], None] | None = None,
    ) -> list[Any]:
        """Run `fn(RankInfo, payload)` on ranks 0..world-1; returns the results by rank.
        `on_progress(text)` gets each line rank 0 sends with `RankInfo.report` as it comes."""
        if not 1 <= world <= self.size:
            raise MeshError(f"a job of {world} ranks does not fit a pool of {self.size} workers")
        self._jobs += 1
        store = os.path.join(self._tmp, f"store-{self._jobs}")
        try:
            job = pickle.dumps((os.getcwd(), pickle.dumps((fn, payload, world, store, self.backend, self.timeout_s))))
            message = pickle.dumps((self._jobs, job))
        except Exception as exc:
            raise WorkerError(
                f"cannot send job {getattr(fn, '__qualname__', fn)!r} to the workers: {exc}",
                hint="fn must be a module-level function, and payload must pickle",
            ) from exc
        os.makedirs(self._tmp, exist_ok=True)  # in case the pool was closed and is used again
        self._start(range(world))
        self._busy = set(range(world))
        try:
            for slot in range(world):
                try:
                    self._conns[slot].send_bytes(message)
                except OSError:  # the worker just died: _collect reports it
                    pass
            name = getattr(fn, "__qualname__", repr(fn))
            return self._collect(self._jobs, world, name=name, on_progress=on_progress)
        finally:  # ranks still in the job after an error, Ctrl-C or a failing on_progress
            self._stop(self._busy, wait_s=0.0)
            self._busy = set()

    def close(self, *, wait_s: float = 5.0) -> None:
        """Ask every worker to exit, give them `wait_s` in all, then terminate the rest."""
        for conn in self._conns.values():
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        self._stop(list(self._procs), wait_s=wait_s)
        shutil.rmtree(self._tmp, ignore_errors=True)

    def abandon(self) -> None:
        """Terminate the workers without waiting and remove the folder (on SIGTERM)."""
        for proc in list(self._procs.values()):
            proc.terminate()
        shutil.rmtree(self._tmp, ignore_errors=True)

    # ---- internals ----------------------------------------------------------------
    def _start(self, slots: range) -> None:
        """Start the workers in `slots` that are not running and wait until they are ready."""
        dead = [s for s in slots if s in self._procs and not self._procs[s].is_alive()]
        self._stop(dead, wait_s=0.0)
        new = [s for s in slots if s not in self._procs]
        try:
            for slot in new:
                self._spawn(slot)
            for slot in new:
                self._await_ready(slot)
        except BaseException:  # e.g. Ctrl-C while torch is imported: no half-started workers
            self._stop(new, wait_s=0.0)
            raise

    def _spawn(self, slot: int) -> None:
        parent, child = self._ctx.Pipe()
        main = threading.current_thread() is threading.main_thread()
        args = (slot, child, os.getpid(), self._tmp, main)
        proc = self._ctx.Process(target=worker_main, args=args, daemon=True, name=f"fivedc-worker-{slot}")
        with sigint_blocked():  # the worker ignores SIGINT from its very first instruction
            proc.start()
            self._procs[slot], self._conns[slot] = proc, parent
        child.close()

    def _await_ready(self, slot: int) -> None:
        conn = self._conns[slot]
        try:
            ready = conn.poll(_STARTUP_S) and conn.recv_bytes() == b"ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self._procs[slot].join(timeout=1.0)  # an exit code, if it exited
            code = self._procs[slot].exitcode
            self._stop([slot], wait_s=0.0)
            why = f"exited with code {code}" if code is not None else f"was not up in {_STARTUP_S:g} s"
            raise WorkerError(f"worker {slot} did not start: it {why}", rank=slot)

    def _stop(self, slots: Iterable[int], *, wait_s: float) -> None:
        """Give the workers `wait_s` in all to exit, then terminate them, then kill them."""
        procs = [self._procs.pop(s) for s in list(slots) if s in self._procs]
        conns = [self._conns.pop(s) for s in list(slots) if s in self._conns]
        deadline = time.monotonic() + wait_s
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in conns:
            conn.close()

    def _collect(
        self, job_id: int, world: int, *, name: str, on_progress: Callable[[str], None] | None
    ) -> list[Any]:
        """Wait for every rank's outcome: no deadline (a rank that waits too long in a
        collective fails by itself), but once a rank failed the others get a short grace."""
        results: dict[int, Any] = {}
        failures: dict[int, Failure] = {}
        returned: set[int] = set()  # ranks whose fn returned (they may wait in the closing barrier)
        limit: float | None = None
        while self._busy and (limit is None or time.monotonic() < limit):
            objs = [self._conns[s] for s in self._busy] + [self._procs[s].sentinel for s in self._busy]
            wait(objs, timeout=None if limit is None else max(0.0, limit - time.monotonic()))
            for slot in sorted(self._busy):
                self._poll(slot, job_id, results, failures, returned, on_progress)
            self._busy -= results.keys() | failures.keys()
            if failures and limit is None:
                limit = time.monotonic() + _ERROR_GRACE_S
        if failures:
            raise self._error(name, world, failures, set(self._busy), returned)
        return [results[s] for s in range(world)]

    def _poll(
        self, slot: int, job_id: int, results: dict[int, Any], failures: dict[int, Failure],
        returned: set[int], on_progress: Callable[[str], None] | None,
    ) -> None:
        """Read what worker `slot` sent for this job; note it if the process died."""
        conn, proc = self._conns[slot], self._procs[slot]
        try:
            while conn.poll():
                got_id, status, value = pickle.loads(conn.recv_bytes())
                if got_id != job_id:
                    continue
                if status == "progress":
                    if on_progress is not None:
                        on_progress(value)
                elif status == "returned":
                    returned.add(slot)
                elif status == "ok":
                    results[slot] = value
                    return
                else:
                    failures[slot] = value
                    return
        except (EOFError, OSError):
            pass
        if not proc.is_alive():
            text = f"the worker process died (exit code {proc.exitcode})"
            failures[slot] = Failure("died", time.time(), text)
            self._stop([slot], wait_s=0.0)

    def _error(
        self, name: str, world: int, failures: dict[int, Failure], hung: set[int], returned: set[int]
    ) -> WorkerError:
        """Blame a dead worker, else the earliest error; when every failure is a rank
        that timed out waiting in a collective, blame the ranks that never arrived."""
        first = min(failures, key=lambda s: (_BLAME[failures[s].kind], failures[s].when))
        failure, notes = failures[first], []
        if failure.kind == "timeout":
            waited = set(failures)
            missing = hung - returned or hung
            if missing:
                head = (f"rank(s) {_ranks(missing)} of {world} did not arrive at a collective in {name}: "
                        f"rank(s) {_ranks(waited)} waited {self.timeout_s:g} s for them and timed out")
                first = min(missing)
            else:
                head = (f"rank(s) {_ranks(waited)} of {world} timed out after {self.timeout_s:g} s waiting "
                        f"in a collective in {name}, though no rank was missing: they probably called "
                        f"different collectives")
            if busy := hung & returned:
                notes.append(f"rank(s) {_ranks(busy)} returned and waited for them")
            notes.append("a rank that computes longer between collectives needs a longer wait: "
                         f"pass --timeout SECONDS (now {self.timeout_s:g})")
            return WorkerError(head, rank=first, hint="; ".join(notes))
        if failure.kind == "user":  # the others' failures follow from it: not worth a word
            return RankError(failure, rank=first, where=f"on rank {first} of {world} in {name}")
        if hung:
            notes.append(f"rank(s) {_ranks(hung)} hung and were restarted")
        if others := set(failures) - {first}:
            notes.append(f"rank(s) {_ranks(others)} failed too")
        head = f"rank {first} of {world} failed in {name}:\n{failure.text.rstrip()}"
        return WorkerError(head, rank=first, hint="; ".join(notes))


def _ranks(slots: Iterable[int]) -> str:
    return ", ".join(map(str, sorted(slots)))


def run_once(
    fn: Callable[[RankInfo, Any], Any], *, world: int, payload: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
    on_progress: Callable[[str], None] | None = None,
) -> list[Any]:
    """One job on a temporary pool of `world` processes (for the CLI)."""
    with WorkerPool(world, timeout_s=timeout_s) as pool:
        return pool.run(fn, world=world, payload=payload, on_progress=on_progress)


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
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing and not dist.is_initialized():
        raise MeshError(
            f"RANK and WORLD_SIZE are set but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not, "
            "so this process cannot find the others of its launch",
            hint="start it with torchrun (which sets all four), or unset RANK and WORLD_SIZE to run locally",
        )
    backend = backend or default_backend()
    device = device_for(backend, int(os.environ.get("LOCAL_RANK", rank)))
    if not dist.is_initialized():
        from fivedc.runtime.elastic_store import launcher_store

        timeout = timedelta(seconds=timeout_s)
        store = launcher_store(rank, world, timeout)  # torchrun's: each restart's keys apart
        how = {"init_method": "env://"} if store is None else {"store": store}
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **how)
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
