"""The one rule for everything a command writes, checked before any work starts.

A command names its outputs (`-o`, `--json`, `--report`, `--plot`, `--log`, `show
--schedule`, `export -o`, `--save-dir`) and its inputs, and `check_outputs` checks them
all before the command reads a model or starts a process:

- each file by `files.check_output`: a regular file or a new name in an existing,
  writable directory; never a directory, a device, a FIFO, a socket, a symlink out
  of the working tree or one of the command's input files;
- none inside a folder the command reads (the checkpoint being resumed or exported,
  its save directory for `export`), so that no write replaces what is being read;
- no two outputs of one command the same file;
- a `--log` is appended to, so an existing one must be a log this tool wrote
  (`fivedc.log_file`); a save directory must be a directory or a new name, and not
  a symlink out of the working tree.

Each refusal is an `OutputError` (exit 2) that names the flag, the file and the fix.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fivedc.files import OutputError, PathLike, check_output


@dataclass(frozen=True, slots=True)
class Output:
    """One thing a command writes: its flag (`-o`, `--log`), the path given, what it is."""

    flag: str
    path: str
    what: str = "plan"  # plan, picture, log, model, search results, report, save directory


def check_outputs(outputs: Sequence[Output | None], *, inputs: tuple[PathLike, ...] = (),
                  read_dirs: tuple[PathLike, ...] = ()) -> dict[str, Path]:
    """Check every output (None: a flag not given) by the one rule; returns the file each
    flag would write (a symlink's target), by flag."""
    targets: dict[str, Path] = {}
    for out in (o for o in outputs if o is not None):
        target = _check_one(out, inputs)
        target = target if _is_devnull(target) else target.resolve()
        _outside(out, target, read_dirs)
        for flag, other in targets.items():
            if _same(target, other):
                raise OutputError(f"{out.flag} {out.path} and {flag} name the same file: one would overwrite "
                                  f"the other", hint=f"give {out.flag} and {flag} different files")
        targets[out.flag] = target
    return targets


def _check_one(out: Output, inputs: tuple[PathLike, ...]) -> Path:
    if out.what == "save directory":
        return check_save_dir_path(out.path, flag=out.flag)
    try:
        target = check_output(out.path, inputs=inputs, what=out.what)
    except OutputError as error:  # name the flag: "--log run.jsonl is a directory"
        lead = f"{out.what} output "
        error.message = (out.flag + " " + error.message[len(lead):] if error.message.startswith(lead)
                         else f"{out.flag}: {error.message}")
        raise
    if out.what == "log":
        from fivedc.log_file import check_log_contents

        check_log_contents(target, out.path, flag=out.flag)
    return target


def check_save_dir_path(path: str, *, flag: str = "--save-dir") -> Path:
    """A save directory: an existing directory or a new name; a symlink only into the tree."""
    given = Path(path)
    if given.is_symlink():
        target = given.resolve()
        cwd = Path.cwd().resolve()
        if not target.is_relative_to(cwd):
            raise OutputError(f"{flag} {path} is a symlink to {target}, outside the working tree {cwd}",
                              hint=f"give the directory itself: {flag} {target}")
    if given.exists() and not given.is_dir():
        raise OutputError(f"{flag} {path} is not a directory", hint="give a directory (it is created)")
    return given.resolve()


def _outside(out: Output, target: Path, read_dirs: tuple[PathLike, ...]) -> None:
    if _is_devnull(target):
        return
    for folder in read_dirs:
        inside = Path(folder).resolve()
        if target == inside or target.is_relative_to(inside):
            raise OutputError(f"{out.flag} {out.path} is inside {folder}, a checkpoint this command reads: writing "
                              f"there could replace what is being read",
                              hint=f"write {out.flag} outside {folder}")


def _same(a: Path, b: Path) -> bool:
    if _is_devnull(a) and _is_devnull(b):
        return False  # both discarded
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist yet: different names are different files
        return False


def _is_devnull(path: Path) -> bool:
    return str(path) == os.devnull


__all__ = ["Output", "check_outputs", "check_save_dir_path"]
