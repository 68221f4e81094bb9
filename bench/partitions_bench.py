"""Benchmark: network partitions of a dev cluster under real client traffic.

``python -m bench.partitions_bench [--scale F] [--only NAME] [--keep DIR]`` starts a 3-broker dev
cluster with every link behind a proxy (``lbd dev up --links``), runs producers and consumers of
the official client on topics spread over every broker, and goes through each scenario of
:data:`lbd.devcluster.partitions.SCENARIOS` in turn: a sidecar cut from etcd only and from the
channel only for 60 s, a broker cut from its sidecar for 30 s, the leader cut from the channel,
a host split from the servers, and flaky links. One row per scenario: failed sends, lost and
duplicated messages, the longest send latency, bundles moved, and the time from the links'
return until every bundle was Owned by a registered broker with every sidecar listing every
broker; then the brokers' event logs judged whole (dual serving, writes outside serving, storage
order). ``--scale`` shortens every scenario (``0.5``: 30 s cuts become 15 s).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.clients_bench import QUIET, create_namespace, traffic_spec
from bench.report import Figure
from lbd.devcluster.cluster import DevClusterSpec, down, up
from lbd.devcluster.disruptions import ClientHarness, EventFigures, SafetyFigures
from lbd.devcluster.partitions import SCENARIOS, Partition
from lbd.devcluster.partitions import run as run_partition


@dataclass(frozen=True, slots=True)
class PartitionsResult:
    events: list[EventFigures]
    safety: SafetyFigures
    scale: float


def run(
    *,
    scenarios: Sequence[Partition] = SCENARIOS,
    scale: float = 1.0,
    keep: Path | None = None,
) -> PartitionsResult:
    """Start a dev cluster with links, run the scenarios under client traffic, stop it."""
    spec = DevClusterSpec(brokers=3, links=True).with_overrides(list(QUIET))
    with contextlib.ExitStack() as stack:
        state_dir = keep or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="lbd-bench-"))
        )
        cluster = up(state_dir, spec)
        harness = None
        try:
            create_namespace(cluster)
            harness = ClientHarness(cluster, traffic_spec(cluster))
            harness.start()
            for scenario in scenarios:
                run_partition(harness, scenario, scale=scale)
            events, safety = harness.finish()
        finally:
            down(state_dir)
            if harness is not None:
                harness.close()
    return PartitionsResult(events, safety, scale)


COLUMNS = (
    "scenario",
    "failed",
    "lost",
    "dup (stored twice)",
    "max send ms",
    "longest gap ms",
    "whole again s",
    "",
)


def table(result: PartitionsResult) -> Table:
    """One row per scenario; the logs' verdict as the caption."""
    title = "network partitions under real clients (dev cluster, lbd's default timings)"
    if result.scale != 1.0:
        title += f", durations x{result.scale:g}"
    out = Table(title=title)
    for column in COLUMNS:
        out.add_column(column, justify="left" if column in ("scenario", "") else "right")
    for e in result.events:
        c = e.summary
        out.add_row(
            e.name,
            str(c.failed),
            str(c.lost),
            f"{c.duplicates} ({c.stored_twice})",
            f"{c.latency_max_ms:.0f}",
            f"{c.longest_gap_ms:.0f}",
            "-" if e.recovery_s is None else f"{e.recovery_s:.1f}",
            e.note,
        )
    out.caption = result.safety.line()
    return out


def figures(result: PartitionsResult) -> list[Figure]:
    """The issue's goals: none dual-served, none lost, every partition healed within 30 s."""
    s = result.safety
    lost = sum(e.summary.lost for e in result.events)
    healed = max((e.recovery_s or 0.0) for e in result.events) if result.events else 0.0
    return [
        Figure(
            "partitions: dual-served intervals",
            float(len(s.dual_served)),
            "",
            1.0,
            "goal: none",
            "<= 0",
        ),
        Figure(
            "partitions: acknowledged messages lost", float(lost), "", 1.0, "goal: none", "<= 0"
        ),
        Figure(
            "partitions: whole again after the links return (worst)",
            healed,
            "s",
            30.0,
            "goal",
            "<= 1",
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.partitions_bench")
    parser.add_argument("--scale", type=float, default=1.0, help="shorten every scenario")
    parser.add_argument(
        "--only", action="append", choices=[s.name for s in SCENARIOS], help="these scenarios"
    )
    parser.add_argument("--keep", type=Path, help="keep the cluster's state dir here")
    args = parser.parse_args(argv)
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only]
    result = run(scenarios=chosen, scale=args.scale, keep=args.keep)
    Console(width=max(Console().width, 160)).print(table(result))


if __name__ == "__main__":
    main()
