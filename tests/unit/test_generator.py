"""Generated clusters for the balancing strategies (lbd/workload/generator.py)."""

import math
from dataclasses import replace

import pytest

from lbd.cli.main import main
from lbd.core.settings import MB, SheddingConfig
from lbd.workload.balance import BalanceSim
from lbd.workload.generator import (
    BUNDLES_PER_BROKER,
    LARGEST_SHARE,
    SPIKE_AT,
    SPIKE_LENGTHS,
    Generated,
    Spiked,
    at_rest,
    best_spread,
    distribution,
    evaluate,
    generate,
    judge_all,
    judge_spikes,
    misses,
    percentile,
    shrink,
    spike_table,
    spiked,
    without,
)
from lbd.workload.suite import suite_config

CONFIG = suite_config()


@pytest.mark.parametrize("seed", range(1, 31))
def test_a_generated_cluster_keeps_to_its_bounds(seed: int) -> None:
    g = generate(seed, CONFIG.target_std)
    s = g.scenario
    assert 3 <= len(s.brokers) <= 200
    assert BUNDLES_PER_BROKER * len(s.brokers) <= len(s.traffic) <= 4000
    largest = LARGEST_SHARE * 2 * min(s.brokers.values()) * MB
    assert max(s.traffic.values()) <= largest * (1 + 1e-9)
    assert set(s.placement) == set(s.traffic) and set(s.placement.values()) <= set(s.brokers)
    starts = [0] if s.disturbed_at_start else []
    assert len(g.targets) == len(g.kinds) == len(starts) + len(s.events)
    assert all(t >= CONFIG.target_std for t in g.targets)
    ats = [e.at for e in s.events]
    assert ats == sorted(ats) and len(set(ats)) == len(ats)
    assert s.cycles > ats[-1] if ats else s.cycles > 0


def test_the_same_seed_draws_the_same_cluster_and_others_differ() -> None:
    a, b = generate(7, 0.1), generate(7, 0.1)
    assert a.scenario.traffic == b.scenario.traffic and a.kinds == b.kinds
    assert generate(8, 0.1).scenario.traffic != a.scenario.traffic


def test_the_drawn_clusters_cover_every_kind_of_disturbance_and_start() -> None:
    kinds = " ".join(k for seed in range(1, 60) for k in generate(seed, 0.1).kinds)
    for word in ("join", "leave", "restart", "back", " x", "(moved)", "skewed start", "random"):
        assert word in kinds, word
    sizes = {len(generate(seed, 0.1).scenario.brokers) for seed in range(1, 60)}
    assert min(sizes) < 10 and max(sizes) > 100


def test_some_clusters_have_brokers_reporting_only_their_emas() -> None:
    shares = [
        len(g.scenario.ema_only) / len(g.scenario.brokers)
        for g in (generate(seed, 0.1) for seed in range(1, 40))
    ]
    assert any(s == 0 for s in shares) and any(s > 0 for s in shares)
    g = next(g for g in (generate(seed, 0.1) for seed in range(1, 40)) if g.scenario.ema_only)
    assert "reporting only the EMAs" in g.scenario.description


def test_some_clusters_have_brokers_reporting_every_second_or_third_cycle() -> None:
    drawn = [generate(seed, 0.1).scenario for seed in range(1, 40)]
    assert any(not s.report_every for s in drawn)
    late = next(s for s in drawn if s.report_every)
    assert set(late.report_every.values()) <= {2, 3} and "every 2 or 3 cycles" in late.description
    sim = BalanceSim(late, "cluster_planner", CONFIG)
    sim.step(0)
    first = {b: d.updated_at_ms for b, d in sim.model.loads.items()}
    sim.step(1)
    stale = {b for b, d in sim.model.loads.items() if d.updated_at_ms == first.get(b)}
    assert stale == set(late.report_every) & set(first)


# Clusters on which cluster_planner missed its goals, pinned once fixed: (seed, target std).
PINNED = {  # found before the clusters had placement rules: judged as drawn then
    (1, 0.25): "a leave whose orphans unbalanced the cluster waited out the hit count (4 cycles)",
    (1, 0.10): "the same leave, judged against the suite's target (4 cycles)",
    (4, 0.25): "an overloaded broker under target started a whole rebalance (20 moves against 10)",
    (25, 0.25): "the same on 129 brokers (46 moves against 12)",
    (65, 0.10): "a skew the EMAs showed waited out the hit count; EMA-only brokers (4 cycles)",
    (10, 0.10): "three source brokers a cycle on 70 brokers (7 cycles)",
    (14, 0.10): "three source brokers a cycle on 21 brokers (4 cycles): its join alone",
    (57, 0.10): "orphans placed on EMA-only brokers went unseen after a leave (16 cycles)",
    (61, 0.10): "the same with every broker reporting only its EMAs (never under target)",
    (71, 0.10): "the same on 76 brokers, 36 of them EMA-only (never under target)",
}


