"""``avg_shedder``: Pulsar's AvgShedder (PIP-364), which evens out pairs of brokers.

One cycle:

1. The load-data gate of every strategy (:func:`usable_load`): stale data is ignored; a broker
   cooling down after an unload, no usable data, or a registered broker with no data at all ends
   the cycle, and the hit counts are carried over untouched.
2. Brokers are ranked by load. The most loaded one is paired with the least loaded one, the second
   most with the second least, and so on; the middle broker of an odd count has no partner.
3. Hit counts, kept per broker in :attr:`ShedderState.broker_hits`: both brokers of a pair whose
   loads differ by at least ``avg_shedder_low_threshold`` count a low hit, and a high hit too when
   the difference is at least ``avg_shedder_high_threshold`` (a high count is cleared when the
   difference falls between the thresholds). A broker in no such pair loses its counts; with no
   such pair in the cluster, every count is cleared. Counts follow brokers, not pairs: a broker
   that is re-paired with another partner keeps counting.
4. A pair sheds once either of its brokers has ``avg_shedder_hit_count_low_threshold`` low hits or
   ``avg_shedder_hit_count_high_threshold`` high hits (the default 2 sheds on the second cycle in
   a row). Both brokers' counts are then cleared, whether or not a bundle can move.
5. What to move: ``avg_shedder_unload_share`` of the pair's difference in message rate (in plus
   out), when that is above ``avg_shedder_min_unload_msg_rate``; otherwise that share of their
   difference in throughput, when above ``avg_shedder_min_unload_throughput`` MB/s; otherwise the
   pair is left alone. The more loaded broker's bundles are taken largest first (in the same unit),
   each one that still fits in what is left to move. Their destination is the paired broker.

The load is the reported ``weighted_max_ema``. Pulsar scores a broker by the weighted maximum of
its resource usages in its latest report, times 100, with no history: AvgShedder relies on the hit
counts alone to ride out spikes. Here the reporter has already smoothed that same weighted maximum
(an EMA, DESIGN §7), so a sudden change reaches the thresholds a few reports later than in Pulsar,
and the hit counts come on top. The thresholds are in load units (0..1): Pulsar's defaults of 15
and 40 points are 0.15 and 0.40. A broker's message rate is that of its latest report, its
throughput the reported EMA (the only one scenario files carry); a bundle's are those of the
broker's latest top-bundles report.

Shared with the other strategies (lbd's additions to Pulsar's AvgShedder): at most
``max_brokers_per_cycle`` pairs shed per cycle, the most distant first (a pair that is due beyond
that keeps its counts and sheds in a later cycle); never a broker's last bundle, a bundle another
broker owns, one in its grace period, or, when transferring, one the placement rules keep off the
destination; ``dst`` is None when ``transfer_enabled`` is off (the next lookup places the bundle,
where Pulsar's AvgShedder, being the placement strategy too, would send it to the paired broker).

Also different from Pulsar's code, on purpose: the message rate decides only when the source's
top-bundles report carries message rates (scenario files and the analytics replay carry
throughput only; Pulsar would pick nothing); brokers of equal load are ranked by id (Pulsar's
comparator truncates score differences to whole points); a difference within rounding error of a
threshold reaches it (0.6 - 0.4 is under 0.2 in floating point, while Pulsar's 60 - 40 is 20); the
counts of brokers without usable data are dropped, not kept until they return.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from lbd.core.ids import BrokerId
from lbd.core.load import BrokerLoadData, BundleLoad
from lbd.core.settings import SheddingConfig
from lbd.core.shedding.model import (
    MB,
    DecisionReason,
    HitCounts,
    LoadSnapshot,
    ShedderState,
    SheddingResult,
    SkipReason,
    UnloadDecision,
    UsableLoad,
    usable_load,
)

TOLERANCE = 1e-9
"""A load difference this close under a threshold reaches it: loads are fractions, and their
differences carry rounding errors that Pulsar's percent scores do not."""


@dataclass(frozen=True, slots=True)
class _Pair:
    """A more loaded broker and the less loaded broker it is paired with."""

    src: BrokerId
    dst: BrokerId


def avg_shed(
    snapshot: LoadSnapshot,
    config: SheddingConfig,
    state: ShedderState,
    now_ms: int,
    rng: random.Random,
) -> tuple[SheddingResult, ShedderState]:
    """Run one AvgShedder cycle; return its result and the state for the next cycle.

    ``rng`` is unused: brokers of equal load are ranked by id, so that the pairs, and the counts
    that build up on them, do not change from one cycle to the next by chance.
    """
    usable = usable_load(snapshot, config, now_ms)
    if usable.skip_reason is not None:
        return _result(usable.skip_reason, [], usable), state
    loads = {b: d.weighted_max_ema for b, d in usable.loads.items()}
    ranked = sorted(loads, key=lambda b: (loads[b], b))
    pairs, hits = _pair_up(ranked, loads, state.broker_hits, config)

    picker = _Picker(snapshot, config, usable.loads, now_ms)
    decisions: list[UnloadDecision] = []
    pairs_due = pairs_shed = 0
    for pair in pairs:
        if not _due(pair, hits, config):
            continue
        if pairs_shed >= config.max_brokers_per_cycle:
            break
        pairs_due += 1
        del hits[pair.src], hits[pair.dst]
        chosen = picker.pick(pair)
        if chosen:
            decisions += chosen
            pairs_shed += 1

    next_state = replace(state, broker_hits=hits)
    if decisions:
        return _result(None, decisions, usable), next_state
    reason = picker.skip_reason() if pairs_due else SkipReason.HIT_COUNT
    return _result(reason, [], usable), next_state


