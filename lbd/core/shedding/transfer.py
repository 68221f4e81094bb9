"""``transfer_shedder``: Pulsar's TransferShedder, the default of Pulsar's extensible load manager.

Goal: bring the standard deviation of broker loads (``weighted_max_ema``) under ``target_std`` by
moving bundles from the most loaded brokers to the least loaded ones, a pair at a time.

One cycle:

1. Load data older than ``load_data_ttl_s`` is ignored; a broker cooling down after an unload, no
   usable data, or a broker with no data at all ends the cycle (:func:`usable_load`).
2. The shedding condition: the std is over target, or the least loaded broker is *underloaded*, or
   the most loaded one is *overloaded* (load over ``overloaded_threshold`` and over avg + target).
   As in Pulsar, it must hold more than ``hit_count_threshold`` cycles in a row (the count is the
   carried :class:`ShedderState`) before anything moves: with the default 3, the fourth cycle in a
   row sheds; 0 sheds at once.
3. Brokers are sorted by load. The most loaded broker is paired with the least loaded one, up to
   ``max_brokers_per_cycle`` pairs, while the projected std is still over target or the pair still
   has an underloaded or overloaded member. Each pair moves about half its load difference: the load
   to move is converted into bytes/s with the source broker's load and latest throughput (Pulsar's
   ``msgThroughputIn + msgThroughputOut``, the time base of the top-bundles report).
4. The source's bundles are taken smallest first until the next one would overshoot. When transfer
   is on, an overshooting bundle may still go if the destination gives some of its own small
   bundles back (a *swap*) so that both end up below the source's current throughput, the
   destination no busier than the source, and the source under 75% of it.
5. Never moved: a bundle another broker owns, one in its grace period, one without traffic, a
   broker's last bundle, one the placement rules (isolation, anti-affinity:
   ``LoadSnapshot.allowed_destinations``) keep off the pair's destination (for a plain unload too,
   as Pulsar's ``isTransferable``). Like Pulsar's, this strategy does not read
   ``min_throughput_threshold`` (only ``threshold_shedder`` does): a CPU-bound broker with little
   traffic sheds too, and small bundles move.

Pulsar's ``TransferShedderTest`` scenarios are ported twice: as scenario files that ``lbd shed``
runs (``examples/scenarios/pulsar-transfer-shedder/``, each with the output Pulsar's test asserts)
and in ``tests/unit/test_transfer_shedder.py``. Where this differs from Pulsar's code, each with the
test whose scenario shows Pulsar wrong there:

- the traffic a swap gains back is always counted (Pulsar counts it only when
  ``loadBalancerDebugModeEnabled`` is on, so its decisions change with the log level):
  ``test_a_swap_counts_what_it_gains_whatever_the_log_level``;
- a swap gives back neither a bundle in its grace period (Pulsar's would send a bundle straight
  back to the broker it just left) nor one the destination's report lists but the channel says it
  no longer owns (Pulsar's would transfer a bundle from a broker that does not hold it):
  ``test_a_swap_never_sends_back_a_bundle_in_its_grace_period``,
  ``test_a_swap_never_gives_back_a_bundle_the_destination_no_longer_owns``;
- a broker's bundles are counted from the channel's table as well as from its report (Pulsar
  counts its report only, so a broker whose report predates a move can lose its last bundle, and
  one that gained a bundle since is wrongly held to its sole bundle):
  ``test_a_broker_whose_report_predates_a_move_keeps_its_last_bundle``,
  ``test_bundles_the_channel_gives_a_broker_count_towards_what_it_keeps``;
- a broker whose load data is older than ``load_data_ttl_s`` is left out of the pairs, not only
  out of the statistics (Pulsar still pairs it, so bundles go to a broker whose load it does not
  know): ``test_a_stale_broker_is_left_out_of_the_statistics_and_the_pairs``;
- bundles are taken by their throughput in plus out, smallest first (Pulsar takes them in its
  report's order, which compares throughput in before throughput out, so a large outbound bundle
  listed first stops the pair while a smaller one would fit):
  ``test_bundles_are_tried_by_total_throughput_smallest_first``;
- a source broker at zero load or zero throughput moves nothing (Pulsar divides by its zero load;
  the NaN target lets every bundle but one go):
  ``test_a_source_broker_at_zero_load_moves_nothing``;
- a bundle whose namespace has an isolation or anti-affinity policy moves, to a broker the policy
  allows (Pulsar's default, ``loadBalancerSheddingBundlesWithPoliciesEnabled=false``, never sheds
  it, so the brokers of an isolated namespace are never balanced):
  ``test_a_policy_bound_bundle_moves_to_a_broker_its_policy_allows``;
- equally loaded brokers are ordered by the given ``random.Random``, equally loaded bundles by
  name (Pulsar's order there is its hash maps' iteration order, which it does not define).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence

from lbd.core.ids import BrokerId
from lbd.core.load import BundleLoad
from lbd.core.settings import SheddingConfig
from lbd.core.shedding.model import (
    DecisionReason,
    LoadSnapshot,
    ShedderState,
    SheddingResult,
    SkipReason,
    UnloadDecision,
    UsableLoad,
    current_throughput,
    usable_load,
)

SWAP_MAX_SHARE = 0.75
"""After a swap the source must carry less than this share of its current throughput."""


def transfer_shed(
    snapshot: LoadSnapshot,
    config: SheddingConfig,
    state: ShedderState,
    now_ms: int,
    rng: random.Random,
) -> tuple[SheddingResult, ShedderState]:
    """Run one TransferShedder cycle; return its result and the state for the next cycle."""
    usable = usable_load(snapshot, config, now_ms)
    if usable.skip_reason is not None:
        return _skip(usable.skip_reason, usable), state
    cycle = _Cycle(snapshot, config, usable, now_ms, rng)
    hit_count = state.hit_count + 1 if cycle.condition_holds() else 0
    if hit_count <= config.hit_count_threshold:
        return _skip(SkipReason.HIT_COUNT, usable), ShedderState(hit_count=hit_count)
    decisions = cycle.run()
    if not decisions:
        return _skip(cycle.skip_reason(), usable), ShedderState(hit_count=hit_count)
    result = SheddingResult(
        decisions=tuple(decisions), skip_reason=None, avg=usable.avg, std=usable.std
    )
    return result, ShedderState(hit_count=0)


def _skip(reason: SkipReason, usable: UsableLoad) -> SheddingResult:
    return SheddingResult(decisions=(), skip_reason=reason, avg=usable.avg, std=usable.std)


class _Cycle:
    """The working state of one cycle: projected loads, decisions and skip counters."""

    def __init__(
        self,
        snapshot: LoadSnapshot,
        config: SheddingConfig,
        usable: UsableLoad,
        now_ms: int,
        rng: random.Random,
    ) -> None:
        self.snapshot = snapshot
        self.config = config
        self.data = usable.loads
        self.avg = usable.avg
        self.now_ms = now_ms
        ids = sorted(self.data)
        rng.shuffle(ids)
        # A stable sort after the shuffle: ties in load are broken by the seeded shuffle.
        ids.sort(key=lambda b: self.data[b].weighted_max_ema)
        self.by_load: Sequence[BrokerId] = ids
        self.projected = {b: d.weighted_max_ema for b, d in self.data.items()}
        self.decisions: list[UnloadDecision] = []
        self.brokers_without_top_bundles = 0
        self.brokers_without_movable_bundles = 0

    # -- the rules -------------------------------------------------------------------------

    def _underloaded(self, broker: BrokerId, max_broker: BrokerId) -> bool:
        """Nearly idle: load or throughput well under the average load / the max's throughput."""
        multiplier = min(0.5, max(0.0, self.config.target_std / 2.0))
        data = self.data[broker]
        return (
            data.weighted_max_ema < self.avg * multiplier
            or data.msg_throughput_ema < self.data[max_broker].msg_throughput_ema * multiplier
        )

    def _overloaded(self, broker: BrokerId) -> bool:
        load = self.data[broker].weighted_max_ema
        return load > self.config.overloaded_threshold and load > self.avg + self.config.target_std

    def _projected_std(self) -> float:
        # Pulsar's LoadStats.offload: the mean stays the cycle's average even where a source's
        # projected load is clipped at 0.
        squares = math.fsum(load * load for load in self.projected.values())
        return math.sqrt(abs(squares / len(self.projected) - self.avg * self.avg))

    def condition_holds(self) -> bool:
        """The shedding condition that the hit count counts."""
        lo, hi = self.by_load[0], self.by_load[-1]
        return (
            self._projected_std() > self.config.target_std
            or self._underloaded(lo, hi)
            or self._overloaded(hi)
        )

    def skip_reason(self) -> SkipReason:
        """Why :meth:`run` decided nothing."""
        if self.brokers_without_top_bundles:
            return SkipReason.NO_LOAD_DATA
        if self.brokers_without_movable_bundles:
            return SkipReason.NO_BUNDLES
        return SkipReason.HIT_COUNT

    # -- the plan --------------------------------------------------------------------------

    def run(self) -> list[UnloadDecision]:
        """Pair the most with the least loaded brokers and plan the moves."""
        lo, hi = 0, len(self.by_load) - 1
        pairs = 0
        while pairs < self.config.max_brokers_per_cycle and lo < hi:
            dst, src = self.by_load[lo], self.by_load[hi]
            if self._projected_std() > self.config.target_std:
                reason = DecisionReason.OVERLOADED
            elif self._underloaded(dst, src):
                reason = DecisionReason.UNDERLOADED
            elif self._overloaded(src):
                reason = DecisionReason.OVERLOADED
            else:
                break
            hi -= 1
            # A source with nothing to give is passed over; its destination waits for the next.
            if self._shed_pair(src, dst, reason):
                lo += 1
                pairs += 1
        return self.decisions

    def _movable(self, bundle: BundleLoad, holder: BrokerId, to: BrokerId) -> bool:
        return (
            self.snapshot.owner_of(bundle.bundle, holder) == holder
            and not self.snapshot.in_grace_period(bundle.bundle, self.config, self.now_ms)
            and bundle.msg_throughput > 0
            # As Pulsar's isTransferable, for a plain unload too: the pair's destination must be
            # allowed, although the next lookup may place the bundle elsewhere.
            and self.snapshot.may_move_to(bundle.bundle, to, self.decisions)
        )

    def _allowed_in_order(self, moves: list[UnloadDecision]) -> bool:
        """Whether the placement rules allow each of ``moves`` after the cycle's decisions and
        the moves before it (a swap's bundles were each checked before the others were
        chosen)."""
        done = list(self.decisions)
        for move in moves:
            if move.dst is not None and not self.snapshot.may_move_to(move.bundle, move.dst, done):
                return False
            done.append(move)
        return True

    def _smallest_first(self, broker: BrokerId) -> list[BundleLoad]:
        reported = self.snapshot.top_bundles.get(broker, ())
        return sorted(reported, key=lambda b: (b.msg_throughput, b.bundle))

    def _shed_pair(self, src: BrokerId, dst: BrokerId, reason: DecisionReason) -> bool:
        """Plan the moves of one pair; whether any load moved."""
        src_load = self.data[src].weighted_max_ema
        src_tput = current_throughput(self.data[src])
        dst_tput = current_throughput(self.data[dst])
        if not self.snapshot.top_bundles.get(src):
            self.brokers_without_top_bundles += 1
            return False
        if src_load <= 0 or src_tput <= 0:
            self.brokers_without_movable_bundles += 1
            return False
        offload = (src_load - self.data[dst].weighted_max_ema) / 2
        target = src_tput * offload / src_load

        transfer = self.config.transfer_enabled
        swap_pool = iter([b for b in self._smallest_first(dst) if self._movable(b, dst, src)])
        src_left = len(self.snapshot.owned_bundles(src))
        offloaded = gained = 0.0
        for bundle in self._smallest_first(src):
            if not self._movable(bundle, src, dst):
                continue
            if src_left <= 1:
                break
            tput = bundle.msg_throughput
            if offloaded - gained + tput > target:
                swap = (
                    _find_swap(
                        swap_pool,
                        src_tput=src_tput,
                        src_after=src_tput - offloaded + gained - tput,
                        dst_after=dst_tput + offloaded - gained + tput,
                    )
                    if transfer
                    else None
                )
                if swap is None:
                    break
                backs = [UnloadDecision(back.bundle, dst, src, reason) for back in swap]
                forward = UnloadDecision(bundle.bundle, src, dst, reason)
                if not self._allowed_in_order([*backs, forward]):
                    break  # each was allowed alone, not all of them after one another
                self.decisions.extend(backs)
                for back in swap:
                    gained += back.msg_throughput
            self.decisions.append(
                UnloadDecision(bundle.bundle, src, dst if transfer else None, reason)
            )
            offloaded += tput
            src_left -= 1

        if offloaded <= 0:
            self.brokers_without_movable_bundles += 1
            return False
        moved_load = (offloaded - gained) * src_load / src_tput
        self.projected[src] = max(0.0, src_load - moved_load)
        self.projected[dst] = self.data[dst].weighted_max_ema + moved_load
        return True


def _find_swap(
    pool: Iterator[BundleLoad],
    *,
    src_tput: float,
    src_after: float,
    dst_after: float,
) -> list[BundleLoad] | None:
    """Bundles of the destination to send back so that an overshooting move still balances.

    ``src_after``/``dst_after`` are the throughputs once the overshooting bundle has moved. Takes
    bundles from ``pool`` (smallest first; what it looks at is used up, as in Pulsar) while both
    sides stay under ``src_tput``, and succeeds once the destination is no busier than the source
    and the source is under :data:`SWAP_MAX_SHARE` of ``src_tput``. None when that never happens.
    """
    picked: list[BundleLoad] = []
    for candidate in pool:
        tput = candidate.msg_throughput
        if src_after + tput < src_tput and dst_after - tput < src_tput:
            picked.append(candidate)
            src_after += tput
            dst_after -= tput
            if dst_after <= src_after and src_after < src_tput * SWAP_MAX_SHARE:
                return picked
    return None
