"""Histories of generated clusters (``lbd analytics synth --generated``) and replay over them.

Seeds 4 and 5 are small clusters with every kind of disturbance between them: seed 4 has three
brokers that report only the EMAs, one leaving and a new one joining; seed 5 starts skewed, has
a hot namespace, a restart and a leave, and two brokers that report only every second cycle.
"""

from __future__ import annotations

import csv
import itertools
import os
import tomllib

import pytest

from lbd.analytics.replay import load_traces, run_replay
from lbd.analytics.synth import synth_generated
from lbd.core.shedding import DEFAULT_STRATEGY
from lbd.workload.generator import generate

SEEDS = (4, 5)
STEP_MS = 60_000


@pytest.fixture(scope="module")
def history(spark, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("generated") / "h")
    result = synth_generated(spark, path, len(SEEDS), SEEDS[0])
    assert result.clusters == tuple(f"generated-{s}" for s in SEEDS)
    return path


def _samples(spark, path, cluster):
    rows = (
        spark.read.parquet(os.path.join(path, "broker_load"))
        .where(f"cluster = '{cluster}'")
        .select("ts_ms", "broker", "msg_throughput_in", "bundle_count", "load")
        .collect()
    )
    t0 = min(r["ts_ms"] for r in rows)
    by_broker: dict[str, list] = {}
    for r in sorted(rows, key=lambda r: r["ts_ms"]):
        by_broker.setdefault(r["broker"], []).append(r)
    return t0, by_broker


@pytest.mark.parametrize("seed", SEEDS)
def test_the_history_shows_the_generated_clusters_brokers_and_disturbances(spark, history, seed):
    scenario = generate(seed, 0.25).scenario
    t0, samples = _samples(spark, history, f"generated-{seed}")
    cycles = {b: [(r["ts_ms"] - t0) // STEP_MS for r in rows] for b, rows in samples.items()}
    joined = {b for e in scenario.events for b in e.join}
    assert set(cycles) == set(scenario.brokers) | joined
    for broker in scenario.brokers:
        assert cycles[broker][0] == 0
    for i, event in enumerate(scenario.events):
        back = next(
            (e.at for e in scenario.events[i + 1 :] if set(e.join) & set(event.leave)), None
        )
        for broker in event.leave:  # silent from the leave until it is back, if ever
            silent = range(event.at, scenario.cycles if back is None else back)
            assert not set(cycles[broker]) & set(silent), (broker, event)
        for broker in event.join:  # a join is a broker whose samples start (again) later
            assert event.at in cycles[broker] and event.at - 1 not in cycles[broker]
    for broker, every in scenario.report_every.items():
        assert min(y - x for x, y in itertools.pairwise(cycles[broker])) == every
    for broker, rows in samples.items():
        carrying = [r for r in rows if r["load"] > 0.01]
        assert carrying
        raw = [r["msg_throughput_in"] > 0 for r in carrying]
        assert not any(raw) if broker in scenario.ema_only else all(raw), broker


def test_the_replay_reads_late_and_ema_only_reports_as_the_leader_does(spark, history):
    traces = {t.cluster: t for t in load_traces(spark, history, 60)}
    assert sorted(traces) == [f"generated-{s}" for s in SEEDS]
    # Seed 4: every broker reports only the EMAs; the replay's brokers report so too, and carry
    # their EMA throughput (the raw throughput is 0 in the history). A broker with no bundles
    # (the one that joins, until it gets some) carries nothing either way.
    for step in traces["generated-4"].steps:
        owners = {b.owner for b in step.bundles.values()}
        assert owners
        assert all(step.brokers[b].ema_only and step.brokers[b].throughput > 0 for b in owners)
    # Seed 5: broker-4 reports every second cycle; it stays in every step, with its bundles.
    steps = traces["generated-5"].steps
    assert all("broker-4" in s.brokers for s in steps)
    assert all(s.brokers["broker-4"].report_every_s == 120 for s in steps)
    assert all(any(b.owner == "broker-4" for b in s.bundles.values()) for s in steps[:20])
    # broker-5 restarts at cycle 47 and is back at 50: gone in between, as the history says.
    assert [("broker-5" in s.brokers) for s in steps[46:51]] == [True, False, False, False, True]


def test_replay_over_generated_histories_names_the_winner_with_the_evidence(
    spark, history, tmp_path
):
    out = str(tmp_path / "replay")
    strategies = ("transfer_shedder", "cluster_planner")
    result = run_replay(
        spark, [history], out, grid={"target_std": (0.1, 0.25)}, strategies=strategies
    )
    assert len(result.ranking) == len(SEEDS) * len(strategies) * 2
    with open(os.path.join(out, "ranking.csv"), encoding="utf-8") as f:
        ranking = list(csv.DictReader(f))
    assert len(ranking) == len(strategies) * 2
    first = ranking[0]
    mine = [
        r
        for r in result.ranking
        if r.strategy == first["strategy"]
        and f"target_std={r.setting['target_std']}" == first["setting"]
    ]
    assert len(mine) == len(SEEDS) and int(first["histories"]) == len(SEEDS)
    assert int(first["moves"]) == sum(r.moves for r in mine)
    assert int(first["under_target"]) == sum(r.ends_under_target for r in mine)
    keys = [r.rank_key() for r in result.standings]
    assert keys == sorted(keys)
    with open(os.path.join(out, "recommended.toml"), "rb") as f:
        text = f.read().decode()
    shedding = tomllib.loads(text)["shedding"]
    assert shedding["strategy"] == first["strategy"]
    assert f"target_std={shedding['target_std']}" == first["setting"]
    assert (
        f"# Winner: {first['strategy']} with {first['setting']}: under target at the end of "
        f"{first['under_target']} of {len(SEEDS)} history(ies), "
        f"{float(first['seconds_over_target']):.0f} s over target in all, {first['moves']} moves, "
        f"{first['ping_pongs']} ping-pongs" in text
    )
    for strategy in strategies:  # every strategy's best setting is in the evidence
        assert f". {strategy} with target_std=" in text
    if DEFAULT_STRATEGY in strategies:
        assert f"# Current defaults ({DEFAULT_STRATEGY}, rank " in text
