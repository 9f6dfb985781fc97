"""A save directory belongs to one run: an advisory `fcntl` lock held for the whole run.

`hold_save_dir(D)` creates D (and its parents) if need be, opens `D/.fivedc-lock` and
takes an exclusive, non-blocking `flock` on it, writing the holder's host and pid into
it. A second `fivedc train` on the same directory, while the first runs, is refused
(exit 2, naming the holder). The lock dies with its process, however it ends (kill -9
included), so a lock file left by a dead run is simply taken over. The file itself
stays: removing it would let a third run lock a new file while the second still holds
the old one.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fivedc.errors import FivedcError

LOCK = ".fivedc-lock"


@contextmanager
def hold_save_dir(save_dir: str | Path) -> Iterator[Path]:
    """Hold the save directory's lock for the `with` block; the lock file's path."""
    fd, path = _lock(Path(save_dir))
    try:
        yield path
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _lock(root: Path) -> tuple[int, Path]:
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as error:
        raise FivedcError(f"cannot lock --save-dir {root}: {error.strerror}",
                          hint="give a directory you can write to") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(fd)
        os.close(fd)
        raise FivedcError(f"--save-dir {root} is in use by another fivedc train ({holder or 'pid unknown'}): "
                          "one save directory belongs to one run",
                          hint="wait for that run to end, or give another --save-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
    return fd, root / LOCK


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""


__all__ = ["LOCK", "hold_save_dir"]
