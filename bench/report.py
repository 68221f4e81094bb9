"""How the benchmark suites print what they measured."""

from __future__ import annotations

from rich.table import Table


def measurements_table(title: str, result: dict[str, float]) -> Table:
    """One row per measurement, values with thousands separators."""
    table = Table(title=title)
    table.add_column("measurement")
    table.add_column("value", justify="right")
    for name, value in result.items():
        table.add_row(name, f"{value:,.2f}")
    return table
