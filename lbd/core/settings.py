"""Tunable knobs of the core strategies, as plain frozen dataclasses.

The settings layer (:mod:`lbd.config`) builds these from the TOML file, the environment and flags;
scenario files build :class:`SheddingConfig` from their ``config`` object. Defaults are Pulsar's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from lbd.core.errors import InvalidInputError

MB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class SheddingConfig:
    """Knobs of the unload (shedding) strategies; the shedding keys of DESIGN §9."""

    target_std: float = 0.25
    """Target standard deviation of broker loads (``loadBalancerBrokerLoadTargetStd``)."""
    hit_count_threshold: int = 3
    """Shed once the condition held more than this many cycles in a row (Pulsar's
    ``loadBalancerSheddingConditionHitCountThreshold``: 3 sheds on the 4th cycle, 0 at once)."""
    max_brokers_per_cycle: int = 3
    """Broker pairs (or overloaded brokers) handled per cycle
    (``loadBalancerMaxNumberOfBrokerSheddingPerCycle``)."""
    cooldown_s: int = 180
    """A broker unloaded less than this before its latest load report is left alone."""
    bundle_grace_period_s: int = 1800
    """A bundle unloaded less than this ago is not moved again
    (``loadBalancerSheddingGracePeriodMinutes``, in seconds here)."""
    load_data_ttl_s: int = 1800
    """Load data older than this is stale (``loadBalancerBrokerLoadDataTTLInSeconds``)."""
    transfer_enabled: bool = True
    """Unload with a pre-assigned destination (``loadBalancerTransferEnabled``)."""
    min_throughput_threshold: float = 10.0
    """threshold_shedder only, in MB/s: a planned offload below this is too small to shed
    (``loadBalancerBundleUnloadMinThroughputThreshold``, which only Pulsar's ThresholdShedder
    reads)."""
    overloaded_threshold: float = 0.85
    """A broker whose load is over this is overloaded (0..1)."""
    threshold_shedder_percentage: float = 10.0
    """threshold_shedder only: shed from brokers this many points above the average."""
    lower_boundary_shedding_enabled: bool = False
    """threshold_shedder only: also shed to raise brokers far below the average."""
    max_moves_per_broker: int = 10
    """cluster_planner only: moves in or out of any one broker per cycle, so that no broker (a
    freshly started one above all) takes a burst of transfers at once."""
    avg_shedder_low_threshold: float = 0.15
    """avg_shedder only: a pair of brokers whose loads differ by this much or more (0..1) counts
    a low hit (``loadBalancerAvgShedderLowThreshold``, 15 percentage points)."""
    avg_shedder_high_threshold: float = 0.40
    """avg_shedder only: a pair whose loads differ by this much or more also counts a high hit
    (``loadBalancerAvgShedderHighThreshold``, 40 percentage points)."""
    avg_shedder_hit_count_low_threshold: int = 8
    """avg_shedder only: a pair sheds on the cycle in which a broker of it reaches this many low
    hits in a row (``loadBalancerAvgShedderHitCountLowThreshold``: 8 sheds on the 8th)."""
    avg_shedder_hit_count_high_threshold: int = 2
    """avg_shedder only: a pair sheds on the cycle in which a broker of it reaches this many high
    hits in a row (``loadBalancerAvgShedderHitCountHighThreshold``: 2 sheds on the 2nd)."""
    avg_shedder_unload_share: float = 0.2
    """avg_shedder only: share of a pair's difference in message rate (or throughput) to move
    (``maxUnloadPercentage``); 0.5 evens the pair out, as Pulsar recommends for AvgShedder."""
    avg_shedder_min_unload_msg_rate: float = 1000.0
    """avg_shedder only: in messages/s, the least message rate worth moving; below it the
    throughput decides (``minUnloadMessage``)."""
    avg_shedder_min_unload_throughput: float = 1.0
    """avg_shedder only: in MB/s, the least throughput worth moving when the message rate does
    not decide (``minUnloadMessageThroughput``, 1 MB)."""

    def __post_init__(self) -> None:
        errors = self.errors()
        if errors:
            raise InvalidInputError("invalid shedding config: " + "; ".join(errors))

    def errors(self) -> list[str]:
        """Every out-of-range field, as human sentences (empty when valid)."""
        out: list[str] = []
        if self.target_std <= 0:
            out.append(f"target_std must be > 0, got {self.target_std}")
        if self.hit_count_threshold < 0:
            out.append(f"hit_count_threshold must be >= 0, got {self.hit_count_threshold}")
        if self.max_moves_per_broker < 1:
            out.append(f"max_moves_per_broker must be >= 1, got {self.max_moves_per_broker}")
        if self.max_brokers_per_cycle < 1:
            out.append(f"max_brokers_per_cycle must be >= 1, got {self.max_brokers_per_cycle}")
        for name in ("cooldown_s", "bundle_grace_period_s", "min_throughput_threshold"):
            if getattr(self, name) < 0:
                out.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.load_data_ttl_s <= 0:
            out.append(f"load_data_ttl_s must be > 0, got {self.load_data_ttl_s}")
        if self.overloaded_threshold <= 0:
            out.append(f"overloaded_threshold must be > 0, got {self.overloaded_threshold}")
        if self.threshold_shedder_percentage < 0:
            value = self.threshold_shedder_percentage
            out.append(f"threshold_shedder_percentage must be >= 0, got {value}")
        for name in (
            "avg_shedder_low_threshold",
            "avg_shedder_high_threshold",
            "avg_shedder_min_unload_msg_rate",
            "avg_shedder_min_unload_throughput",
        ):
            if getattr(self, name) < 0:
                out.append(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("avg_shedder_hit_count_low_threshold", "avg_shedder_hit_count_high_threshold"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.avg_shedder_unload_share <= 1:
            value = self.avg_shedder_unload_share
            out.append(f"avg_shedder_unload_share must be > 0 and <= 1, got {value}")
        return out

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The accepted keys, in declaration order."""
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True, slots=True)
class SplitConfig:
    """Knobs of the bundle split decision (Pulsar ``loadBalancerNamespaceBundle*``)."""

    max_topics: int = 1000
    """A bundle with more topics than this is over a limit (``...BundleMaxTopics``)."""
    max_sessions: int = 1000
    """A bundle with more producers plus consumers than this is over a limit; 0 or below (Pulsar's
    -1) turns this limit off (``...BundleMaxSessions``)."""
    max_msg_rate: float = 30000.0
    """Messages/s in plus out above which a bundle is over a limit (``...BundleMaxMsgRate``)."""
    max_bandwidth_mb: float = 100.0
    """MB/s in plus out above which a bundle is over a limit (``...BundleMaxBandwidthMbytes``)."""
    hit_count_threshold: int = 3
    """A bundle splits once it was over a limit more than this many cycles in a row: 3 splits on
    the 4th, 0 on the first (``...BundleSplitConditionHitCountThreshold``)."""
    max_bundles_per_namespace: int = 128
    """No split while a namespace has this many bundles (``loadBalancerNamespaceMaximumBundles``);
    a namespace's own ``max_bundles`` policy takes its place."""
    max_splits_per_cycle: int = 10
    """A cycle stops at this many splits (``loadBalancerMaxNumberOfBundlesToSplitPerCycle``)."""
    algorithm: str = "range_equally_divide"
    """Default split algorithm (DESIGN §2)."""

    def __post_init__(self) -> None:
        positive = (
            "max_topics",
            "max_msg_rate",
            "max_bandwidth_mb",
            "max_bundles_per_namespace",
            "max_splits_per_cycle",
        )
        bad = [
            f"{n} must be > 0, got {getattr(self, n)}" for n in positive if getattr(self, n) <= 0
        ]
        if self.hit_count_threshold < 0:
            bad.append(f"hit_count_threshold must be >= 0, got {self.hit_count_threshold}")
        if bad:
            raise InvalidInputError("invalid split config: " + "; ".join(bad))


