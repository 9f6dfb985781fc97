"""One exception root for every error a user can cause, each with a source location.

`FivedcError.render()` prints `file:line:col: error: message`, the offending source
line and a caret under the column, then a hint with the fix. The CLI catches
`FivedcError` at the top, prints it wrapped to its width (`render(width=...)`: lines
broken at spaces only, so a path or a location stays whole; a long source line shown
around the caret) and exits with `exit_code` and no Python traceback.
Nothing below the CLI prints or exits.

Exit codes (EXIT_CODES; `fivedc --help` and the README list them): 0 ok, 1 a
numerical mismatch, 2 bad input, 3 a rank crashed or timed out, 4 an internal
error (a bug in fivedc).
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXIT_CODES = {
    0: "ok",
    1: "numerical mismatch: the parallel run differs from the single-device run",
    2: "bad input: the model, the mesh, a flag or a plan file (the message says where)",
    3: "a rank crashed or timed out",
    4: "internal error: a bug in fivedc",
}


@dataclass(frozen=True, slots=True)
class SourceLoc:
    """Where an IR node came from: a DSL position, or a user's Python file and line."""

    file: str
    line: int
    col: int
    text: str = field(default="", compare=False)  # the source line, for the caret; not serialised

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"

    @staticmethod
    def parse(text: str) -> SourceLoc | None:
        """Inverse of `str()`, for locations read back from a plan."""
        if not text:
            return None
        file, _, rest = text.rpartition(":")
        file, _, line = file.rpartition(":")
        try:
            return SourceLoc(file, int(line), int(rest))
        except ValueError:
            return None


class FivedcError(Exception):
    """Root of every error fivedc raises on purpose."""

    exit_code = 2

    def __init__(self, message: str, *, loc: SourceLoc | None = None, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.loc = loc
        self.hint = hint

    def render(self, *, width: int | None = None) -> str:
        """`file:line:col: error: message`, the source line with a caret, `hint: ...`; with
        `width`, every line fits it (`fit`), but for a word longer than the line."""
        loc = str(self.loc).replace(" ", _KEEP) if self.loc else ""  # a path with spaces stays whole
        head = f"{loc}: error: {self.message}" if self.loc else f"error: {self.message}"
        lines = [fit(head, width).replace(_KEEP, " ") if width else head]
        if self.loc is not None and self.loc.text:
            lines += _source_lines(self.loc.text.rstrip("\n"), self.loc.col, width)
        if self.hint:
            lines.append(fit(f"hint: {self.hint}", width) if width else f"hint: {self.hint}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


_KEEP = "\x00"  # stands for a space that must not break a line


def fit(text: str, width: int | None) -> str:
    """`text` wrapped to `width` columns, line by line: continuation lines indented two more
    than their line, words (paths, `file:line:col`) never broken, so a word longer than the
    line stays whole; no wrapping without a width."""
    import textwrap

    if not width:
        return text
    out = []
    for line in text.split("\n"):
        lead = line[:len(line) - len(line.lstrip())]
        out.append(textwrap.fill(line.strip(), width=width, initial_indent=lead, subsequent_indent=lead + "  ",
                                 break_long_words=False, break_on_hyphens=False) or lead.rstrip())
    return "\n".join(out)


def _source_lines(text: str, col: int, width: int | None) -> list[str]:
    """The source line and a caret under `col`, 4 columns in; a line too long for `width`
    shows the part around the caret, `...` where it is cut."""
    room = (width or 0) - 4
    start, left, right = 0, "", ""
    if width and len(text) > room:
        keep = max(room - 6, 1)
        start = max(0, min(col - 1 - keep // 2, len(text) - keep))
        left, right = ("..." if start > 0 else ""), ("..." if start + keep < len(text) else "")
        text = text[start:start + keep]
    return ["    " + (left + text + right).rstrip(), "    " + " " * (len(left) + max(col - 1 - start, 0)) + "^"]


class DslError(FivedcError):
    """The model text does not parse, or names something that does not exist."""


class ShapeError(FivedcError):
    """Tensor dims do not agree, or a dim is not divisible by the axis that splits it."""


class MeshError(FivedcError):
    """A mesh string that does not parse, or a world size that does not match."""


class ShardingError(FivedcError):
    """An annotation that cannot hold, or two that conflict."""


class NotSupportedError(FivedcError):
    """A valid request that this version of fivedc does not implement yet."""


class PlanError(FivedcError):
    """A plan file that cannot be read: wrong version, not JSON, missing fields."""


class CheckpointError(FivedcError):
    """A checkpoint that must not be read: a field of the wrong type, a piece outside its
    folder, a shard whose bytes changed. Its hint names another checkpoint, never itself.
    Its message quotes paths and fields, so it is wrapped at 100 columns."""

    def render(self, *, width: int | None = 100) -> str:
        return FivedcError.render(self, width=width)


class NonFiniteError(FivedcError):
    """Training reached a NaN or infinite loss or gradient norm: nothing of it is saved."""

    exit_code = 1


class PassError(FivedcError):
    """A compiler pass failed on a valid-looking graph: a bug in fivedc, reported with context."""

    exit_code = 4


class VerifyMismatch(FivedcError):
    """The parallel run and the single-device run disagree."""

    exit_code = 1
