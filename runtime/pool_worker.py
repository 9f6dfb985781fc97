"""The worker-process side of `WorkerPool`: the loop a spawned worker runs, and its hygiene.

A worker ignores Ctrl-C (the parent handles it and stops the workers), dies with its
parent (`PR_SET_PDEATHSIG` on Linux, and a thread that watches the parent pid
everywhere), then serves jobs: it joins a fresh process group on the job's FileStore,
runs `fn(RankInfo, payload)` and sends back the result or a `Failure` saying whether
the rank raised a `FivedcError` (a user error, re-raised as such by the parent), timed
out waiting in a collective, or raised anything else (with the traceback). Messages to
the parent are pickled `(job_id, status, value)` with status "returned" (fn returned:
the rank may now wait in the closing barrier), "progress", "ok" or "error".
"""

from __future__ import annotations

import ctypes
import multiprocessing.util
import os
import pickle
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from fivedc.errors import FivedcError

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_WATCH_S = 0.5  # how often the fallback thread checks that the parent is alive
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)  # gloo and store wait timeouts


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world: int
    device: str  # "cpu" or "cuda:N"
    progress: Callable[[str], None] | None = field(default=None, repr=False, compare=False)

    def report(self, text: str) -> None:
        """Send a progress line to the parent's `on_progress`; only rank 0's are sent
        (the others, and ranks outside a pool, report nothing)."""
        if self.rank == 0 and self.progress is not None:
            self.progress(str(text))


@dataclass(frozen=True)
class Failure:
    """Why a rank did not return a result. `kind` is "died", "raised", "timeout" (it
    waited in a collective longer than the timeout) or "user" (a FivedcError: `text`
    is its rendered message, and `exit_code`, `message`, `loc` and `hint` rebuild it)."""

    kind: str
    when: float  # time.time(): orders the ranks' failures
    text: str
    exit_code: int = 3
    message: str = ""
    loc: tuple[str, int, int, str] | None = None  # a SourceLoc's fields
    hint: str = ""


def failure_of(error: BaseException) -> Failure:
    """Describe an exception a job raised, for the parent."""
    now = time.time()
    if isinstance(error, FivedcError):
        loc = error.loc
        fields = (loc.file, loc.line, loc.col, loc.text) if loc is not None else None
        return Failure("user", now, error.render(), int(error.exit_code), error.message, fields, error.hint)
    kind = "timeout" if isinstance(error, RuntimeError) and _TIMEOUT.search(str(error)) else "raised"
    return Failure(kind, now, "".join(traceback.format_exception(error)))


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_for(backend: str, local_rank: int) -> str:
    if backend != "nccl":
        return "cpu"
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


# ---- process hygiene ------------------------------------------------------------------
def _die_with_parent(parent_pid: int, folder: str, *, pdeathsig: bool) -> None:
    """Exit when the parent exits, even by SIGKILL. PR_SET_PDEATHSIG fires when the
    thread that spawned us ends, so the parent asks for it only from its main thread;
    the watching thread covers the rest (and other systems) within `_WATCH_S`."""
    if pdeathsig and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        _orphaned(folder)
    threading.Thread(target=_watch_parent, args=(parent_pid, folder), daemon=True).start()


def _watch_parent(parent_pid: int, folder: str) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_WATCH_S)
    _orphaned(folder)


def _orphaned(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)  # the parent could not: it was killed
    os._exit(1)


# ---- jobs -----------------------------------------------------------------------------
def _run_job(slot: int, job_bytes: bytes, send: Callable[[str, Any], None]) -> tuple[str, Any]:
    """("ok", result) or ("error", Failure)."""
    try:
        cwd, inner = pickle.loads(job_bytes)  # a str and bytes: nothing to import yet
        # a job runs where its caller is now, not where the pool started (relative paths), and is
        # unpickled there: importing its module may ask for the cwd, and the last job's may be gone
        os.chdir(cwd)
        fn, payload, world, store_path, backend, timeout_s = pickle.loads(inner)
        device = device_for(backend, slot)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            backend, store=store, rank=slot, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        result = fn(RankInfo(slot, world, device, lambda text: send("progress", text)), payload)
        send("returned", None)  # so a hang in the barrier below blames the ranks that never got here
        dist.barrier()  # gloo: a rank that tears down early breaks peers still connecting
        return "ok", result
    except BaseException as error:  # noqa: BLE001 - everything goes back to the parent
        return "error", failure_of(error)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_main(slot: int, conn: Connection, parent_pid: int, folder: str, pdeathsig: bool) -> None:
    """Serve jobs until the parent says b"" or goes, then exit at once (nothing here
    needs the interpreter's slow shutdown with torch loaded). The parent starts us
    with SIGINT blocked: ignoring it before unblocking drops a Ctrl-C that arrived
    while Python and torch were starting."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _die_with_parent(parent_pid, folder, pdeathsig=pdeathsig)
    torch.set_num_threads(1)
    conn.send_bytes(b"ready")
    _serve(slot, conn, folder)
    sys.stdout.flush()
    sys.stderr.flush()
    # multiprocessing's own clean-up of what this process made (a library's lock at import, tqdm's):
    # skipped by os._exit, the parent's resource tracker would warn of "leaked semaphore objects"
    multiprocessing.util._run_finalizers(0)
    os._exit(0)


def _serve(slot: int, conn: Connection, folder: str) -> None:
    """Loop: receive a pickled job, run it, send back the outcome. The parent ends it
    with b""; the connection's end (EOF) without that means the parent is gone (a
    parent that stops a worker ends it first), so the worker cleans up after it: it
    may see EOF before its watching thread sees the parent's pid change."""
    lock = threading.Lock()
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            _orphaned(folder)
        if not message:
            return
        job_id, job_bytes = pickle.loads(message)

        def send(status: str, value: Any, job_id: int = job_id) -> None:
            with lock:  # a job may report progress from its own threads
                conn.send_bytes(pickle.dumps((job_id, status, value)))

        status, value = _run_job(slot, job_bytes, send)
        try:
            reply = pickle.dumps((job_id, status, value))
        except BaseException as error:  # noqa: BLE001 - an unpicklable result
            reply = pickle.dumps((job_id, "error", failure_of(error)))
        conn.send_bytes(reply)
        if dist.is_initialized():  # could not clean up: let the parent replace this worker
            return