@dataclass(frozen=True, slots=True)
class AssignmentConfig:
    """Knobs of bundle assignment (``least_resource_usage_with_weight``)."""

    max_topics_per_broker: int = 50000
    """Brokers serving this many topics or more take no new bundle."""
    load_margin: float = 0.10
    """A broker is "best" when its load EMA + margin <= the average."""
    required_broker_version: str | None = None
    """When set, only brokers reporting this version take new bundles."""

    def __post_init__(self) -> None:
        if self.max_topics_per_broker <= 0:
            raise InvalidInputError(
                f"max_topics_per_broker must be > 0, got {self.max_topics_per_broker}"
            )
        if self.load_margin < 0:
            raise InvalidInputError(f"load_margin must be >= 0, got {self.load_margin}")


@dataclass(frozen=True, slots=True)
class MonitorConfig:
    """Knobs of the leader's ownership monitor (the ``[monitor]`` settings, DESIGN §8)."""

    interval_s: float = 60.0
    """Seconds between two sweeps of the table."""
    inflight_timeout_s: float = 30.0
    """An in-flight state older than this is stuck and gets fixed."""
    tombstone_after_s: float = 3600.0
    """Free and Deleted values older than this are tombstoned."""
    orphan_cleanup_grace_s: float = 1.5
    """A broker away this long has its bundles announced as moving (``Releasing`` from it)."""
    unseen_broker_grace_s: float = 30.0
    """The grace instead, when at least as long, of a broker this sidecar never saw registered
    (a cluster starting, its brokers attaching one by one)."""

    @property
    def unseen_extra_s(self) -> float:
        """What a broker never seen registered waits on top of the orphan grace."""
        return max(0.0, self.unseen_broker_grace_s - self.orphan_cleanup_grace_s)


