"""`fivedc diff`'s report of a `PlanDiff` (`fivedc/plan/diff.py`): a line per change, marked `+`
added, `-` removed, `~` changed, wrapped at the console's width under its item."""

from __future__ import annotations

import textwrap

from rich.console import Console
from rich.text import Text

from fivedc.plan.diff import MARK, PlanDiff
from fivedc.plan.summary import format_bytes


def _onoff(value: object) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def _pair(pair: tuple, fmt=str) -> str:
    x, y = pair
    if x is None:
        return fmt(y)
    if y is None or x == y:
        return fmt(x)
    return f"{fmt(x)} -> {fmt(y)}"


def _lines(d: PlanDiff) -> list[str]:
    lines: list[str] = []
    if d.mesh:
        lines.append("mesh: " + ", ".join(f"{v.name} {v.a} -> {v.b}" for v in d.mesh))
    if d.options:
        lines.append("options: " + ", ".join(f"{v.name.replace('_', ' ')} {_onoff(v.a)} -> {_onoff(v.b)}"
                                             for v in d.options))
    if d.groups:
        lines.append("groups:")
        for g in d.groups:
            lines.append(f"  {MARK[g.change]} {g.axes}: size {_pair(g.size)}, count {_pair(g.count)}, "
                         f"strides {_pair(g.strides, lambda s: ','.join(map(str, s)))}")
    if d.params:
        lines.append("parameters:")
        for p in d.params:
            lines.append(f"  {MARK[p.change]} {p.name}: {_pair(p.sharding)} "
                         f"(grad reduced over {_pair(p.grad_reduced_over)})")
    if d.collectives:
        lines.append("collectives (bytes per execution x count per step):")
        for c in d.collectives:
            dim = f" along {c.dim}" if c.dim else ""
            beside = f"; overlaps {_pair(c.overlaps, lambda o: o or 'nothing')}" if c.change == "overlapped" else ""
            lines.append(f"  {MARK[c.change]} {c.phase} {c.kind} over {c.axes} of {c.tensor}{dim}: "
                         f"{_pair(c.bytes, format_bytes)} x {_pair(c.count)}{beside}")
    if d.bytes_per_step:
        lines.append("bytes per step: " + ", ".join(
            f"{t.name} {format_bytes(t.a)} -> {format_bytes(t.b)}" for t in d.bytes_per_step))
    if d.replicated:
        lines.append("replicated ops (no sharding rule, computed whole on every rank):")
        for r in d.replicated:
            lines.append(f"  {MARK[r.change]} {r.target} at {r.at}: {r.reason}")
    if d.memory:
        lines.append("memory per rank:")
        for t in d.memory:
            ratio = f" (x{t.ratio:.2f})" if t.ratio is not None else ""
            lines.append(f"  ~ {t.name}: {format_bytes(t.a)} -> {format_bytes(t.b)}{ratio}")
    return lines


def render_diff(d: PlanDiff, *, console: Console) -> None:
    """Print the report; `plans are identical` when nothing changed. A line longer than the
    console wraps at spaces, indented under its item."""
    for line in _lines(d) or ["plans are identical"]:
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        console.print(Text(textwrap.fill(line, width=console.width, subsequent_indent=indent, break_long_words=False,
                                         break_on_hyphens=False)), soft_wrap=True)
