"""The sidecar's Prometheus metrics (DESIGN §10): Pulsar's ``lb_*`` families, prefixed ``lbd_``.

One :class:`Metrics` object owns one :class:`~prometheus_client.CollectorRegistry` (never the
process-wide default), so every sidecar in a test process, and every test, has its own. The
composition root builds it and hands it to the services; each family is a public attribute that
its writer updates. Label values are closed sets (Pulsar's result and reason names, channel
states), so the number of series stays bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Final, Generic, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from lbd.core.audit import FindingKind
from lbd.core.load import BrokerLoadData
from lbd.core.shedding import DecisionReason, SheddingResult, SkipReason, UnloadDecision
from lbd.core.split import SplitReason
from lbd.core.state import ServiceUnitState
from lbd.core.table import Outcome

SUCCESS: Final = "Success"
"""``result`` label of a decision carried out (Pulsar's ``Success``)."""
SKIP: Final = "Skip"
"""``result`` label of a cycle that decided nothing (Pulsar's ``Skip``)."""
FAILURE: Final = "Failure"
"""``result`` label of a decision that could not be carried out (Pulsar's ``Failure``)."""
CANCEL: Final = "Cancel"
"""``result`` label of a cleanup called off (the broker came back before its grace ran out)."""

ADMIN_REASON: Final = "Admin"
"""``reason`` label of operations an operator asked for (Assign, Transfer, Unload, Split RPCs)."""
UNKNOWN_REASON: Final = "Unknown"
"""``reason`` label of failures with no better name (Pulsar's ``Unknown``)."""

TOMBSTONE_STATE: Final = "Tombstone"
"""``state`` label of an empty channel value."""

CLEANUP_KINDS: Final = ("orphan", "inflight", "tombstone")
"""``kind`` label of the leader monitor's cleanup operations."""

UNDECODABLE: Final = "undecodable"
"""``kind`` label of a request whose bytes are not a message of the method's type."""
INVALID_ARGUMENT: Final = "invalid_argument"
"""``kind`` label of a request refused as invalid (a bad topic name, a bad broker message...)."""
CANCELLED: Final = "cancelled"
"""``kind`` label of a call its client cancelled or dropped before the end (not by a deadline,
not by the server stopping)."""

RESOURCE_FEATURES: Final = (
    "max_ema",
    "max",
    "cpu",
    "memory",
    "direct_memory",
    "bandwidth_in",
    "bandwidth_out",
)
"""``feature`` label of ``lbd_resource_usage`` (Pulsar's ``lb_resource_usage`` features)."""

LATENCY_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Seconds: ownership moves take milliseconds when all is well and tens of seconds when a broker
is slow to acknowledge (release timeout 10 s, in-flight timeout 30 s by default)."""

UNAVAILABILITY_BUCKETS: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
"""Seconds a transferred bundle went unserved: a healthy hand-over takes milliseconds."""


class FollowerCounts(Protocol):
    """What :meth:`Metrics.track_follower` reads (the follower's ``FollowerStats``)."""

    accepted: int
    rejected: int
    duplicate: int
    malformed: int


class _FollowerCollector(Collector):
    """Exposes a follower's running counts without the follower knowing about Prometheus."""

    def __init__(self, stats: FollowerCounts) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self._stats
        family = CounterMetricFamily(
            "lbd_channel_follower_messages",
            "State-channel messages the follower handled, by outcome "
            "(accepted, rejected by the resolver, duplicate delivery, malformed).",
            labels=["outcome"],
        )
        for outcome in Outcome:
            family.add_metric([outcome.value], getattr(stats, outcome.value))
        yield family


_Family = TypeVar("_Family", Counter, Gauge)


class Series(Generic[_Family]):
    """A labelled family's series, each made once: ``labels()`` validates its arguments and
    takes a lock on every call, which adds up on paths that count every bundle's change."""

    def __init__(self, family: _Family) -> None:
        self._family: _Family = family
        self._series: dict[tuple[str, ...], _Family] = {}

    def __call__(self, *values: str) -> _Family:
        """The series with these label values, in the family's label order."""
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = self._family.labels(*values)
        return series


class Metrics:
    """Every ``lbd_*`` family, registered on a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._decisions_families(self.registry)
        self._load_families(self.registry)
        self._channel_families(self.registry)
        self._latencies_families(self.registry)
        self._leadership_families(self.registry)
        self._operating_families(self.registry)
        self._auditor_families(self.registry)
        self._grpc_families(self.registry)
        self._init_series()

    def _decisions_families(self, r: CollectorRegistry) -> None:
        """Decisions (Pulsar lb_unload_*, lb_assign_*, lb_bundles_split_* breakdowns)."""
        self.unload_total = Counter(
            "lbd_unload",
            "Unload decisions by result (Success, Skip, Failure) and reason (Overloaded, "
            "Underloaded, Admin; a skip's reason: HitCount, NoBundles, CoolDown, ...).",
            ["result", "reason"],
            registry=r,
        )
        self.assign_total = Counter(
            "lbd_assign",
            "Bundle assignments by result (Success, Empty: no broker to pick, Failure) and "
            "reason (Lookup, Admin, or the failure's name).",
            ["result", "reason"],
            registry=r,
        )
        self.split_total = Counter(
            "lbd_split",
            "Bundle splits by result (Success, Failure) and reason (Topics, Sessions, MsgRate, "
            "Bandwidth, Admin; Unknown for a decision that failed).",
            ["result", "reason"],
            registry=r,
        )

    def _load_families(self, r: CollectorRegistry) -> None:
        """Load (Pulsar lb_resource_usage, lb_resource_usage_stats)."""
        self.resource_usage = Gauge(
            "lbd_resource_usage",
            "This sidecar's broker load (0..1+): max_ema (weighted, smoothed), max, and each "
            "resource's usage fraction.",
            ["feature"],
            registry=r,
        )
        self._resource_usage_series = Series(self.resource_usage)
        self.resource_usage_stats = Gauge(
            "lbd_resource_usage_stats",
            "Average and standard deviation of the brokers' weighted max EMA load, as the "
            "leader's last shedding cycle saw them.",
            ["stat"],
            registry=r,
        )
        self.load_std = Gauge(
            "lbd_load_std",
            "Standard deviation of the brokers' weighted max EMA load at the leader's last "
            "shedding cycle (0 on a sidecar that never led).",
            registry=r,
        )
        self.load_target_std = Gauge(
            "lbd_load_target_std",
            "shedding.target_std, the load std the leader's shedder aims under (set by its "
            "first shedding cycle).",
            registry=r,
        )

    def _channel_families(self, r: CollectorRegistry) -> None:
        """The state channel (Pulsar sunit_state_chn_*)."""
        self.channel_publish_ops = Counter(
            "lbd_channel_publish_ops",
            "Values this sidecar proposed on the state channel, by state and result "
            "(Success: persisted by the log, Failure: the log was unavailable).",
            ["state", "result"],
            registry=r,
        )
        self._publish_series = Series(self.channel_publish_ops)
        self.channel_subscribe_ops = Counter(
            "lbd_channel_subscribe_ops",
            "Accepted state-channel changes this sidecar applied, by the new state.",
            ["state"],
            registry=r,
        )
        self._applied_series = Series(self.channel_subscribe_ops)
        self.channel_cleanup_ops = Counter(
            "lbd_channel_cleanup_ops",
            "The leader monitor's overrides, by kind (orphan: owner left; inflight: stuck "
            "in-flight state; tombstone: old Free/Deleted value) and result (Success, Failure, "
            "Cancel: the broker came back within its grace period).",
            ["kind", "result"],
            registry=r,
        )
        self.cleanup_series = Series(self.channel_cleanup_ops)
        """``channel_cleanup_ops`` by kind and result, each series made once."""
        self.owned_bundles = Gauge(
            "lbd_owned_bundles",
            "Bundles Owned by this sidecar's broker in the channel table.",
            registry=r,
        )
        self.bundles_in_flight = Gauge(
            "lbd_bundles_in_flight",
            "Bundles Assigning, Releasing or Splitting in this sidecar's channel table (every "
            "broker's: each sidecar reads the whole channel).",
            registry=r,
        )
        self.release_ack_timeouts = Counter(
            "lbd_release_ack_timeouts",
            "Releases that moved on without the broker's acknowledgement (DESIGN §5).",
            registry=r,
        )

    def _latencies_families(self, r: CollectorRegistry) -> None:
        """Latencies (Pulsar broker_load_manager_bundle_assigment and friends)."""
        self.assign_latency = Histogram(
            "lbd_assign_latency_seconds",
            "From proposing Assigning to seeing the bundle Owned.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.release_latency = Histogram(
            "lbd_release_latency_seconds",
            "From seeing Releasing(src=me) to its broker's Release acknowledgement (or timeout).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.unload_latency = Histogram(
            "lbd_unload_latency_seconds",
            "From proposing Releasing to the bundle settling (Free, or Owned by the destination).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def _leadership_families(self, r: CollectorRegistry) -> None:
        """Leadership."""
        self.leader_term = Gauge(
            "lbd_leader_term",
            "The term of the leader this sidecar knows of (0: none known).",
            registry=r,
        )
        self.is_leader = Gauge(
            "lbd_is_leader",
            "1 while this sidecar runs the leader duties, else 0.",
            registry=r,
        )
        self.fenced = Gauge(
            "lbd_fenced",
            "1 while this sidecar is fenced (neither its etcd lease nor a channel read barrier "
            "is recent): its broker serves nothing and lookups never name it.",
            registry=r,
        )
        self.fence_total = Counter(
            "lbd_fence",
            "Times this sidecar fenced itself.",
            registry=r,
        )

    def _operating_families(self, r: CollectorRegistry) -> None:
        """Operating: the execution governor, operations, moves."""
        self.governor_queued = Gauge(
            "lbd_governor_moves_queued",
            "Moves waiting for the execution governor, by budget (balancing, recovery); "
            "on the leader.",
            ["budget"],
            registry=r,
        )
        self.governor_queued_series = Series(self.governor_queued)
        self.governor_in_flight = Gauge(
            "lbd_governor_moves_in_flight",
            "Moves the execution governor admitted whose bundle has not settled yet, by budget.",
            ["budget"],
            registry=r,
        )
        self.governor_in_flight_series = Series(self.governor_in_flight)
        self.governor_started = Counter(
            "lbd_governor_moves_started",
            "Moves the execution governor admitted, by budget.",
            ["budget"],
            registry=r,
        )
        self.governor_started_series = Series(self.governor_started)
        """The governor's families by budget, each series made once (set at every move)."""
        self.transfer_unavailable = Histogram(
            "lbd_transfer_unavailable_seconds",
            "Per transfer, the time no broker served the bundle: from the source broker's "
            "Release acknowledgement to the destination's Own acknowledgement (on the "
            "destination's sidecar).",
            buckets=UNAVAILABILITY_BUCKETS,
            registry=r,
        )
        self.operations_active = Gauge(
            "lbd_operations_active",
            "Operations (plan executions, drains, decommissions, admin moves, shedding) still "
            "running on the leader.",
            registry=r,
        )

    def _auditor_families(self, r: CollectorRegistry) -> None:
        """The safety auditor (lbd.services.leader.auditor)."""
        self.audit_findings = Gauge(
            "lbd_audit_findings",
            "The leader's safety auditor's current findings, by kind (stale_owner, "
            "stuck_in_flight, table_divergence, lookup_dead_owner); `lbd ctl audit` says what "
            "to do about each. 0 on the other sidecars.",
            ["kind"],
            registry=r,
        )
        self.audit_runs = Counter(
            "lbd_audit_runs",
            "Audits the leader's safety auditor ran on this sidecar.",
            registry=r,
        )
        self.audit_last_run = Gauge(
            "lbd_audit_last_run_timestamp_seconds",
            "When this sidecar's safety auditor last ran, as the leader (Unix seconds; 0: never).",
            registry=r,
        )
        self.lookup_dead_owner = Counter(
            "lbd_lookup_dead_owner",
            "Lookups this sidecar answered with an owner missing from its broker registry "
            "(clients sent to a broker that left, with no address).",
            registry=r,
        )

    def _grpc_families(self, r: CollectorRegistry) -> None:
        """The gRPC API."""
        self.grpc_client_errors = Counter(
            "lbd_grpc_client_errors",
            "Calls of lbd's services that failed by the client's doing, by method "
            "(lbd.v1.Service/Method) and kind (undecodable: the request is not the method's "
            "message; invalid_argument: a request refused as invalid; cancelled: the client "
            "cancelled or dropped the call).",
            ["method", "kind"],
            registry=r,
        )

    def _init_series(self) -> None:
        # Series Pulsar operators graph exist from the start at zero, not from their first event.
        for reason in (DecisionReason.OVERLOADED, DecisionReason.UNDERLOADED, ADMIN_REASON):
            self.unload_total.labels(result=SUCCESS, reason=reason)
        for skip in SkipReason:
            self.unload_total.labels(result=SKIP, reason=skip.value)
        self.unload_total.labels(result=FAILURE, reason=UNKNOWN_REASON)
        for split_reason in (*(s.value for s in SplitReason), ADMIN_REASON):
            self.split_total.labels(result=SUCCESS, reason=split_reason)
            self.split_total.labels(result=FAILURE, reason=split_reason)
        for kind in CLEANUP_KINDS:
            for result in (SUCCESS, FAILURE):
                self.channel_cleanup_ops.labels(kind=kind, result=result)
        self.channel_cleanup_ops.labels(kind="orphan", result=CANCEL)
        for stat in ("avg", "std"):
            self.resource_usage_stats.labels(stat=stat)
        for feature in RESOURCE_FEATURES:
            self.resource_usage.labels(feature=feature)
        for kind in FindingKind:
            self.audit_findings.labels(kind=kind.value)

    # -- helpers for the writers whose mapping is not one line -------------------------------

    def observe_shedding(
        self,
        result: SheddingResult,
        failed: Collection[UnloadDecision] = (),
        *,
        target_std: float | None = None,
    ) -> None:
        """Count one shedding cycle: each decision carried out (by its reason), each of ``failed``
        (not carried out) as a failure, or the cycle's skip reason; record the loads' avg/std,
        and the std the shedder aims under (``target_std``, when given)."""
        if result.skip_reason is not None:
            self.unload_total.labels(result=SKIP, reason=result.skip_reason.value).inc()
        for decision in result.decisions:
            if decision not in failed:
                self.unload_total.labels(result=SUCCESS, reason=decision.reason.value).inc()
        if failed:
            self.unload_total.labels(result=FAILURE, reason=UNKNOWN_REASON).inc(len(failed))
        self.resource_usage_stats.labels(stat="avg").set(result.avg)
        self.resource_usage_stats.labels(stat="std").set(result.std)
        self.load_std.set(result.std)
        if target_std is not None:
            self.load_target_std.set(target_std)

    def observe_broker_load(self, data: BrokerLoadData) -> None:
        """Set ``lbd_resource_usage`` from this broker's latest load data."""
        u = data.usage
        values = {
            "max_ema": data.weighted_max_ema,
            "max": data.max_resource_usage,
            "cpu": u.cpu.percent() / 100.0,
            "memory": u.memory.percent() / 100.0,
            "direct_memory": u.direct_memory.percent() / 100.0,
            "bandwidth_in": u.bandwidth_in.percent() / 100.0,
            "bandwidth_out": u.bandwidth_out.percent() / 100.0,
        }
        for feature, value in values.items():
            self._resource_usage_series(feature).set(value)

    def observe_leadership(self, *, leading: bool, term: int | None) -> None:
        """Set the leader gauges: whether this sidecar leads, and the term it knows of."""
        self.is_leader.set(1 if leading else 0)
        self.leader_term.set(term or 0)

    def observe_published(self, state: ServiceUnitState | None, *, ok: bool) -> None:
        """Count one proposal on the channel (``state`` None: a tombstone)."""
        label = TOMBSTONE_STATE if state is None else state.value
        self._publish_series(label, SUCCESS if ok else FAILURE).inc()

    def observe_applied(self, state: ServiceUnitState | None, count: int = 1) -> None:
        """Count ``count`` accepted channel changes to ``state`` (None: a tombstone)."""
        label = TOMBSTONE_STATE if state is None else state.value
        self._applied_series(label).inc(count)

    def observe_audit(self, counts: Mapping[FindingKind, int], at_ms: int | None) -> None:
        """Set ``lbd_audit_findings`` to ``counts`` (every kind); with ``at_ms``, count one
        audit that ran then."""
        for kind in FindingKind:
            self.audit_findings.labels(kind=kind.value).set(counts.get(kind, 0))
        if at_ms is not None:
            self.audit_runs.inc()
            self.audit_last_run.set(at_ms / 1000)

    def track_follower(self, stats: FollowerCounts) -> None:
        """Expose the follower's running counts (``ChannelFollower.stats``, read at every scrape)
        as ``lbd_channel_follower_messages_total{outcome}``. Call once per registry."""
        self.registry.register(_FollowerCollector(stats))

    def track_owned_bundles(self, count: Callable[[], int]) -> None:
        """Read ``lbd_owned_bundles`` from ``count`` at every scrape."""
        self.owned_bundles.set_function(count)

    def exposition(self) -> bytes:
        """Every family in the Prometheus text format (what ``/metrics`` serves)."""
        return generate_latest(self.registry)
