"""The sidecar benchmark runs end to end (``make bench`` must not rot), on small inputs.

The first tests need no server: the helpers the benchmarks share, and the figures' table.
"""

import asyncio

import pytest
from rich.console import Console

from bench import (
    assign_bench,
    etcd_lease_bench,
    failover_bench,
    lookup_bench,
    operating_bench,
    recovery_bench,
    scale_bench,
    sidecar_bench,
)
from bench.report import Figure, cuts, drain, figures_table
from tests.e2e.clusters import DEV, HANDOVER_S

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]


def test_a_figure_is_its_ratio_to_the_baseline_and_says_whether_it_meets_the_goal() -> None:
    at_the_bound = Figure("lookups", 900.0, "per s", 1_000.0, "same run", ">= 0.9")
    slower = Figure("p99", 6.0, "ms", 5.0, "goal", "<= 1")
    assert at_the_bound.ratio == pytest.approx(0.9) and at_the_bound.met
    assert slower.ratio == pytest.approx(1.2) and not slower.met
    assert not Figure("p99", 6.0, "ms", 6.0, "goal", "<= 0.99").met

    console = Console(width=200, record=True)
    console.print(figures_table("figures", [at_the_bound, slower]))
    rows = [line for line in console.export_text().splitlines() if line.startswith("│")]
    assert [[cell.strip() for cell in row.split("│")[1:-1]] for row in rows] == [
        ["lookups", "900 per s", "1,000 per s (same run)", "0.90", "ratio >= 0.9", "yes"],
        ["p99", "6.00 ms", "5.00 ms (goal)", "1.20", "ratio <= 1", "no"],
    ]


async def test_drain_keeps_the_calls_in_flight_at_its_concurrency_and_times_each() -> None:
    in_flight: list[int] = []
    peak = 0

    async def call(item: int) -> None:
        nonlocal peak
        in_flight.append(item)
        peak = max(peak, len(in_flight))
        await asyncio.sleep(0)
        in_flight.remove(item)

    drained = await drain(range(10), call, 3)
    assert peak == 3 and len(drained.latencies_ms) == 10
    assert drained.per_s == pytest.approx(10 / drained.seconds)
    assert cuts([float(v) for v in range(1, 102)]) == (51.0, 100.0)


def test_the_lookup_figures_set_the_p99_against_the_trivial_server_and_the_goal() -> None:
    runs = {c: lookup_bench.Run(per_s=1_000.0, p99_ms=4.0) for c in lookup_bench.CONCURRENCIES}
    figures = lookup_bench.figures(lookup_bench.Medians(lbd=runs, trivial=runs))
    assert len(figures) == len(lookup_bench.CONCURRENCIES) + 2
    assert all(f.met for f in figures)
    assert [f.baseline for f in figures[-2:]] == [4.0, lookup_bench.P99_GOAL_MS]


def test_the_sidecar_benchmark_measures_lookups_assignments_and_failover() -> None:
    result = sidecar_bench.run(bundles=16, lookups=500, concurrency=8)
    for name in ("assign_latency_p50_ms", "lookup_latency_p99_ms", "lookup_concurrent_per_s"):
        assert result[name] > 0, name
    assert result["assign_latency_p50_ms"] <= result["assign_latency_p99_ms"]
    # Orphans move only after the dev cluster's 7 s cleanup grace; a new leader after its 3 s TTL.
    assert 5.6 <= result["failover_orphans_owned_again_s"] < 30
    assert 0 < result["failover_new_leader_s"] < 15


def test_the_operating_benchmark_measures_unavailability_and_a_drain() -> None:
    result = operating_bench.run(transfers=10, drain=20)
    assert result["transfers"] == 10
    assert 0 <= result["unavailable_p50_ms"] <= result["unavailable_p99_ms"]
    # A hand-over takes milliseconds on loopback, far below the call that waits for it.
    assert result["unavailable_p99_ms"] < 1000
    assert result["drain_bundles"] >= 20 and result["drain_left_on_broker"] == 0
    # The default governor: at most 4 moves in flight at the drained broker.
    assert 1 <= result["drain_peak_in_flight"] <= 4


def test_the_lookup_benchmark_compares_lbd_with_the_trivial_server() -> None:
    figures = lookup_bench.run(topics=300, pairs=2, per_pass=200)
    for c in lookup_bench.CONCURRENCIES:
        assert figures.lbd[c].per_s > 0 and figures.trivial[c].per_s > 0, c
        assert figures.lbd[c].p99_ms > 0 and figures.trivial[c].p99_ms > 0, c
    rows = lookup_bench.table(figures).row_count
    assert rows == len(lookup_bench.CONCURRENCIES) + len(lookup_bench.P99_AT)
    assert all(f.value > 0 and f.baseline > 0 for f in lookup_bench.figures(figures))


