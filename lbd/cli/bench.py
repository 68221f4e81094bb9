"""``lbd bench balance``: rank the shedding strategies on the standard scenarios.

Each scenario (scale-up 5→10, scale-down 10→5, a namespace with 8x traffic, a diurnal swing, 100
brokers with a skew, brokers of three sizes, broker churn) runs in a load model in which moving a
bundle moves its load, brokers report every cycle into the EMA, and the cool-down, grace period
and hit counts apply as configured. Per scenario and strategy it prints the shedding cycles and
simulated minutes until the std of the brokers' actual load is under target, the final std, the
moves, the traffic moved, the ping-pongs (a bundle back on a broker it left within the hour) and
the most moves one broker took in one cycle. No server is needed; the figures are the same for a
seed on every machine.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from lbd.core.errors import InvalidInputError
from lbd.core.shedding import STRATEGIES
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
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the chosen scenarios under the chosen strategies and print the table."""
    try:
        config = suite_config(target_std=args.target_std)
    except InvalidInputError as e:
        raise InvalidInputError(f"--target-std: {e}") from None
    scenarios = args.scenario or list(SCENARIOS)
    strategies = args.strategy or list(STRATEGIES)
    console = Console()
    with console.status(f"{len(scenarios)} scenario(s) x {len(strategies)} strategies..."):
        results = run_suite(scenarios, strategies, config, seed=args.seed)
    if args.markdown:
        print(markdown(results))
    else:
        console.print(table(results, config.target_std))
    return 0
