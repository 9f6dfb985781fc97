"""Replace one generated block of `benchmarks/RESULTS.md` (between its begin and end markers)."""

from __future__ import annotations

from pathlib import Path


def replace_block(path: Path, begin: str, end: str, text: str) -> None:
    """`text` between the markers `begin` and `end` of `path`, the rest of the file as it was."""
    old = path.read_text()
    if begin not in old or end not in old:
        raise SystemExit(f"{path} has no {begin} ... {end} block")
    head, rest = old.split(begin, 1)
    path.write_text(head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])
