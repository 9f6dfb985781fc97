"""`fivedc train --log`: a JSONL file this tool created, appended to and never anything else.

A new log's first line is the record `{"format": "fivedc-train-log", "version": 1}`;
each later line is one step's row (`{"step", "loss", ...}`). A log is appended to
only when it is new, empty, or starts with that record, or (written before the
record existed) with a JSON row that has a `"step"`: any other file (token data, a
model's source, someone's notes) is refused by `check_log_contents` (exit 2), before
any work starts. The file is opened at the first row (`LogFile`), so that a run that
fails before its first step leaves no empty log behind; it is opened without
following a symlink and without blocking (a FIFO put in its place is refused, not
waited on), and checked to be a regular file again.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from fivedc.files import OutputError

FORMAT, VERSION = "fivedc-train-log", 1
FIRST_LINE_LIMIT = 1 << 16  # a first line longer than this is not a fivedc record


def header() -> str:
    return json.dumps({"format": FORMAT, "version": VERSION}) + "\n"


def check_log_contents(target: Path, given: str, *, flag: str = "--log") -> None:
    """An existing log must be one fivedc wrote; a missing or empty one is fine."""
    try:
        with open(target, "rb") as file:
            first = file.readline(FIRST_LINE_LIMIT)
    except FileNotFoundError:
        return
    except OSError as error:
        raise OutputError(f"cannot read {flag} {given}: {error.strerror}", hint="choose another log file") from None
    if first and not _is_fivedc_record(first):
        raise OutputError(f"{flag} {given} exists and is not a fivedc training log (its first line is not "
                          f"fivedc's JSON record); appending would change it",
                          hint=f"give a new file, e.g. {flag} run.jsonl (fivedc creates it)")


def _is_fivedc_record(line: bytes) -> bool:
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(record, dict):
        return False
    return record.get("format") == FORMAT or "step" in record  # a row: a log from before the record


class LogFile:
    """The `--log` file, opened for appending at the first row; `target` is the file
    `check_outputs` checked (a symlink inside the tree already followed)."""

    def __init__(self, target: Path, given: str) -> None:
        self.target, self.given = target, given
        self._fd: int | None = None

    def write(self, row: dict) -> None:
        if self._fd is None:
            self._fd = self._open()
        _write_all(self._fd, json.dumps(row) + "\n")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _open(self) -> int:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(self.target, flags, 0o666)
        except OSError as error:
            raise OutputError(f"cannot open --log {self.given}: {error.strerror}",
                              hint="give a regular file, e.g. --log run.jsonl") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) and not _is_devnull(st):
            os.close(fd)
            raise OutputError(f"--log {self.given} is no longer a regular file", hint="give a regular file")
        if stat.S_ISREG(st.st_mode) and st.st_size == 0:
            _write_all(fd, header())
        return fd


def _is_devnull(st: os.stat_result) -> bool:
    null = os.stat(os.devnull)
    return (st.st_dev, st.st_ino) == (null.st_dev, null.st_ino)


def _write_all(fd: int, text: str) -> None:
    view = memoryview(text.encode())
    while view:
        view = view[os.write(fd, view):]


def rows_of(path: str | Path) -> list[dict]:
    """The step rows of a log (its records skipped)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [row for row in rows if "step" in row]


__all__ = ["FORMAT", "LogFile", "check_log_contents", "header", "rows_of"]