def test_the_recovery_benchmark_times_each_phase_of_an_orphan_repair() -> None:
    result = recovery_bench.run(bundles=100)
    announced = result["first announcement (s after kill)"]
    handed_over = result["first hand-over (s after kill)"]
    # The protocol's waits: the lease TTL (less a keepalive interval at most) and the orphan
    # grace, then the hand-over wait (seen from a watcher, whose view of each step may lag a
    # little).
    detected = DEV.etcd.lease_ttl_s - DEV.etcd.keepalive_interval_s
    assert detected + DEV.monitor.orphan_cleanup_grace_s - 0.2 <= announced
    assert announced <= result["last announcement (s after kill)"]
    assert handed_over >= announced + HANDOVER_S - 0.5
    assert result["all Owned again (s after kill)"] >= result["last hand-over (s after kill)"]
    assert result["all Owned again (s after kill)"] < 60
    (repair,) = recovery_bench.figures(result)
    assert repair.value == result["first hand-over to all Owned (s)"]


def test_the_failover_benchmark_times_a_kill_with_every_setting_at_its_default() -> None:
    results = failover_bench.run((10,))
    result = results[10]
    announced = result["first announcement (s after kill)"]
    assert announced <= result["first hand-over (s after kill)"]
    assert result["first hand-over (s after kill)"] <= result["all Owned again (s after kill)"]
    (figure,) = failover_bench.figures(results)
    assert figure.value == result["all Owned again (s after kill)"]
    assert figure.baseline == failover_bench.GOAL_S
    assert failover_bench.table(results).row_count == 1


def test_the_etcd_lease_benchmark_times_keepalives_and_expiries_idle_and_loaded() -> None:
    result = etcd_lease_bench.run(samples=20, writers=2)
    for phase in ("idle", "2 writers"):
        p50, p99 = result[f"{phase}: keepalive p50 (ms)"], result[f"{phase}: keepalive p99 (ms)"]
        assert 0 < p50 <= p99 <= result[f"{phase}: keepalive max (ms)"]
        # etcd expires a lease on a 500 ms tick after its TTL.
        ttl = etcd_lease_bench.TTL_S
        shortest = result[f"{phase}: expiry after last renewal, min (s)"]
        assert ttl - 0.1 <= shortest <= result[f"{phase}: expiry after last renewal, max (s)"]
        assert result[f"{phase}: expiry after last renewal, max (s)"] < ttl + 2
    assert result["2 writers: puts per second"] > 0


def test_the_assignment_benchmark_measures_one_at_a_time_and_in_bulk_both_ways() -> None:
    result = assign_bench.run(
        bundles=220, sequential=20, concurrency=8, per_call=32, calls_in_flight=2
    )
    assert 0 < result["one at a time: p50 ms"] <= result["one at a time: p99 ms"]
    assert result["in bulk: bundles each way"] == 66
    singly = result["in bulk (8 Lookups in flight): assignments/s"]
    gathered = result["in bulk (LookupBatcher, 8 lookups in flight): assignments/s"]
    many = result["in bulk (LookupMany of 32, 2 in flight): assignments/s"]
    assert singly > 0 and gathered > 0 and many > 0
    one_at_a_time, *in_bulk = assign_bench.figures(result)
    assert one_at_a_time.value == result["one at a time: p99 ms"]
    assert [(f.value, f.baseline) for f in in_bulk] == [
        (singly, assign_bench.BULK_GOAL_PER_S),
        (gathered, assign_bench.BULK_GOAL_PER_S),
        (many, assign_bench.BULK_GOAL_PER_S),
    ]


def test_the_scale_benchmark_measures_each_size_and_sets_lookups_against_the_smallest() -> None:
    result = scale_bench.run(
        sizes=(300, 1_200), profiles=("dev",), brokers=10, sidecars=2, idle_s=3, lookups=300
    )
    for size in ("300", "1,200"):
        assert result[f"dev {size}: idle: fences"] == 0
        assert result[f"dev {size}: idle: channel changes applied (all sidecars)"] == 0
        assert 0 < result[f"dev {size}: lookup p50 ms"] <= result[f"dev {size}: lookup p99 ms"]
        assert result[f"dev {size}: idle: sidecar RSS MiB, max"] > 20
        assert result[f"dev {size}: catch-up: sidecar start (checkpoint), slowest s"] > 0
    (figure,) = scale_bench.figures(result)
    assert figure.value == result["dev 1,200: lookup p99 ms"]
    assert figure.baseline == result["dev 300: lookup p99 ms"]
