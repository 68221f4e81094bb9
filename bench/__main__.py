"""``python -m bench [--quick]``: run the benchmarks and print one table."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from bench import core


def main() -> None:
    """Run every suite, then print a row per measurement."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller inputs (smoke run)")
    args = parser.parse_args()
    console = Console()
    table = Table(title="lbd benchmarks")
    table.add_column("benchmark")
    table.add_column("ops", justify="right")
    table.add_column("seconds", justify="right")
    table.add_column("rate", justify="right")
    with console.status("running benchmarks..."):
        for r in core.run(quick=args.quick):
            table.add_row(r.name, f"{r.ops:,}", f"{r.seconds:.3f}", f"{r.rate:,.0f} {r.unit}/s")
    console.print(table)


if __name__ == "__main__":
    main()