def _result(
    reason: SkipReason | None, decisions: list[UnloadDecision], usable: UsableLoad
) -> SheddingResult:
    return SheddingResult(tuple(decisions), reason, usable.avg, usable.std)


def _pair_up(
    ranked: Sequence[BrokerId],
    loads: Mapping[BrokerId, float],
    previous: Mapping[BrokerId, HitCounts],
    config: SheddingConfig,
) -> tuple[list[_Pair], dict[BrokerId, HitCounts]]:
    """The pairs whose loads differ by at least the low threshold, outermost (most distant)
    first, and every broker's hit counts after this cycle (a broker left out has none)."""
    pairs: list[_Pair] = []
    hits: dict[BrokerId, HitCounts] = {}
    lo, hi = 0, len(ranked) - 1
    while lo < hi:
        dst, src = ranked[lo], ranked[hi]
        gap = loads[src] - loads[dst]
        if gap >= config.avg_shedder_low_threshold - TOLERANCE:
            pairs.append(_Pair(src=src, dst=dst))
            high = gap >= config.avg_shedder_high_threshold - TOLERANCE
            for broker in (src, dst):
                before = previous.get(broker, HitCounts())
                hits[broker] = HitCounts(low=before.low + 1, high=before.high + 1 if high else 0)
        lo += 1
        hi -= 1
    return pairs, hits


def _due(pair: _Pair, hits: Mapping[BrokerId, HitCounts], config: SheddingConfig) -> bool:
    """Whether either broker of ``pair`` has hit a threshold often enough."""
    return any(
        hits[b].low >= config.avg_shedder_hit_count_low_threshold
        or hits[b].high >= config.avg_shedder_hit_count_high_threshold
        for b in (pair.src, pair.dst)
    )


def _msg_rate(data: BrokerLoadData) -> float:
    return data.usage.msg_rate_in + data.usage.msg_rate_out


class _Picker:
    """Chooses the bundles a pair moves and remembers why a pair moved nothing."""

    def __init__(
        self,
        snapshot: LoadSnapshot,
        config: SheddingConfig,
        loads: Mapping[BrokerId, BrokerLoadData],
        now_ms: int,
    ) -> None:
        self.snapshot = snapshot
        self.config = config
        self.loads = loads
        self.now_ms = now_ms
        self.without_top_bundles = 0
        self.without_movable_bundles = 0
        self.picked: list[UnloadDecision] = []
        """Every decision of the cycle so far (the placement rules count them)."""

    def pick(self, pair: _Pair) -> list[UnloadDecision]:
        """The bundles ``pair.src`` gives ``pair.dst``: largest first, each that still fits."""
        reported = self.snapshot.top_bundles.get(pair.src, ())
        if not reported:
            self.without_top_bundles += 1
            return []
        src, dst = self.loads[pair.src], self.loads[pair.dst]
        share = self.config.avg_shedder_unload_share
        to_move = (_msg_rate(src) - _msg_rate(dst)) * share
        traffic: Callable[[BundleLoad], float] = _bundle_msg_rate
        rates_known = any(b.msg_rate > 0 for b in reported)
        if not (rates_known and to_move > self.config.avg_shedder_min_unload_msg_rate):
            to_move = (src.msg_throughput_ema - dst.msg_throughput_ema) * share
            traffic = _bundle_throughput
            if to_move <= self.config.avg_shedder_min_unload_throughput * MB:
                self.without_movable_bundles += 1
                return []

        dst_id = pair.dst if self.config.transfer_enabled else None
        left = len(self.snapshot.owned_bundles(pair.src))
        chosen: list[UnloadDecision] = []
        for bundle in sorted(reported, key=lambda b: (-traffic(b), b.bundle)):
            if left <= 1:
                break
            amount = traffic(bundle)
            if amount <= 0 or amount > to_move or not self._movable(bundle, pair):
                continue
            chosen.append(
                UnloadDecision(bundle.bundle, pair.src, dst_id, DecisionReason.OVERLOADED)
            )
            self.picked.append(chosen[-1])
            to_move -= amount
            left -= 1
        if not chosen:
            self.without_movable_bundles += 1
        return chosen

    def _movable(self, bundle: BundleLoad, pair: _Pair) -> bool:
        snapshot = self.snapshot
        return (
            snapshot.owner_of(bundle.bundle, pair.src) == pair.src
            and not snapshot.in_grace_period(bundle.bundle, self.config, self.now_ms)
            and (
                not self.config.transfer_enabled
                or snapshot.may_move_to(bundle.bundle, pair.dst, self.picked)
            )
        )

    def skip_reason(self) -> SkipReason:
        """Why the pairs that were due moved nothing."""
        if self.without_top_bundles:
            return SkipReason.NO_LOAD_DATA
        return SkipReason.NO_BUNDLES


def _bundle_msg_rate(bundle: BundleLoad) -> float:
    return bundle.msg_rate


def _bundle_throughput(bundle: BundleLoad) -> float:
    return bundle.msg_throughput
