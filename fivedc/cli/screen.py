"""What a command prints: its width, wrapped lines, and rich tables without trailing spaces.

Every command's output fits `MAX_COLUMNS` (100) by default, or the terminal when it is
narrower; `--wide` (compile, show, diff, search) lets a table take `WIDE_COLUMNS` or the
terminal's width. `say` prints a paragraph wrapped to that width (a word longer than the
line, such as a long path, stays whole so that it can be pasted), and `console` gives a rich
console whose lines lose the padding rich puts after a table's last column.
"""

from __future__ import annotations

import shutil
import sys
import textwrap

MAX_COLUMNS = 100  # the most a command prints by default
WIDE_COLUMNS = 140  # at least this with --wide


def columns(*, wide: bool = False, piped: int = MAX_COLUMNS) -> int:
    """The width to print at: the terminal's (`piped` when there is none), at most 100 unless
    `wide`, and then at least 140."""
    terminal = shutil.get_terminal_size((piped, 24)).columns
    return max(terminal, WIDE_COLUMNS) if wide else min(terminal, MAX_COLUMNS)


def wrap(text: str, *, width: int | None = None, indent: str = "") -> str:
    """`text` wrapped to `width` (default `columns()`), continuation lines indented by `indent`;
    words are never broken. Lines of `text` are wrapped one by one."""
    width = width or columns()
    return "\n".join(textwrap.fill(line, width=width, subsequent_indent=indent, break_long_words=False,
                                   break_on_hyphens=False) for line in text.split("\n"))


def say(text: str, *, indent: str = "    ", width: int | None = None, **print_kw) -> None:
    """Print `text` wrapped to the command's width (continuation lines indented)."""
    print(wrap(text, width=width, indent=indent), **print_kw)


def command_line(text: str, *, width: int | None = None) -> str:
    """A shell command (after any label) broken at spaces into lines of at most `width`
    columns, each but the last ending in ` \\`: pasted, the shell reads one command."""
    width = (width or columns()) - 2
    lines = textwrap.wrap(text, width=width, subsequent_indent="    ", break_long_words=False,
                          break_on_hyphens=False)
    return " \\\n".join(lines)


class _StripLines:
    """A text stream that writes whole lines to sys.stdout (looked up at each write, so
    redirected output follows), each without trailing spaces."""

    def __init__(self) -> None:
        self._pending = ""

    def write(self, text: str) -> int:
        lines = (self._pending + text).split("\n")
        self._pending = lines.pop()
        if lines:
            sys.stdout.write("".join(line.rstrip() + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:  # a line still open stays until its end (rich ends what it prints with one)
        sys.stdout.flush()

    def isatty(self) -> bool:  # plain text: no colour codes, the same on a terminal and in a pipe
        return False

    @property
    def encoding(self) -> str:
        return getattr(sys.stdout, "encoding", None) or "utf-8"


def console(*, wide: bool = False, piped: int = MAX_COLUMNS):
    """A rich console of `columns(wide=wide, piped=piped)` columns that prints plain text with
    no trailing spaces."""
    from rich.console import Console

    return Console(file=_StripLines(), width=columns(wide=wide, piped=piped), no_color=True,
                   highlight=False)
