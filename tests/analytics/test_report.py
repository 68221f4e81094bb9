"""The report on small histories with known numbers, in Spark local mode."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from lbd.analytics.report import ReportOptions, build_report
from tests.analytics.histories import (
    BROKER_LOAD,
    DECISIONS,
    T0,
    broker_row,
    decision,
    write_history,
)

MIN = 60_000


@pytest.fixture(scope="module")
def known_history(tmp_path_factory):
    """Two brokers at 0.9 and 0.1 (std 0.4) for 5 minutes, then 0.5 each, then a third joins
    and the std goes over target again for 2 minutes until the history ends."""
    rows = []
    for i in range(5):
        rows += [broker_row(T0 + i * MIN, "a", 0.9), broker_row(T0 + i * MIN, "b", 0.1)]
    for i in range(5, 10):
        rows += [broker_row(T0 + i * MIN, "a", 0.5), broker_row(T0 + i * MIN, "b", 0.5)]
    for i in range(10, 12):
        rows += [
            broker_row(T0 + i * MIN + 5_000, b, load)
            for b, load in (("a", 0.9), ("b", 0.9), ("c", 0.0))
        ]
    decisions = [
        decision(T0 + 2 * MIN, "transfer", "t/n/0x00000000_0x80000000", "a", "b", "Overloaded"),
        decision(T0 + 3 * MIN, "transfer", "t/n/0x00000000_0x80000000", "b", "a", "Overloaded"),
        decision(T0 + 4 * MIN, "unload", "t/n/0x80000000_0xffffffff", "a", None, "Underloaded"),
        decision(T0 + 4 * MIN, "assign", "t/n/0x80000000_0xffffffff", None, "b", "Lookup"),
    ]
    path = str(tmp_path_factory.mktemp("known") / "history")
    return write_history(path, {BROKER_LOAD: rows, DECISIONS: decisions})


def _csv(path):
    with open(path, encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_known_imbalance_gives_known_std_and_time_to_target(spark, known_history, tmp_path):
    out = str(tmp_path / "report")
    summary = build_report(spark, known_history, out, ReportOptions(target_std=0.25))
    assert summary.rows == 26 + 4
    first, second = summary.episodes
    assert first.episode.peak_std == pytest.approx(0.4)
    assert first.episode.seconds == 300.0
    assert first.cause == "history starts unbalanced"
    assert second.episode.start_ms == T0 + 10 * MIN
    assert second.episode.end_ms is None and second.episode.seconds is None
    assert second.cause == "joined: c"
    assert second.episode.peak_std == pytest.approx(0.42426, abs=1e-4)  # std(0.9, 0.9, 0)

    std_rows = spark.read.parquet(os.path.join(out, "tables", "cluster_std")).orderBy("ts_ms")
    stds = [round(r["std"], 6) for r in std_rows.collect()]
    assert stds == [0.4] * 5 + [0.0] * 5 + [0.424264] * 2
    episodes = _csv(os.path.join(out, "tables", "episodes.csv"))
    assert episodes[0]["seconds_to_target"] == "300.0"

    moves = {
        (r["kind"], r["reason"]): int(r["count"])
        for r in _csv(os.path.join(out, "tables", "moves_by_reason.csv"))
    }
    assert moves == {
        ("transfer", "Overloaded"): 2,
        ("unload", "Underloaded"): 1,
        ("assign", "Lookup"): 1,
    }
    assert summary.moves == 3
    # a -> b -> a within the hour, and an unload off a reassigned to b is not a ping-pong.
    ping = _csv(os.path.join(out, "tables", "ping_pong.csv"))
    assert [(r["bundle"], r["ping_pongs"]) for r in ping] == [("t/n/0x00000000_0x80000000", "1")]
    assert summary.ping_pongs == 1

    page = Path(summary.html).read_text(encoding="utf-8")
    assert "Time back under the target std" in page and "balance-1.png" in page
    assert os.path.getsize(os.path.join(out, "balance-1.png")) > 5_000


def test_synthetic_history_report(spark, tmp_path):
    from lbd.analytics.scenarios import ScenarioName, SynthSpec
    from lbd.analytics.synth import synth

    history = str(tmp_path / "h")
    spec = SynthSpec(scenario=ScenarioName.BURST, brokers=4, hours=2, bundles_per_broker=4)
    result = synth(spark, history, spec)
    assert result.rows == 120 * (4 + 16) + result.decisions
    summary = build_report(spark, history, str(tmp_path / "r"))
    assert summary.rows == result.rows
    assert summary.clusters == ("synthetic",)
    hot = _csv(os.path.join(str(tmp_path / "r"), "tables", "hot_bundles.csv"))
    assert len(hot) == 16
    means = [float(r["mean_throughput"]) for r in hot]
    assert means == sorted(means, reverse=True)
