"""Small helpers of the plan's printed tables: byte counts, and rich tables of plain text."""

from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(n: int) -> str:
    """Binary units, one decimal: `512 B`, `1.5 MiB`, `-2.0 GiB`."""
    sign, value = ("-" if n < 0 else ""), float(abs(n))
    if value < 1024:
        return f"{sign}{int(value)} B"
    unit = 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{sign}{value:.1f} {_UNITS[unit]}"


def titled_table(title: str, *columns: str) -> Table:
    table = Table(title=Text(title), title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                  padding=(0, 1, 0, 0))
    for column in columns:
        table.add_column(column)
    return table


def text_row(table: Table, *cells: object) -> None:
    table.add_row(*(Text(str(cell)) for cell in cells))