@dataclass(frozen=True, slots=True)
class Budget:
    """Limits on one kind of move (``[governor]``); 0 turns a limit off."""

    per_broker: int
    """Moves in flight at once into or out of one broker."""
    cluster: int
    """Moves in flight at once in the whole cluster."""
    per_minute: int
    """Moves started in any 60 s."""

    def __post_init__(self) -> None:
        for name in ("per_broker", "cluster", "per_minute"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise InvalidInputError(
                    f"{name} must be an integer >= 0 (0: no limit), got {value!r}"
                )


@dataclass(frozen=True, slots=True)
class GovernorConfig:
    """The execution governor's budgets: every move of a bundle passes it (docs/operating.md)."""

    balancing: Budget = field(
        default_factory=lambda: Budget(per_broker=4, cluster=16, per_minute=600)
    )
    """Shedding, plans, drains and admin moves."""
    recovery: Budget = field(
        default_factory=lambda: Budget(per_broker=512, cluster=2048, per_minute=0)
    )
    """The leader's repair of orphans (bundles of gone brokers), which nobody serves meanwhile.
    512 per broker is two Own batches (``OWN_BATCH_MAX``): a broker takes one while the next is
    on its way."""


@dataclass(frozen=True, slots=True)
class OperationsConfig:
    """Plans, operations, the auditor and the decision log of the leader (``[operations]``)."""

    auto_shedding: bool = True
    """The leader executes its own shedding decisions each cycle; False: only on Execute."""
    plan_ttl_s: float = 600.0
    """A plan from Rebalance may be executed for this long."""
    keep_finished: int = 100
    """Finished operations kept for list and get."""
    keep_decisions: int = 1000
    """Decisions kept for ``lbd ctl decisions``."""
    audit_interval_s: float = 30.0
    """How often the safety auditor checks the table, the registry and the sidecars' digests."""


@dataclass(frozen=True, slots=True)
class SidecarTimings:
    """How long a sidecar waits for each thing, in seconds. Each is a setting; the settings layer
    checks the invariants that tie them together (:mod:`lbd.config.invariants`)."""

    own_ack_timeout_s: float = 3.0
    """The broker's acknowledgement of Own (``broker.own_ack_timeout_s``)."""
    release_ack_timeout_s: float = 3.0
    """The broker's acknowledgement of Release (``broker.release_ack_timeout_s``)."""
    settle_timeout_s: float = 30.0
    """A lookup or an operation waiting for its bundle to settle
    (``assignment.settle_timeout_s``)."""
    fence_after_s: float = 3.0
    """How long the sidecar vouches on its etcd lease after its last renewal
    (``etcd.fence_after_s``)."""
    channel_fence_after_s: float = 1.5
    """How long it vouches on the channel after the start of its last read barrier
    (``etcd.channel_fence_after_s``)."""
    fence_check_interval_s: float = 0.25
    """How often the read barrier runs while the etcd lease is in doubt (every half
    ``channel_fence_after_s`` while it is sound), and a fenced sidecar looks whether it may
    unfence (``etcd.fence_check_interval_s``)."""
    retry_s: float = 1.0
    """Pause before retrying a write that met an outage (``etcd.retry_s``)."""
    serving_lease_s: float = 2.0
    """The broker's serving lease (``broker.serving_lease_s``)."""
    lease_margin_s: float = 1.0
    """Added to every wait for a granted lease to run out (``etcd.fence_margin_s``)."""
    startup_timeout_s: float = 6.0
    """Start-up gives up after this, naming the step (``cluster.startup_timeout_s``); reading
    the channel, after this without a new message."""
    publish_timeout_s: float = 2.0
    """A channel write not taken within this fails as unavailable (``pulsar.publish_timeout_s``)."""
    silence_timeout_s: float = 6.0
    """An attached broker silent this long is deregistered (``broker.silence_timeout_s``)."""

    def __post_init__(self) -> None:
        bad = [
            f"{f.name} must be > 0, got {getattr(self, f.name)}"
            for f in fields(self)
            if not getattr(self, f.name) > 0
        ]
        if bad:
            raise InvalidInputError("invalid sidecar timings: " + "; ".join(bad))

    @property
    def handover_wait_s(self) -> float:
        """How long the leader waits, after it saw a move off a gone broker announced
        (``Releasing`` from it), before it tells the new broker: the owner's sidecar stops
        vouching on the channel ``channel_fence_after_s`` after its last read barrier, and the
        last lease it granted runs out ``serving_lease_s`` (plus ``lease_margin_s``) later. A
        sidecar that read the announcement grants nothing more until its Release is sent, and
        the broker stops serving the bundle when the Release arrives; the lease ground is paid
        for by the orphan grace (docs/safety.md)."""
        return self.channel_fence_after_s + self.serving_lease_s + self.lease_margin_s


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    """Everything one sidecar's services are configured with, as plain values.

    Built from the settings by :meth:`lbd.config.Settings.sidecar_config`; tests and the
    simulator build it directly. The wiring (:func:`lbd.services.graph.build_sidecar`) hands each
    service only its part.
    """

    auto_ack: bool = False
    """Acknowledge broker commands when no broker is attached (demos, benchmarks)."""
    channel_batch_max_values: int = 256
    """Most values one state-channel message carries (``pulsar.channel_batch_max_values``)."""
    default_namespace_bundles: int = 4
    """Bundles of a namespace created without a count, and of ``public/default``."""
    timings: SidecarTimings = field(default_factory=SidecarTimings)
    assignment: AssignmentConfig = field(default_factory=AssignmentConfig)
    shedding: SheddingConfig = field(default_factory=SheddingConfig)
    shedding_strategy: str = "cluster_planner"
    """A key of :data:`lbd.core.shedding.STRATEGIES`."""
    shedding_interval_s: float = 60.0
    split: SplitConfig = field(default_factory=SplitConfig)
    split_interval_s: float = 60.0
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    checkpoint_interval_s: float = 300.0
    load_report_interval_s: float = 10.0
    top_bundles_per_report: int = 10
    governor: GovernorConfig = field(default_factory=GovernorConfig)
    operations: OperationsConfig = field(default_factory=OperationsConfig)
