"""``lbd demo``: the core balancing a simulated cluster, drawn live in the terminal.

The pure core alone, with no server: a scale-up from two brokers to five, then a hot namespace,
with the default strategy (or another one) moving bundles through the state channel's resolver
until the load's standard deviation is back under target. Two spreads are shown: ``std``, of the
load EMA the shedder acts on, and ``carried_std``, of the load the brokers carry (what clients
feel; the EMA follows it a few cycles late). ``make run`` runs a real cluster.
"""

from __future__ import annotations

import argparse
import json
import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from lbd.core.errors import InvalidInputError
from lbd.core.shedding import DEFAULT_STRATEGY, STRATEGIES
from lbd.workload.demo import CoreCluster, CycleReport, SimSpec


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lbd demo``."""
    p = sub.add_parser(
        "demo",
        help="watch the balancer converge a simulated cluster (no servers needed)",
        description=__doc__,
    )
    p.add_argument("--brokers", type=int, default=5, help="brokers once all have joined")
    p.add_argument("--initial-brokers", type=int, default=2, help="brokers up at the start")
    p.add_argument("--namespaces", type=int, default=4)
    p.add_argument("--bundles", type=int, default=8, help="bundles per namespace")
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default=DEFAULT_STRATEGY)
    p.add_argument("--cycles", type=int, default=0, help="stop after this many (0: until Ctrl-C)")
    p.add_argument("--interval", type=float, default=0.4, help="seconds between drawn cycles")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--output",
        choices=("live", "json"),
        default="live",
        help="live: a redrawn table; json: one JSON object per cycle, no delay",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Simulate and draw (or print) cycles until done or interrupted."""
    if args.cycles < 0:
        raise InvalidInputError(f"--cycles must be >= 0, got {args.cycles}")
    if args.output == "json" and args.cycles == 0:
        raise InvalidInputError("--output json needs --cycles N (it does not run forever)")
    try:
        spec = SimSpec(
            brokers=args.brokers,
            initial_brokers=args.initial_brokers,
            namespaces=args.namespaces,
            bundles_per_namespace=args.bundles,
            strategy=args.strategy,
            seed=args.seed,
        )
        cluster = CoreCluster(spec)
    except ValueError as e:
        raise InvalidInputError(str(e)) from e
    if args.output == "json":
        for _ in range(args.cycles):
            print(json.dumps(_as_json(cluster.step())))
        return 0
    console = Console()
    log: list[str] = []
    with Live(console=console, auto_refresh=False) as live:
        cycle = 0
        while args.cycles == 0 or cycle < args.cycles:
            report = cluster.step()
            cycle = report.cycle
            log.extend(f"cycle {cycle}: {e}" for e in report.events)
            log.extend(
                f"cycle {cycle}: {d.reason} {d.bundle} {d.src} -> {d.dst or '(any)'}"
                for d in report.decisions
            )
            live.update(_render(report, spec, log[-8:]), refresh=True)
            time.sleep(args.interval)
    return 0


def _as_json(report: CycleReport) -> dict[str, object]:
    return {
        "cycle": report.cycle,
        "avg": report.avg,
        "std": report.std,
        "carried_std": report.carried_std,
        "skip_reason": report.skip_reason,
        "notes": list(report.notes),
        "events": list(report.events),
        "decisions": [
            {"bundle": d.bundle, "src": d.src, "dst": d.dst, "reason": str(d.reason)}
            for d in report.decisions
        ],
        "brokers": {
            r.broker: {
                "bundles": r.bundles,
                "load": r.load,
                "carried": r.carried,
                "throughput_mb": r.throughput_mb,
            }
            for r in report.brokers
        },
        "moves_total": report.moves_total,
    }


def _render(report: CycleReport, spec: SimSpec, log: list[str]) -> Group:
    target = spec.shedding.target_std
    table = Table(
        title=f"cycle {report.cycle} · {report.cycle * spec.step_s // 60} simulated min · "
        f"strategy {spec.strategy}",
        caption="Ctrl-C to stop",
    )
    table.add_column("broker")
    table.add_column("bundles", justify="right")
    table.add_column("MB/s", justify="right")
    table.add_column("load (EMA)", justify="right")
    table.add_column("carried", justify="right")
    table.add_column("")
    for row in report.brokers:
        bar = "█" * round(min(row.load, 1.0) * 30)
        style = "red" if row.load >= spec.shedding.overloaded_threshold else "green"
        table.add_row(
            row.broker,
            str(row.bundles),
            f"{row.throughput_mb:.1f}",
            f"{row.load:.2f}",
            f"{row.carried:.2f}",
            Text(bar, style=style),
        )
    std_style = "green" if report.std <= target else "yellow"
    carried_style = "green" if report.carried_std <= target else "yellow"
    summary = Text.assemble(
        f"avg {report.avg:.3f}   ",
        (f"std {report.std:.3f}", std_style),
        " of the EMA, ",
        (f"{report.carried_std:.3f}", carried_style),
        f" carried (target {target})   moves {report.moves_total}   ",
        f"last cycle: {len(report.decisions)} decision(s)"
        + (f", skipped: {report.skip_reason}" if report.skip_reason else ""),
    )
    return Group(table, summary, Text("\n".join(log), style="dim"))
