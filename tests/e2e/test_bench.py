"""The sidecar benchmark runs end to end (``make bench`` must not rot), on small inputs."""

import pytest

from bench import operating_bench, sidecar_bench

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]


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
