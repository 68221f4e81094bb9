"""``lbd bench balance``: rank the shedding strategies on the standard scenarios.

Each scenario (scale-up 5→10, scale-down 10→5, a namespace with 8x traffic, a diurnal swing, 100
brokers with a skew, brokers of three sizes, broker churn) runs in a load model in which moving a
bundle moves its load, brokers report every cycle into the EMA, and the cool-down, grace period
and hit counts apply as configured. Per scenario and strategy it prints the shedding cycles and
simulated minutes until the std of the brokers' actual load is under target, the final std, the
moves, the traffic moved, the ping-pongs (a bundle back on a broker it left within the hour) and
the most moves one broker took in one cycle. No server is needed; the figures are the same for a
seed on every machine.

With ``--generated N``, every strategy runs instead on N clusters drawn from seeds (3 to 200
brokers of mixed sizes, log-normal or Zipf traffic, joins, leaves, restarts and moving hot spots:
lbd/workload/generator.py), and the table is the distribution per strategy: the share of
clusters brought under target, and within three cycles of each disturbance, the cycles, moves
and final std at the 50th, 90th and 99th percentile. Then the clusters on which cluster_planner
misses its goals (under target within three cycles, never more moves than transfer_shedder,
never a ping-pong), each with its seed and, with ``--shrink``, the fewest disturbances that still
show the miss. With ``--spikes`` as well, each generated cluster is placed evenly and left to
rest, then one namespace's traffic is multiplied for one, two and three cycles: a spike, which
no strategy should answer with a move (Pulsar's hit count of 3 waits out three cycles); the
table counts, per strategy, the clusters at rest on which a spike of each length made it move.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from lbd.core.errors import InvalidInputError
from lbd.core.settings import SheddingConfig
from lbd.core.shedding import STRATEGIES
from lbd.workload.generator import (
    DISTRIBUTION_COLUMNS,
    PLANNER,
    SPIKE_AT,
    SPIKE_COLUMNS,
    SPIKE_LENGTHS,
    Judged,
    distribution,
    evaluate,
    generate,
    judge_all,
    judge_spikes,
    misses,
    shrink,
    spike_table,
)
from lbd.workload.scenarios import SCENARIOS
from lbd.workload.suite import SUITE_TARGET_STD, markdown, run_suite, suite_config, table


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lbd bench balance``."""
    group = sub.add_parser("bench", help="benchmarks that need no server", description=__doc__)
    verbs = group.add_subparsers(dest="bench_command", metavar="VERB", required=True)
    p = verbs.add_parser(
        "balance", help="rank the shedding strategies on standard scenarios", description=__doc__
    )
    p.add_argument(
        "--scenario",
        action="append",
        choices=sorted(SCENARIOS),
        help="run only this scenario (repeatable; default: all)",
    )
    p.add_argument(
        "--strategy",
        action="append",
        choices=sorted(STRATEGIES),
        help="run only this strategy (repeatable; default: all)",
    )
    p.add_argument(
        "--target-std",
        type=float,
        default=SUITE_TARGET_STD,
        help=f"the target std of every run (default {SUITE_TARGET_STD:g})",
    )
    p.add_argument("--seed", type=int, default=1, help="the seed (the first one with --generated)")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.add_argument(
        "--generated",
        type=int,
        default=0,
        metavar="N",
        help="run on N generated clusters (seeds SEED..SEED+N-1) instead of the scenarios",
    )
    p.add_argument("--jobs", type=int, default=0, help="worker processes (default: one per core)")
    p.add_argument(
        "--shrink",
        type=int,
        default=0,
        metavar="K",
        help="shrink the first K clusters on which cluster_planner misses its goals",
    )
    p.add_argument(
        "--spikes",
        action="store_true",
        help="with --generated: spike each cluster at rest instead (one namespace's traffic "
        "multiplied for 1, 2 and 3 cycles) and count the moves each strategy makes on it",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the chosen scenarios under the chosen strategies and print the table."""
    try:
        config = suite_config(target_std=args.target_std)
    except InvalidInputError as e:
        raise InvalidInputError(f"--target-std: {e}") from None
    strategies = args.strategy or list(STRATEGIES)
    if args.generated < 0 or args.jobs < 0 or args.shrink < 0:
        raise InvalidInputError("--generated, --jobs and --shrink must be >= 0")
    if args.generated:
        if args.spikes:
            if args.shrink:
                raise InvalidInputError("--shrink does not go with --spikes")
            return _spikes(args, strategies, config)
        return _generated(args, strategies, config)
    if args.shrink or args.jobs or args.spikes:
        raise InvalidInputError("--jobs, --shrink and --spikes go with --generated")
    scenarios = args.scenario or list(SCENARIOS)
    console = Console()
    with console.status(f"{len(scenarios)} scenario(s) x {len(strategies)} strategies..."):
        results = run_suite(scenarios, strategies, config, seed=args.seed)
    if args.markdown:
        print(markdown(results))
    else:
        console.print(table(results, config.target_std))
    return 0


T = TypeVar("T")
_SPAWN = multiprocessing.get_context("spawn")
"""Workers are spawned, not forked: the progress display runs a thread."""


def _over_seeds(
    args: argparse.Namespace, work: Callable[[int], list[T]], what: str
) -> tuple[range, list[T]]:
    """``work`` over the ``--generated`` seeds in a process pool, with a progress bar."""
    if args.scenario:
        raise InvalidInputError("--scenario does not go with --generated")
    seeds = range(args.seed, args.seed + args.generated)
    done: list[T] = []
    with (
        ProcessPoolExecutor(args.jobs or os.cpu_count() or 1, mp_context=_SPAWN) as pool,
        Progress(console=Console(stderr=True), transient=True) as progress,
    ):
        task = progress.add_task(f"{len(seeds)} {what}", total=len(seeds))
        for one in pool.map(work, seeds, chunksize=4):
            done.extend(one)
            progress.advance(task)
    return seeds, done


def _print_table(
    args: argparse.Namespace, title: str, columns: Sequence[str], rows: list[tuple[str, ...]]
) -> None:
    if args.markdown:
        print(f"{title}\n")
        print("| " + " | ".join(columns) + " |")
        print("|---|" + "---:|" * (len(columns) - 1))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        table = Table(title=title)
        for i, column in enumerate(columns):
            table.add_column(column, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        Console().print(table)


def _spikes(args: argparse.Namespace, strategies: list[str], config: SheddingConfig) -> int:
    """The strategies on ``--generated`` clusters at rest, spiked: the moves each made."""
    work = functools.partial(judge_spikes, strategies=strategies, config=config)
    seeds, spikes = _over_seeds(args, work, "generated clusters, spiked")
    title = (
        f"{len(seeds)} generated clusters, seeds {seeds[0]}..{seeds[-1]}, placed evenly and "
        f"spiked after {SPIKE_AT} cycles (target std {config.target_std:g}, hit count "
        f"{config.hit_count_threshold}): clusters on which a spike made the strategy move"
    )
    _print_table(args, title, SPIKE_COLUMNS, spike_table(spikes, strategies))
    moved = [s for s in spikes if s.at_rest and any(m > 0 for m in s.moves)]
    for s in moved:
        counts = ", ".join(
            f"{m} on {n} cycle(s)" for n, m in zip(SPIKE_LENGTHS, s.moves, strict=True) if m > 0
        )
        print(f"  seed {s.seed}: {s.strategy} moved {counts} ({s.spike})")
    return 0


def _generated(args: argparse.Namespace, strategies: list[str], config: SheddingConfig) -> int:
    """The strategies on ``--generated`` clusters: the distribution table, then the misses."""
    work = functools.partial(judge_all, strategies=strategies, config=config)
    seeds, judged = _over_seeds(args, work, "generated clusters")
    title = (
        f"{len(seeds)} generated clusters, seeds {seeds[0]}..{seeds[-1]} "
        f"(target std {config.target_std:g}, or what the cluster can reach)"
    )
    _print_table(args, title, DISTRIBUTION_COLUMNS, distribution(judged, strategies))
    by_seed: dict[int, list[Judged]] = {}
    for j in judged:
        by_seed.setdefault(j.seed, []).append(j)
    missed = {seed: why for seed, runs in sorted(by_seed.items()) if (why := misses(runs))}
    if PLANNER in strategies:
        print(f"\n{PLANNER} misses its goals on {len(missed)} of {len(seeds)} clusters")
        for n, (seed, why) in enumerate(missed.items()):
            runs = by_seed[seed]
            print(
                f"  seed {seed}: {'; '.join(why)} ({runs[0].brokers} brokers, "
                f"{runs[0].bundles} bundles; {', '.join(runs[0].kinds)})"
            )
            if n < args.shrink:
                small = shrink(
                    generate(seed, config.target_std),
                    lambda g: bool(misses([evaluate(g, s, config) for s in strategies])),
                )
                print(f"    shrunk to: {', '.join(small.kinds)}")
    return 0
