"""The replay's comparison of strategies says what the runs show (no Spark)."""

from __future__ import annotations

from lbd.analytics.ranking import RunResult, _strategy_comparison


def run(strategy: str, final_std: float, moves: int) -> RunResult:
    return RunResult("h", strategy, {}, final_std, 60.0, 1, 1, moves, 0, True)


def test_threshold_shedder_is_said_to_leave_more_imbalance_only_when_it_does() -> None:
    more = _strategy_comparison(
        [run("transfer_shedder", 0.05, 9), run("threshold_shedder", 0.08, 3)]
    )
    assert any("so it leaves more imbalance (final std 0.080 vs 0.050" in line for line in more)
    less = _strategy_comparison(
        [run("transfer_shedder", 0.10, 9), run("threshold_shedder", 0.06, 3)]
    )
    assert not any("leaves more imbalance" in line for line in less)
    assert any("no more imbalanced (final std 0.060 vs 0.100" in line for line in less)
