"""What a simulated run is: its spec, the faults a seed schedules, the settings every sidecar of
the world runs with, and the outcome a run returns (:mod:`lbd.simulation.world` plays it)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from lbd.core.settings import (
    MonitorConfig,
    SheddingConfig,
    SidecarConfig,
    SidecarTimings,
    SplitConfig,
)
from lbd.simulation.mutations import MUTATIONS

HELD = (
    "pause-sidecar",
    "isolate-sidecar",
    "crash-sidecar",
    "pause-broker",
    "etcd-down",
    "etcd-cut-one",
    "channel-down",
    "channel-cut-one",
)
"""Faults that hold for a while (the others happen at one instant)."""
CLUSTER_WIDE = ("etcd-down", "channel-down")

TIMINGS = SidecarTimings(settle_timeout_s=10.0)
"""The defaults (``lbd.config``'s, the same as :class:`SidecarTimings`'), but a shorter settle
timeout for lookups: ten virtual minutes see many leases, graces and hand-overs lapse."""
LEASE_TTL_S = 3
KEEPALIVE_S = 0.8
CONFIG = SidecarConfig(
    timings=TIMINGS,
    monitor=MonitorConfig(
        interval_s=3.0,
        inflight_timeout_s=16.0,
        tombstone_after_s=3600.0,
        orphan_cleanup_grace_s=1.5,
        unseen_broker_grace_s=1.5,
    ),
    shedding=SheddingConfig(
        target_std=0.04,
        hit_count_threshold=1,
        cooldown_s=60,
        bundle_grace_period_s=60,
        load_data_ttl_s=150,
        min_throughput_threshold=1.0,
    ),
    shedding_interval_s=60.0,
    split=SplitConfig(max_msg_rate=5_000.0, hit_count_threshold=1, max_bundles_per_namespace=24),
    split_interval_s=30.0,
    checkpoint_interval_s=30.0,
    load_report_interval_s=60.0,
    default_namespace_bundles=8,
)
REPORT_S = 10.0
"""A broker reports its load this often (well within the sidecar's ``silence_timeout_s``)."""
MAX_DRIFT = 0.01
"""Each host's clock runs at a rate within 1 % of true time (the serving lease's margin,
``lease_margin_s``, covers far more: 1 s on a 2 s lease)."""
MAX_BROKERS = 5
"""Brokers that join take the ids ``broker-1`` .. ``broker-5`` not in use."""
MIN_BROKERS = 3
"""A broker leaves only while more than this many are up."""
ORPHAN_BOUND_S = (
    LEASE_TTL_S
    + CONFIG.monitor.orphan_cleanup_grace_s
    + TIMINGS.handover_wait_s
    + 2 * CONFIG.monitor.interval_s
    + 10.0
)
"""A gone broker's bundles are Owned again within this (with time for a lookup to assign a freed
one)."""
LOOKUP_ATTEMPTS = 15
"""How often a client looks a freed bundle up after the faults, a couple of seconds apart."""
MAX_VIOLATIONS = 20
"""A run stops recording violations after this many (the first say what went wrong)."""


@dataclass(frozen=True, slots=True)
class WorldSpec:
    """One simulated run."""

    seed: int
    virtual_s: float = 600.0
    """The span of the schedule: faults start in its first two thirds. The run ends
    ``ORPHAN_BOUND_S`` after the last of them is over (:attr:`Outcome.virtual_s`)."""
    mean_fault_gap_s: float = 20.0
    brokers: int | None = None
    """3 to 5, chosen by the seed when None."""
    faults: tuple[str, ...] = ()
    """Only these kinds of fault (all when empty): see :data:`FAULTS`."""
    timings: SidecarTimings = TIMINGS
    orphan_grace_s: float = CONFIG.monitor.orphan_cleanup_grace_s
    """``monitor.orphan_cleanup_grace_s``."""
    fault_s: tuple[float, float] = (1.0, 45.0)
    """How long a fault that holds lasts: uniform between these, in virtual seconds."""
    mutation: str = ""
    """A planted bug (:data:`lbd.simulation.mutations.MUTATIONS`) the run must then find; none
    when empty."""


FAULTS = (
    *HELD,
    "redeliver",
    "join",
    "leave",
    "load-swing",
    "transfer",
    "unload",
    "split",
    "drain",
    "plan",
)


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault of a schedule: at ``at_s`` (virtual seconds from the start), ``kind`` hits the
    ``node``-th live broker (by id order) for ``duration_s``."""

    at_s: float
    kind: str
    node: int
    duration_s: float

    def __str__(self) -> str:
        return f"{self.kind}@{self.at_s:.1f}s(node {self.node}, {self.duration_s:.1f}s)"


def schedule(spec: WorldSpec) -> tuple[int, tuple[Fault, ...]]:
    """The brokers and the faults of ``spec``'s seed (its own random stream, so a schedule with
    faults removed runs the rest of the world the same way)."""
    rng = random.Random(f"schedule-{spec.seed}")
    brokers = spec.brokers or rng.randint(3, 5)
    kinds = spec.faults or FAULTS
    faults: list[Fault] = []
    at = rng.expovariate(1.0 / spec.mean_fault_gap_s)
    while at < spec.virtual_s * 2 / 3:
        fault = Fault(at, rng.choice(kinds), rng.randrange(brokers), rng.uniform(*spec.fault_s))
        faults.append(fault)
        at += rng.expovariate(1.0 / spec.mean_fault_gap_s)
    return brokers, tuple(faults)


@dataclass(slots=True)
class Outcome:
    """What a run found."""

    seed: int
    faults: tuple[Fault, ...] = ()
    violations: list[str] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)
    balancing: dict[str, int] = field(default_factory=dict)
    """What the load balancer did on its own: bundles the split scheduler split
    (``scheduled_splits``) and bundles the shedder unloaded or transferred (``shed``)."""
    probes: frozenset[str] = frozenset()
    """The probes of :mod:`lbd.core.probes` the run reached."""
    virtual_s: float = 0.0
    """The virtual seconds the run lasted."""

    @property
    def ok(self) -> bool:
        """Whether every invariant held."""
        return not self.violations


def search_spec(mutation: str, seed: int) -> WorldSpec:
    """The world ``seed`` of the search that finds ``mutation`` (its faults and timings)."""
    m = MUTATIONS[mutation]
    timings = dataclasses.replace(TIMINGS, **m.timings) if m.timings else TIMINGS
    spec = WorldSpec(
        seed,
        virtual_s=m.virtual_s,
        mean_fault_gap_s=m.mean_fault_gap_s,
        fault_s=m.fault_s,
        faults=m.faults,
        timings=timings,
        mutation=mutation,
    )
    if m.orphan_grace_s is not None:
        spec = dataclasses.replace(spec, orphan_grace_s=m.orphan_grace_s)
    return spec
