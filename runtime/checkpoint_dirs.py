"""Where checkpoints are: a save directory's committed `step-N/` folders, and what to use instead of a damaged one.

A checkpoint is committed when its folder `step-N/` (eight digits) holds `index.json`
(`runtime/checkpoint.py` renames a finished `.tmp-step-N/` into place). `find_checkpoint`
takes a save directory (its latest) or one folder; `damaged_hint` names another
committed checkpoint of the same directory, never the damaged one.
"""

from __future__ import annotations

import re
from pathlib import Path

from fivedc.errors import FivedcError

INDEX = "index.json"
STEP_DIR = re.compile(r"step-(\d{8})")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def committed(root: str | Path) -> list[tuple[int, Path]]:
    """The committed checkpoints of a save directory (those with an index), by step."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := STEP_DIR.fullmatch(p.name)) and (p / INDEX).is_file()]
    return sorted(found)


def find_checkpoint(path: str | Path, *, flag: str = "--resume") -> Path:
    """A checkpoint folder, or a save directory's latest committed checkpoint."""
    path = Path(path)
    if (path / INDEX).is_file():
        return path
    found = committed(path)
    if not found:
        what = "does not exist" if not path.exists() else "holds no committed checkpoint (no step-N/index.json)"
        raise FivedcError(f"{flag} {path} {what}".lstrip(), hint="give a save directory written by fivedc train "
                          "--save-dir, or one of its step-N folders")
    return found[-1][1]


def damaged_hint(folder: Path) -> str:
    """What to do instead: another committed checkpoint of the same save directory, or a fresh run."""
    here = folder.resolve()
    others = [p for _, p in committed(folder.parent) if p.resolve() != here]
    if others:
        return f"it is damaged or not fivedc's: use --resume {others[-1]}, or train afresh"
    return "it is damaged or not fivedc's, and its directory holds no other checkpoint: train afresh"


__all__ = ["INDEX", "STEP_DIR", "committed", "damaged_hint", "find_checkpoint", "step_dir"]
