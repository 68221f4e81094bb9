"""``threshold_shedder``: Pulsar's ThresholdShedder, the older default, kept for comparison.

A broker whose load is at least ``threshold_shedder_percentage`` points above the average sheds
bundles, largest first, until it has shed enough throughput to end 5 points under that threshold.
It only unloads (no destination): the next lookup places the bundles. With
``lower_boundary_shedding_enabled``, when nothing is over the threshold but some broker is that far
*below* the average, the most loaded broker sheds a little (half the threshold's share of its
throughput) so that the idle broker can pick it up.

Shared with ``transfer_shedder``: the load-data gate (stale data, cool-down, missing data), the
grace period, never moving a broker's last bundle nor a bundle another broker owns, at most
``max_brokers_per_cycle`` brokers shed per cycle (the most loaded first). Only this strategy reads
``min_throughput_threshold`` (MB/s, as Pulsar's ``loadBalancerBundleUnloadMinThroughputThreshold``):
a broker whose planned offload (its latest throughput times the share to shed) is below it is
left alone. The load is the reported
``weighted_max_ema`` (Pulsar's ThresholdShedder smooths the raw usage itself; here the reporter
already did). It carries no state. With nothing to shed, the skip reason is ``HitCount`` (the
shedding condition does not hold), as the TransferShedder reports a balanced cluster.
"""

from __future__ import annotations

import random

from lbd.core.ids import BrokerId, BundleId
from lbd.core.settings import SheddingConfig
from lbd.core.shedding.model import (
    MB,
    DecisionReason,
    LoadSnapshot,
    ShedderState,
    SheddingResult,
    SkipReason,
    UnloadDecision,
    current_throughput,
    usable_load,
)

EXTRA_MARGIN = 0.05
"""Shed down to this far under ``avg + threshold`` (``ADDITIONAL_THRESHOLD_PERCENT_MARGIN``)."""

LOWER_BOUNDARY_MARGIN = 0.5
"""Share of the threshold shed by lower-boundary shedding (``LOWER_BOUNDARY_THRESHOLD_MARGIN``)."""


def threshold_shed(
    snapshot: LoadSnapshot,
    config: SheddingConfig,
    state: ShedderState,
    now_ms: int,
    rng: random.Random,
) -> tuple[SheddingResult, ShedderState]:
    """Run one ThresholdShedder cycle. ``state`` is returned as is; ``rng`` is unused."""
    usable = usable_load(snapshot, config, now_ms)
    avg = usable.avg

    def result(reason: SkipReason | None, decisions: list[UnloadDecision]) -> SheddingResult:
        return SheddingResult(tuple(decisions), reason, avg, usable.std)

    if usable.skip_reason is not None:
        return result(usable.skip_reason, []), state
    loads = {b: d.weighted_max_ema for b, d in usable.loads.items()}
    threshold = config.threshold_shedder_percentage / 100.0
    picker = _BundlePicker(snapshot, config, now_ms)

    overloaded = sorted(
        (b for b, load in loads.items() if load >= avg + threshold),
        key=lambda b: (-loads[b], b),
    )[: config.max_brokers_per_cycle]
    decisions: list[UnloadDecision] = []
    for broker in overloaded:
        share = loads[broker] - avg - threshold + EXTRA_MARGIN
        decisions += picker.pick(broker, current_throughput(usable.loads[broker]) * share)

    if not decisions and config.lower_boundary_shedding_enabled:
        has_idle = any(load < avg - threshold for load in loads.values())
        donors = [
            b
            for b, load in loads.items()
            if load > avg - threshold and len(snapshot.owned_bundles(b)) > 1
        ]
        if has_idle and donors:
            donor = max(donors, key=lambda b: (loads[b], b))
            share = threshold * LOWER_BOUNDARY_MARGIN
            decisions += picker.pick(
                donor,
                current_throughput(usable.loads[donor]) * share,
                DecisionReason.UNDERLOADED,
            )

    if decisions:
        return result(None, decisions), state
    return result(picker.skip_reason(), []), state


class _BundlePicker:
    """Chooses the bundles a broker sheds and remembers why a broker shed nothing."""

    def __init__(self, snapshot: LoadSnapshot, config: SheddingConfig, now_ms: int) -> None:
        self.snapshot = snapshot
        self.config = config
        self.now_ms = now_ms
        self.tried = 0
        self.without_top_bundles = 0

    def pick(
        self,
        broker: BrokerId,
        to_offload: float,
        reason: DecisionReason = DecisionReason.OVERLOADED,
    ) -> list[UnloadDecision]:
        """Largest movable bundles first until ``to_offload`` bytes/s are marked (at least one),
        keeping one bundle on the broker."""
        self.tried += 1
        if to_offload < self.config.min_throughput_threshold * MB:
            return []
        reported = self.snapshot.top_bundles.get(broker, ())
        if not reported:
            self.without_top_bundles += 1
            return []
        left = len(self.snapshot.owned_bundles(broker))
        marked = 0.0
        chosen: list[BundleId] = []
        for bundle in sorted(reported, key=lambda b: (-b.msg_throughput, b.bundle)):
            if left <= 1 or (chosen and marked >= to_offload):
                break
            if self.snapshot.owner_of(bundle.bundle, broker) != broker:
                continue
            if self.snapshot.in_grace_period(bundle.bundle, self.config, self.now_ms):
                continue
            chosen.append(bundle.bundle)
            marked += bundle.msg_throughput
            left -= 1
        return [UnloadDecision(b, broker, None, reason) for b in chosen]

    def skip_reason(self) -> SkipReason:
        """Why nothing was picked: no broker to shed from, or none could give anything."""
        if self.without_top_bundles:
            return SkipReason.NO_LOAD_DATA
        if self.tried:
            return SkipReason.NO_BUNDLES
        return SkipReason.HIT_COUNT
