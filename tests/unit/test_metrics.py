"""The Prometheus families: names, labels and the text format, on a registry of their own."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BrokerUsage, ResourceUsage, ResourceWeights
from lbd.core.shedding import DecisionReason, SheddingResult, SkipReason, UnloadDecision
from lbd.core.state import ServiceUnitState
from lbd.metrics import Metrics
from lbd.services.channel.follower import FollowerStats


def samples(metrics: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the text exposition, by (name, labels)."""
    text = metrics.exposition().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, frozenset(labels.items()))]


def test_every_family_is_exposed_with_its_labels_from_the_start() -> None:
    got = samples(Metrics())
    names = {name for name, _ in got}
    for expected in (
        "lbd_unload_total",
        "lbd_split_total",
        "lbd_resource_usage",
        "lbd_resource_usage_stats",
        "lbd_channel_cleanup_ops_total",
        "lbd_owned_bundles",
        "lbd_release_ack_timeouts_total",
        "lbd_assign_latency_seconds_bucket",
        "lbd_release_latency_seconds_count",
        "lbd_unload_latency_seconds_sum",
        "lbd_leader_term",
        "lbd_is_leader",
    ):
        assert expected in names, expected
    assert got[("lbd_unload_total", frozenset({("result", "Skip"), ("reason", "HitCount")}))] == 0
    assert ("lbd_resource_usage_stats", frozenset({("stat", "std")})) in got
    cleanup = "lbd_channel_cleanup_ops_total"
    kinds = {dict(labels)["kind"] for name, labels in got if name == cleanup}
    assert kinds == {"orphan", "inflight", "tombstone"}


def test_two_instances_do_not_share_series() -> None:
    first, second = Metrics(), Metrics()
    first.release_ack_timeouts.inc()
    assert value(first, "lbd_release_ack_timeouts_total") == 1
    assert value(second, "lbd_release_ack_timeouts_total") == 0


def test_a_shedding_cycle_counts_its_decisions_or_its_skip_reason_and_sets_avg_std() -> None:
    metrics = Metrics()
    bundle = BundleId("public/default/0x00000000_0x40000000")
    moved = UnloadDecision(bundle, BrokerId("a"), BrokerId("b"), DecisionReason.OVERLOADED)
    other = BundleId("public/default/0x40000000_0x80000000")
    not_moved = UnloadDecision(other, BrokerId("a"), None, DecisionReason.UNDERLOADED)
    decided = SheddingResult(decisions=(moved, not_moved), skip_reason=None, avg=0.5, std=0.3)
    metrics.observe_shedding(decided, failed=[not_moved])
    metrics.observe_shedding(SheddingResult((), SkipReason.COOL_DOWN, 0.4, 0.1))
    assert value(metrics, "lbd_unload_total", result="Success", reason="Overloaded") == 1
    assert value(metrics, "lbd_unload_total", result="Success", reason="Underloaded") == 0
    assert value(metrics, "lbd_unload_total", result="Failure", reason="Unknown") == 1
    assert value(metrics, "lbd_unload_total", result="Skip", reason="CoolDown") == 1
    assert value(metrics, "lbd_resource_usage_stats", stat="avg") == 0.4
    assert value(metrics, "lbd_resource_usage_stats", stat="std") == 0.1


def test_broker_load_leadership_and_channel_ops() -> None:
    metrics = Metrics()
    usage = BrokerUsage(cpu=ResourceUsage(60, 100), memory=ResourceUsage(20, 100))
    data = BrokerLoadData(BrokerId("a")).update(usage, ResourceWeights(), now_ms=1)
    metrics.observe_broker_load(data)
    metrics.observe_leadership(leading=True, term=7)
    metrics.observe_published(ServiceUnitState.Releasing, ok=True)
    metrics.observe_published(None, ok=False)
    metrics.observe_applied(ServiceUnitState.Owned)
    assert value(metrics, "lbd_resource_usage", feature="max_ema") == 0.6
    assert value(metrics, "lbd_resource_usage", feature="memory") == 0.2
    assert value(metrics, "lbd_is_leader") == 1 and value(metrics, "lbd_leader_term") == 7
    assert value(metrics, "lbd_channel_publish_ops_total", state="Releasing", result="Success") == 1
    assert value(metrics, "lbd_channel_publish_ops_total", state="Tombstone", result="Failure") == 1
    assert value(metrics, "lbd_channel_subscribe_ops_total", state="Owned") == 1


def test_follower_counts_and_owned_bundles_are_read_at_scrape_time() -> None:
    metrics = Metrics()
    stats = FollowerStats()
    owned = [3]
    metrics.track_follower(stats)
    metrics.track_owned_bundles(lambda: owned[0])
    stats.accepted, stats.malformed = 5, 1
    owned[0] = 4
    assert value(metrics, "lbd_channel_follower_messages_total", outcome="accepted") == 5
    assert value(metrics, "lbd_channel_follower_messages_total", outcome="malformed") == 1
    assert value(metrics, "lbd_channel_follower_messages_total", outcome="duplicate") == 0
    assert value(metrics, "lbd_owned_bundles") == 4


def test_latency_histograms_observe_seconds() -> None:
    metrics = Metrics()
    metrics.assign_latency.observe(0.2)
    assert value(metrics, "lbd_assign_latency_seconds_count") == 1
    assert value(metrics, "lbd_assign_latency_seconds_bucket", le="0.25") == 1
    assert value(metrics, "lbd_assign_latency_seconds_bucket", le="0.1") == 0
