"""Output files that never destroy what is there: `check_output` and `write_output`.

Every file fivedc writes (a plan, a schedule picture) goes through `write_output`,
which first checks the target with `check_output`: a symlink is written through
only when it points inside the working tree (the cwd); a directory, a device, a
FIFO, a socket, one of the command's own input files, a read-only file, a missing or
unwritable directory are refused with an `OutputError` (exit 2, the path and the
fix); `/dev/null` is the one device allowed: the output is discarded and the device
left alone. The data then goes to a temp file beside the final target, is fsynced, gets
the mode a plain `open()` would give (0o666 & ~umask, or the mode of the file it
replaces) and is renamed onto the target. The temp file is removed on every
failure, Ctrl-C included, so nothing is written unless everything is. A command
checks all its outputs together, before any work, with `fivedc/outputs.check_outputs`.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from fivedc.errors import FivedcError

T = TypeVar("T")
PathLike = str | os.PathLike


class OutputError(FivedcError):
    """An output path that cannot or must not be written."""


def check_output(path: PathLike, *, inputs: tuple[PathLike, ...] = (), what: str = "plan") -> Path:
    """The file a write to `path` would replace (a symlink's target), or an `OutputError`."""
    text = os.fspath(path)
    if not text:
        raise OutputError(f"no {what} file named", hint="name a file, e.g. -o out.json")
    if text.endswith(("/", os.sep)):
        raise OutputError(f"{what} output {text} names a directory", hint=f"name a file inside it, e.g. {text}out")
    target = _follow_link(Path(text), what)
    if _is_devnull(target):
        return target
    _check_existing(target, text, inputs, what)
    _check_directory(target.parent, text, what)
    return target


def _follow_link(path: Path, what: str) -> Path:
    if not path.is_symlink():
        return path
    try:
        target = path.resolve()
    except (OSError, RuntimeError) as error:  # a symlink loop (RuntimeError before Python 3.13)
        raise OutputError(f"{what} output {path} is a symlink that does not resolve: {error}",
                          hint="remove the link or choose another output path") from None
    cwd = Path.cwd().resolve()
    if not target.is_relative_to(cwd):
        raise OutputError(f"{what} output {path} is a symlink to {target}, outside the working tree {cwd}",
                          hint="write to a regular file, or remove the link first")
    return target


def _is_devnull(target: Path) -> bool:
    return target.exists() and _same_file(target, os.devnull)


def _check_existing(target: Path, text: str, inputs: tuple[PathLike, ...], what: str) -> None:
    try:
        st = target.stat()
    except (FileNotFoundError, NotADirectoryError):  # nothing there yet; the directory check speaks
        return
    except OSError as error:
        raise OutputError(f"cannot write {what} to {text}: {error.strerror}", hint="choose another output path") from None
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{what} output {text} is a directory",
                          hint=f"name a file inside it, e.g. {Path(text) / ('out' + _suffix(what))}")
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{what} output {text} is not a regular file (a device, FIFO or socket)",
                          hint="fivedc only replaces regular files; choose another output path")
    for source in inputs:
        if _same_file(target, source):
            raise OutputError(f"{what} output {text} is the input file {os.fspath(source)}; writing it would destroy it",
                              hint="choose another output path")
    if not os.access(target, os.W_OK):
        raise OutputError(f"{what} output {text} is read-only", hint="make it writable or choose another output path")


def _suffix(what: str) -> str:
    return ".png" if what == "picture" else ".json"


def _same_file(target: Path, source: PathLike) -> bool:
    try:
        return os.path.samefile(target, source)
    except OSError:  # the input is gone or unreadable: it cannot be the target
        return False


def _check_directory(directory: Path, text: str, what: str) -> None:
    shown = str(directory) if str(directory) else "."
    if not directory.exists():
        raise OutputError(f"cannot write {what} to {text}: the directory {shown} does not exist",
                          hint=f"create it first (mkdir -p {shown}) or choose another output path")
    if not directory.is_dir():
        raise OutputError(f"cannot write {what} to {text}: {shown} is not a directory", hint="choose another output path")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {what} to {text}: the directory {shown} is not writable",
                          hint="choose a directory you can write to")


def write_output(path: PathLike, data: bytes | str | Callable[[Path], T], *,
                 inputs: tuple[PathLike, ...] = (), what: str = "plan") -> T | None:
    """Write `data` to `path` atomically after `check_output`; a callable is given the
    temp file's path (in the target's directory, with `path`'s suffix, so that a writer
    that picks its format by suffix picks the right one) and its result is returned."""
    target = check_output(path, inputs=inputs, what=what)
    if _is_devnull(target):
        return _discard(data, Path(path).suffix)
    mode, owner = _mode_for(target)
    try:
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=f".tmp{Path(path).suffix}")
    except OSError as error:
        raise _write_error(error, path, what) from None
    tmp = Path(name)
    try:
        result = _fill(fd, tmp, data)
        _finish(tmp, target, mode, owner)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise _write_error(error, path, what) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return result


def _discard(data: bytes | str | Callable[[Path], T], suffix: str) -> T | None:
    """`-o /dev/null`: run a writer into a scratch file and keep nothing; never replace the device."""
    if not callable(data):
        return None
    with tempfile.TemporaryDirectory(prefix="fivedc-") as scratch:
        return data(Path(scratch) / f"discarded{suffix}")


def _fill(fd: int, tmp: Path, data: bytes | str | Callable[[Path], T]) -> T | None:
    """Write `data` into the temp file (open as `fd`) and fsync it."""
    if callable(data):
        os.close(fd)
        result = data(tmp)
        fd = os.open(tmp, os.O_RDONLY)
    else:
        payload = data.encode() if isinstance(data, str) else data
        result = None
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return result


def _finish(tmp: Path, target: Path, mode: int, owner: tuple[int, int] | None) -> None:
    """Give the temp file the target's mode (and owner, where allowed), rename it onto the target."""
    if owner is not None:
        try:
            os.chown(tmp, *owner)
        except OSError:  # only root may give a file away; the new file is then ours
            pass
    os.chmod(tmp, mode)
    os.replace(tmp, target)
    _sync_directory(target.parent)


def _mode_for(target: Path) -> tuple[int, tuple[int, int] | None]:
    """An existing file's mode and (uid, gid), else what open() would create: 0o666 & ~umask."""
    try:
        st = target.stat()
    except FileNotFoundError:
        return 0o666 & ~_umask(), None
    return stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _sync_directory(directory: Path) -> None:
    """Make the rename durable where the platform allows opening a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_error(error: OSError, path: PathLike, what: str) -> OutputError:
    return OutputError(f"cannot write {what} to {os.fspath(path)}: {error.strerror or error}",
                       hint="check the directory's permissions and free space, or choose another output path")


__all__ = ["OutputError", "check_output", "write_output"]