# Of these, the disturbances that are a change of traffic, left out: since a spike's EMAs no
# longer count as proof (docs/balancing.md, "Spikes"), every strategy waits out the hit count on
# them and is first back under target in the fourth cycle.
TRAFFIC_LEFT_OUT = {(14, 0.10): 0}


@pytest.mark.parametrize(("seed", "target"), sorted(PINNED))
def test_a_pinned_cluster_meets_the_planner_s_goals(seed: int, target: float) -> None:
    config = replace(CONFIG, target_std=target)
    generated = generate(seed, target, rules=False)
    if (seed, target) in TRAFFIC_LEFT_OUT:
        index = TRAFFIC_LEFT_OUT[seed, target]
        assert generated.scenario.events[index].traffic
        fewer = without(generated, index)
        assert fewer is not None
        generated = fewer
    judged = [evaluate(generated, s, config) for s in ("cluster_planner", "transfer_shedder")]
    assert misses(judged) == [], PINNED[seed, target]


FORBIDDEN = {
    14: "two bundles of an anti-affinity group sent to one broker in a cycle (all strategies)",
    22: "a swap's bundles each allowed back alone, not after the overshooting move",
    29: "one namespace of 256 bundles in a group: its bundles moved two to a broker a cycle",
}


@pytest.mark.parametrize("seed", sorted(FORBIDDEN))
def test_no_strategy_makes_a_move_the_placement_rules_forbid(seed: int) -> None:
    config = SheddingConfig(target_std=0.10)  # the defaults, as they were found
    generated = generate(seed, config.target_std)
    assert generated.scenario.policies  # the cluster has rules to break
    for strategy in ("cluster_planner", "transfer_shedder", "avg_shedder"):
        judged = evaluate(generated, strategy, config)
        assert judged.forbidden_moves == 0, (strategy, FORBIDDEN[seed])


NO_SHARED_BROKER = {
    40: "4 brokers: two isolated namespaces on two primaries each reserved all four",
    224: "4 brokers: two isolated namespaces on two primaries each reserved all four",
    795: "4 brokers: the third of three isolated namespaces reserved the last one",
    928: "4 brokers: the third of three isolated namespaces reserved the last one",
}
"""Clusters whose isolation rules once reserved every broker."""


@pytest.mark.parametrize("seed", sorted(NO_SHARED_BROKER))
def test_isolation_leaves_brokers_for_the_namespaces_nobody_isolated(seed: int) -> None:
    s = generate(seed, CONFIG.target_std).scenario
    isolations = [p.isolation for p in s.policies.values() if p.isolation is not None]
    assert isolations, "the cluster still isolates a namespace"
    shared = [b for b in s.brokers if not any(i.is_primary(b) for i in isolations)]
    assert shared, NO_SHARED_BROKER[seed]


PING_PONGS = {
    151: "a bundle moved at cycle 7 sent back to the broker it left at cycle 67, on the hour",
    393: "a bundle moved at cycle 1 sent back at cycle 61: the planner's window ended just before",
}


@pytest.mark.parametrize("seed", sorted(PING_PONGS))
def test_the_planner_never_returns_a_bundle_within_the_hour_not_even_at_its_end(seed: int) -> None:
    judged = evaluate(generate(seed, CONFIG.target_std), "cluster_planner", CONFIG)
    assert judged.moves > 0
    assert judged.ping_pongs == 0, PING_PONGS[seed]


def test_the_target_is_what_the_cluster_can_reach_when_the_configured_one_is_out_of_reach() -> None:
    capacity = {"a": 100.0, "b": 100.0}
    traffic = {"t/n/0x00000000_0x80000000": 150.0 * MB, "t/n/0x80000000_0xffffffff": 10.0 * MB}
    spread = best_spread(traffic, capacity)  # type: ignore[arg-type]
    assert spread == pytest.approx((0.75 - 0.05) / 2)


def test_a_strategy_is_judged_against_each_disturbance_s_target() -> None:
    g = generate(3, CONFIG.target_std)
    judged = evaluate(g, "cluster_planner", CONFIG)
    series, starts = judged.run.std_series, judged.run.disturbed_at
    assert judged.cycles_to_target is not None
    for start, target in zip(starts, g.targets, strict=True):
        assert any(std <= target for std in series[start : start + judged.cycles_to_target])


def test_misses_name_what_the_planner_failed_at() -> None:
    runs = judge_all(20, ["cluster_planner", "transfer_shedder"], CONFIG)
    planner, baseline = runs
    why = misses(runs)
    if planner.cycles_to_target is None:
        assert "never under target" in why
    assert (planner.moves > baseline.moves) == any("moves against" in w for w in why)
    assert misses([r for r in runs if r.strategy == "transfer_shedder"]) == []


def test_shrinking_keeps_the_failure_and_drops_what_does_not_cause_it() -> None:
    g = generate(5, CONFIG.target_std)

    def fails(candidate: Generated) -> bool:
        return any("skewed" in k for k in candidate.kinds)  # only the start "causes" it

    small = shrink(g, fails)
    assert small.kinds == ("skewed start",) and small.scenario.events == ()
    assert len(small.targets) == 1


