"""The scenario suite that ranks shedding strategies (``lbd bench balance``, ``make bench``).

Every scenario of :data:`~lbd.workload.scenarios.SCENARIOS` runs under every strategy with the
same settings: the defaults, with ``target_std`` at :data:`SUITE_TARGET_STD` (the spread an operator
of a production cluster asks for; the default 0.25 lets a broker sit at twice another's load).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from rich.table import Table

from lbd.core.settings import SheddingConfig
from lbd.core.shedding import STRATEGIES
from lbd.workload.balance import BalanceSim, RunResult
from lbd.workload.scenarios import SCENARIOS

SUITE_TARGET_STD = 0.10
"""The target std of every run of the suite."""


def suite_config(**overrides: object) -> SheddingConfig:
    """The settings of the suite: the defaults, the suite's target, and ``overrides``."""
    return replace(SheddingConfig(target_std=SUITE_TARGET_STD), **overrides)  # type: ignore[arg-type]


def run_suite(
    scenarios: Sequence[str] = tuple(SCENARIOS),
    strategies: Sequence[str] = tuple(STRATEGIES),
    config: SheddingConfig | None = None,
    seed: int = 1,
) -> list[RunResult]:
    """Every scenario under every strategy, scenario by scenario."""
    config = config or suite_config()
    results: list[RunResult] = []
    for name in scenarios:
        scenario = SCENARIOS[name](seed)
        for strategy in strategies:
            results.append(BalanceSim(scenario, strategy, config, seed=seed).run())
    return results


def _to_target(r: RunResult) -> tuple[str, str]:
    if r.disturbances == 0:
        return "n/a", "n/a"
    if r.cycles_to_target is None or r.minutes_to_target is None:
        return "never", "never"
    return str(r.cycles_to_target), f"{r.minutes_to_target:g}"


COLUMNS = (
    "scenario",
    "strategy",
    "cycles to target",
    "min to target",
    "min over target",
    "final std",
    "moves",
    "MB/s moved",
    "ping-pongs",
    "peak moves per broker",
)
"""Minutes are simulated minutes; the peak is the most moves one broker took in one cycle."""


def rows(results: Iterable[RunResult]) -> list[tuple[str, ...]]:
    """The table's rows, as text."""
    out: list[tuple[str, ...]] = []
    for r in results:
        cycles, minutes = _to_target(r)
        out.append(
            (
                r.scenario,
                r.strategy,
                cycles,
                minutes,
                f"{r.minutes_over_target:g}",
                f"{r.final_std:.3f}",
                str(r.moves),
                f"{r.moved_mb:,.0f}",
                str(r.ping_pongs),
                str(r.max_moves_per_broker),
            )
        )
    return out


def table(results: Sequence[RunResult], target_std: float = SUITE_TARGET_STD) -> Table:
    """A terminal table of the runs."""
    t = Table(title=f"balancing scenarios (target std {target_std:g}, one cycle = one minute)")
    for i, column in enumerate(COLUMNS):
        t.add_column(column, justify="left" if i < 2 else "right")
    text = rows(results)
    for i, row in enumerate(text):
        last_of_scenario = i + 1 == len(results) or results[i + 1].scenario != results[i].scenario
        t.add_row(*row, end_section=last_of_scenario)
    return t


def markdown(results: Sequence[RunResult]) -> str:
    """The table in Markdown, for docs/balancing.md."""
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(COLUMNS))) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows(results)]
    return "\n".join(lines)
