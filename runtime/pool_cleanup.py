"""How a `WorkerPool`'s processes and files go away, whatever ends the parent.

Each pool's temporary folder (and `fivedc train`'s scratch folder, `Scratch`) is named
after the parent's pid and holds an `owner` file (host and pid), so a new one removes
the folders of processes that were killed (SIGKILL runs no cleanup; the workers die
with their parent, see `pool_worker`).
On SIGTERM, where the program left its default action, the live pools' workers are
stopped and their folders removed before the process dies of SIGTERM as before.
Workers start with SIGINT blocked, so that a Ctrl-C in the terminal reaches only
the parent, which stops them.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

PREFIX = "fivedc-pool-"  # + the owner's pid + "-" + random: fivedc-pool-4242-k3j9x0a1
ORPHAN_AFTER_S = 60.0  # a pool folder this old without its owner file was half removed


class Abandonable(Protocol):
    def abandon(self) -> None: ...


_LIVE: weakref.WeakSet[Abandonable] = weakref.WeakSet()


def new_folder(prefix: str = PREFIX) -> str:
    """A temporary folder named after this process, after removing the folders of
    pools whose process is gone (on this host: the owner file names both)."""
    sweep(prefix)
    host = socket.gethostname()
    path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
    with open(os.path.join(path, "owner"), "w") as owner:
        owner.write(f"{host} {os.getpid()}\n")
    return path


def sweep(prefix: str = PREFIX) -> None:
    """Remove the `new_folder(prefix)` folders of processes of this host that are gone."""
    host = socket.gethostname()
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{prefix}*-*")):
        pid = os.path.basename(path)[len(prefix):].split("-", 1)[0]
        try:
            with open(os.path.join(path, "owner")) as owner:
                mine = owner.read().split() == [host, pid]
        except FileNotFoundError:  # the owner file follows mkdtemp at once: a folder
            mine = _older_than(path, ORPHAN_AFTER_S)  # long without one lost it to a sweep
        except OSError:
            continue
        if mine and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


class Scratch:
    """A `new_folder` removed when the `with` block ends and on SIGTERM (`abandon`)."""

    def __init__(self, prefix: str) -> None:
        self.path = new_folder(prefix)

    def __enter__(self) -> str:
        abandon_on_sigterm(self)
        return self.path

    def __exit__(self, *exc) -> None:
        self.abandon()

    def abandon(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _older_than(path: str, seconds: float) -> bool:
    try:
        return time.time() - os.stat(path).st_mtime > seconds
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (one that exited and was not reaped yet does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


@contextmanager
def sigint_blocked() -> Iterator[None]:
    """Block SIGINT in this thread while a worker starts: the worker inherits the mask,
    so a Ctrl-C cannot interrupt it before it ignores SIGINT; here it is only delayed."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # starting it inside would unblock SIGINT again
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def abandon_on_sigterm(owner: Abandonable) -> None:
    """Call `owner.abandon()` on SIGTERM, then die of it; only where SIGTERM still has
    its default action (a program with its own handler cleans up in it)."""
    _LIVE.add(owner)
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: object) -> None:
    for owner in list(_LIVE):
        owner.abandon()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