def test_shrinking_never_keeps_a_leave_of_a_broker_whose_join_it_dropped() -> None:
    # Seed 1: two brokers join, then one of them restarts. Dropping the join alone would leave
    # a schedule in which a broker that never came up leaves (the bench died of it).
    g = generate(1, CONFIG.target_std)
    assert any("join" in k for k in g.kinds) and any("restart" in k for k in g.kinds)
    tried: list[Generated] = []

    def fails(candidate: Generated) -> bool:  # runs every candidate, as the bench does
        tried.append(candidate)
        return bool(evaluate(candidate, "transfer_shedder", CONFIG).run.std_series)

    shrink(g, fails)
    assert tried


def test_the_distribution_has_one_row_per_strategy_with_percentiles() -> None:
    judged = [j for seed in (1, 2, 3) for j in judge_all(seed, ["cluster_planner"], CONFIG)]
    [row] = distribution(judged, ["cluster_planner", "avg_shedder"])
    assert row[0] == "cluster_planner" and row[1] == "3"
    assert len(row[4].split("/")) == 3
    assert percentile([1, 2, 3, 4], 0.5) == 2 and math.isinf(percentile([1, math.inf], 0.99))


def test_bench_balance_generated_prints_the_distribution_and_the_misses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "balance", "--generated", "3", "--jobs", "1", "--markdown"]
    assert main([*argv, "--strategy", "cluster_planner", "--strategy", "transfer_shedder"]) == 0
    out = capsys.readouterr().out
    assert "3 generated clusters, seeds 1..3" in out
    assert out.count("| cluster_planner |") == 1 and out.count("| transfer_shedder |") == 1
    assert "cluster_planner misses its goals on" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--generated", "-1"], "must be >= 0"),
        (["--shrink", "2"], "go with --generated"),
        (["--spikes"], "go with --generated"),
        (["--generated", "2", "--spikes", "--shrink", "1"], "does not go with --spikes"),
        (["--generated", "2", "--scenario", "churn"], "does not go with --generated"),
    ],
)
def test_bench_balance_refuses_bad_generated_arguments(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "balance", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_spiked_cluster_is_placed_evenly_and_spiked_for_as_long_as_asked() -> None:
    generated = generate(4, CONFIG.target_std)
    quiet, namespace, factor = at_rest(generated)
    assert quiet.events == () and not quiet.disturbed_at_start
    assert set(quiet.placement) == set(generated.scenario.traffic)
    assert at_rest(generated) == (quiet, namespace, factor)  # drawn from the seed alone
    for length in SPIKE_LENGTHS:
        scenario = spiked(quiet, namespace, factor, length)
        assert scenario.placement == quiet.placement
        up, down = scenario.events
        assert (up.at, down.at) == (SPIKE_AT, SPIKE_AT + length)
        assert set(up.traffic) == set(down.traffic) == {namespace}
        assert up.traffic[namespace] * down.traffic[namespace] == pytest.approx(1.0)
        assert not up.disturbs and not down.disturbs


@pytest.mark.parametrize("seed", [1, 11])
def test_a_spike_of_up_to_three_cycles_moves_nothing(seed: int) -> None:
    """Seed 1: brokers that report every second or third cycle kept a two-cycle spike in their
    latest samples, and the planner counted those samples again until its hit count ran out (16
    moves). Seed 11: one cycle of a namespace at eight times its traffic carried the EMAs of a
    cluster just under its target over it, and the planner took that for proof (4 moves; 12 and
    7 on longer spikes). Pulsar's transfer_shedder moved nothing on either."""
    spikes = judge_spikes(seed, ["cluster_planner", "transfer_shedder"], CONFIG)
    assert all(s.at_rest and s.moves == (0,) * len(SPIKE_LENGTHS) for s in spikes), spikes


def test_the_spike_table_counts_the_clusters_at_rest_a_spike_moved() -> None:
    spikes = [
        Spiked(1, "cluster_planner", "t/a x2", True, (0, 3, 5)),
        Spiked(2, "cluster_planner", "t/b x8", True, (0, 0, 0)),
        Spiked(3, "cluster_planner", "t/c x4", False, (9, 9, 9)),
    ]
    [row] = spike_table(spikes, ["cluster_planner", "avg_shedder"])
    assert row == ("cluster_planner", "2", "0 (0 bundles)", "1 (3 bundles)", "1 (5 bundles)")


def test_bench_balance_spikes_prints_the_spike_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "balance", "--generated", "2", "--spikes", "--jobs", "1", "--markdown"]
    assert main([*argv, "--strategy", "cluster_planner"]) == 0
    out = capsys.readouterr().out
    assert "2 generated clusters, seeds 1..2, placed evenly and spiked" in out
    assert out.count("| cluster_planner | 2 | 0 (0 bundles) |") == 1
