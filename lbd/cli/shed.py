"""``lbd shed``: run a shedding strategy over a load snapshot, offline, and print its decisions.

Each cycle prints one JSON line (DESIGN §7)::

    {"cycle": n, "decisions": [{"bundle", "src", "dst", "reason"}], "skip_reason": str|null,
     "avg": float, "std": float, "notes": [str]}

With ``"cycles": n`` the strategy runs n times over the same snapshot, carrying its state (the
hit count) as the leader would. The leader's record of its own unloads is carried too: bundles
and source brokers unloaded in a cycle are marked unloaded at ``now_ms`` for the next ones, so a
bundle is never moved twice and its source broker cools down. Loads are not changed between
cycles: they change only when brokers report again, which a snapshot cannot foresee.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from lbd.core.errors import InvalidInputError
from lbd.core.shedding import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    Scenario,
    ShedderState,
    SheddingResult,
    parse_scenario,
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``shed`` verb."""
    parser = sub.add_parser(
        "shed",
        help="dry-run the shedder over a load snapshot and print its decisions as JSON lines",
        description=(
            "Run a shedding strategy over a scenario file (a load snapshot, DESIGN §7) and "
            "print one JSON object per cycle on stdout."
        ),
    )
    parser.add_argument(
        "--scenario", required=True, metavar="FILE", type=Path, help="scenario JSON file"
    )
    parser.add_argument(
        "--strategy",
        choices=sorted(STRATEGIES),
        default=DEFAULT_STRATEGY,
        help=f"shedding strategy (default: {DEFAULT_STRATEGY})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the random tie-break between equally loaded brokers (default: 0)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the scenario and print one line per cycle."""
    scenario = load_scenario(args.scenario)
    for result_line in run_cycles(scenario, args.strategy, random.Random(args.seed)):
        print(json.dumps(result_line))
    return 0


def load_scenario(path: Path) -> Scenario:
    """Read and validate a scenario file; every problem becomes an InvalidInputError."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidInputError(f"cannot read scenario {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise InvalidInputError(f"{path}: not UTF-8 text ({e.reason})") from None
    try:
        return parse_scenario(json.loads(text, parse_constant=_reject_constant))
    except json.JSONDecodeError as e:
        raise InvalidInputError(
            f"{path}: invalid JSON: {e.msg} (line {e.lineno}, column {e.colno})"
        ) from None
    except InvalidInputError as e:
        raise InvalidInputError(f"{path}: {e}") from None


def run_cycles(
    scenario: Scenario, strategy_name: str, rng: random.Random
) -> list[dict[str, object]]:
    """The output objects of every cycle of ``scenario`` under the named strategy."""
    strategy = STRATEGIES[strategy_name]
    snapshot = scenario.snapshot
    state = ShedderState()
    lines: list[dict[str, object]] = []
    for cycle in range(1, scenario.cycles + 1):
        result, state = strategy(snapshot, scenario.config, state, scenario.now_ms, rng)
        lines.append(_to_json(cycle, result))
        snapshot = snapshot.with_unloads(result.decisions, scenario.now_ms)
    return lines


def _to_json(cycle: int, result: SheddingResult) -> dict[str, object]:
    return {
        "cycle": cycle,
        "decisions": [
            {"bundle": d.bundle, "src": d.src, "dst": d.dst, "reason": str(d.reason)}
            for d in result.decisions
        ],
        "skip_reason": None if result.skip_reason is None else str(result.skip_reason),
        "avg": result.avg,
        "std": result.std,
        "notes": list(result.notes),
    }


def _reject_constant(name: str) -> object:
    raise InvalidInputError(f"invalid JSON: {name} is not a number")
