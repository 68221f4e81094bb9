"""Failover with lbd's default settings: a broker with 10, 1,000 or 10,000 bundles is killed.

``python -m bench.failover_bench [--sizes 10,1000,10000]`` runs, for each size, the recovery
benchmark's kill (:mod:`bench.recovery_bench`: a 3-broker cluster of simulated brokers, one of
them given every bundle, its sidecar and broker killed with SIGKILL) on a cluster whose sidecars
keep every default setting, and prints, per size, when the bundles were announced, handed over
and all Owned by a live broker again, counted from the kill.

The defaults fix the waits (docs/safety.md, "How long a failover takes"): the lease TTL (3 s)
less up to a keepalive interval, the orphan grace (1.5 s), then the hand-over wait (4.5 s); the
rest is the writes. Each size's time to all Owned is set against the goals of the failover work:
within 10 s for a few bundles and within 15 s for 10,000, beside Apache Pulsar's 30 s (its
metadata session timeout, after which the extensible load manager notices a dead broker) and
Kafka KRaft's 9 s (``broker.session.timeout.ms``). With real clients, the longest producer stall
and the failed sends of a failover are in the clients suite (``python -m bench.clients_bench
--defaults --events kill_sidecar,kill_leader``).
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from bench import recovery_bench
from bench.report import Figure, figures_table

SIZES = (10, 1_000, 10_000)
PULSAR_S = 30.0
"""Apache Pulsar: its metadata store session timeout, after which a dead broker is noticed."""
KRAFT_S = 9.0
"""Kafka KRaft: ``broker.session.timeout.ms``, after which a silent broker is fenced."""
GOAL_S = 10.0
GOAL_10K_S = 15.0
LARGE = 10_000


def run(sizes: tuple[int, ...] = SIZES) -> dict[int, dict[str, float]]:
    """Each size's recovery timeline with the default settings."""
    return {n: recovery_bench.run(bundles=n, defaults=True) for n in sizes}


def table(results: dict[int, dict[str, float]]) -> Table:
    """One row per size: seconds after the kill of each phase, beside Pulsar's and KRaft's."""
    out = Table(title="failover with the default settings: seconds after kill -9")
    for column in (
        "bundles",
        "first announced",
        "first handed over",
        "all Owned again",
        "hand-over to all Owned",
        "Pulsar ELM",
        "KRaft",
    ):
        out.add_column(column, justify="right")
    for n, result in results.items():
        out.add_row(
            f"{n:,}",
            _s(result.get("first announcement (s after kill)")),
            _s(result.get("first hand-over (s after kill)")),
            _s(result.get("all Owned again (s after kill)")),
            _s(result.get("first hand-over to all Owned (s)")),
            f"{PULSAR_S:g} (detection)",
            f"{KRAFT_S:g} (fencing)",
        )
    return out


def figures(results: dict[int, dict[str, float]]) -> list[Figure]:
    """Each size's time to all Owned against its goal."""
    out = []
    for n, result in results.items():
        owned = result.get("all Owned again (s after kill)")
        if owned is None:
            continue
        goal = GOAL_10K_S if n >= LARGE else GOAL_S
        out.append(
            Figure(f"kill -9, {n:,} bundles: all Owned again", owned, "s", goal, "goal", "<= 1")
        )
    return out


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.failover_bench", description=__doc__)
    parser.add_argument(
        "--sizes",
        default=",".join(str(n) for n in SIZES),
        help="comma-separated numbers of bundles on the killed broker",
    )
    args = parser.parse_args()
    try:
        sizes = tuple(int(n) for n in args.sizes.split(","))
    except ValueError:
        parser.error(f"--sizes takes comma-separated whole numbers, got {args.sizes!r}")
    if any(n < 1 for n in sizes):
        parser.error(f"--sizes must all be >= 1, got {args.sizes!r}")
    results = run(sizes)
    console = Console()
    console.print(table(results))
    console.print(figures_table("failover: the goals", figures(results)))


if __name__ == "__main__":
    main()
