"""One exception root for every error a user can cause, each with a source location.

`FivedcError.render()` prints `file:line:col: error: message`, the offending source
line and a caret under the column, then a hint with the fix. The CLI catches
`FivedcError` at the top and exits with `exit_code` and no Python traceback.
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

    def render(self) -> str:
        head = f"{self.loc}: error: {self.message}" if self.loc else f"error: {self.message}"
        lines = [head]
        if self.loc is not None and self.loc.text:
            lines.append("    " + self.loc.text.rstrip("\n"))
            lines.append("    " + " " * max(self.loc.col - 1, 0) + "^")
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


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

    def render(self) -> str:
        import textwrap

        return "\n".join(textwrap.fill(line, width=100, subsequent_indent="  ", break_long_words=False,
                                        break_on_hyphens=False) for line in FivedcError.render(self).splitlines())


class NonFiniteError(FivedcError):
    """Training reached a NaN or infinite loss or gradient norm: nothing of it is saved."""

    exit_code = 1


class PassError(FivedcError):
    """A compiler pass failed on a valid-looking graph: a bug in fivedc, reported with context."""

    exit_code = 4


class VerifyMismatch(FivedcError):
    """The parallel run and the single-device run disagree."""

    exit_code = 1
