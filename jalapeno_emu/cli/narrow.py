"""Tables on a narrow terminal: a table that cannot fit its words is printed one record per row.

rich shrinks a table that is wider than the console by wrapping cells at spaces and then cutting
every word that is still too long with an ellipsis, headers and numbers alike (``tok/s…``,
``7,686…``): on an 80-column terminal the serving table of nine columns read as nothing. A table
whose narrowest honest layout (every word whole) exceeds the console's width is therefore shown
as records instead: per row, its cells under the column headers, one per line, which fits any
width a person reads on. Tables that fit are printed as they are.
"""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

__all__ = ["fit_table", "needed_width"]

_UNBOUNDED = 1_000_000
"""Measure against this width: rich clamps a measurement to the console's width otherwise."""


def needed_width(table: Table, console: Console) -> int:
    """Columns ``table`` needs with every word of its headers and cells whole (wrapping only at
    spaces): rich's minimum width, measured as if the console were unbounded."""
    return Measurement.get(console, console.options.update(max_width=_UNBOUNDED), table).minimum


def _plain(cell: RenderableType) -> RenderableType:
    return Text(cell) if isinstance(cell, str) else cell


def fit_table(table: Table, console: Console) -> RenderableType:
    """``table`` itself when it fits ``console`` with whole words; otherwise one two-column
    record (header, value) per row, titled like the table, which folds only what no width holds.

    Args:
        table: a rich Table as a command builds it (headers and cells as strings or Text).
        console: where it will be printed (its ``width`` in columns).
    """
    if not table.columns or needed_width(table, console) <= console.width:
        return table
    headers = [Text.from_markup(c.header) if isinstance(c.header, str) else c.header for c in table.columns]
    n_rows = max((len(c._cells) for c in table.columns), default=0)
    records: list[RenderableType] = []
    if table.title is not None:
        records.append(Text.from_markup(table.title) if isinstance(table.title, str) else table.title)
    for r in range(n_rows):
        record = Table(show_header=False, box=None, padding=(0, 1), title=None)
        record.add_column(style="bold", no_wrap=False, overflow="fold")
        record.add_column(overflow="fold")
        for header, column in zip(headers, table.columns, strict=True):
            cell = column._cells[r] if r < len(column._cells) else ""
            record.add_row(header, _plain(cell))
        if r:
            records.append(Text(""))
        records.append(record)
    if table.caption is not None:
        records.append(Text.from_markup(table.caption) if isinstance(table.caption, str) else table.caption)
    return Group(*records)
