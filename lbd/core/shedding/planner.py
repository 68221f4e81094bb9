"""``cluster_planner``: lbd's own strategy, planning the whole cycle's moves over the whole cluster.

Pulsar's strategies look at brokers a pair (TransferShedder, AvgShedder) or one (ThresholdShedder)
at a time, read load from an average that trails each move by several reports, and then stop every
broker for a cool-down so that the average can catch up. This strategy instead *estimates* where
each broker's load is now, and plans every move of the cycle against that estimate, one move at a
time, each the one that lowers the cluster's load variance most. docs/balancing.md gives the
design and the figures of the scenario suite (``lbd bench balance``).

The estimate (:func:`estimate`):

1. **Load per byte.** A broker's ``weighted_max_ema`` over its ``msg_throughput_ema`` is what one
   byte/s costs it. It differs between brokers of different sizes, so a move's effect is computed
   on each side with that side's own ratio. A broker without traffic (a new one), or with too
   little to measure it (under :data:`MEASURABLE_SHARE` of the mean broker's throughput: its
   load is then its base cost, and the ratio of a throughput decaying to nothing grows without
   bound), takes the cluster's median ratio, scaled by its network capacity against the
   others' when both are known. When its capacity is not known either (it reports only its
   EMAs), it is *guessed*, and filled at the highest ratio measured: a small broker taken for an
   average one would be filled past the others, its bundles then held by their grace period.
2. **Lag.** The EMA trails the raw load; the latest raw sample (``usage``) does not. A broker's load
   is its EMA moved by the change between its EMA throughput and its latest raw throughput.
3. **Moves not reported yet.** The strategy remembers its own moves (:class:`ShedderState.moves`);
   a move the channel has carried out (the bundle's owner changed) and that is newer than a
   broker's latest report is added to or taken from that broker. So is every other change of
   owner it sees in the table between two cycles (:func:`changes_of_owner`: a lookup placed a
   dead broker's bundle, an operator moved one), at the throughput the earlier cycle knew.

The plan:

- **When.** The cluster needs balancing when the estimated std is over ``target_std``, or a broker
  is overloaded (at or over ``overloaded_threshold`` and over avg + target), or underloaded (under
  ``min(0.5, target_std / 2)`` of the average: nearly empty, e.g. new). A spike must move nothing,
  so the first two must have *lasted*: held more than ``hit_count_threshold`` cycles in a row, as
  in Pulsar, with the imbalance still in what the reports since the previous cycle say
  (:func:`heard`: a broker that reports every few cycles shows one sample for several, and it
  counts once); or shown in what a spike cannot move (:func:`witnessed`: the brokers' EMAs as
  they stood before the imbalance under way began, which a spike under way has not moved, and
  the estimate of any broker whose bundles changed owner since the previous cycle). So an
  imbalance the EMAs already show (the leader's first look at a skewed cluster) or one made by
  placement (a broker left and lookups placed its bundles) is acted on at once, and a change of
  traffic waits out the hit count. An underloaded broker is filled at once, since no spike empties a
  broker. When isolation policies keep the spread from reaching the target (a namespace isolated
  on a few brokers carrying little), the target is the least spread they leave reachable
  (:func:`reachable_spread`), and the cycle's notes say so: a spread the rules make is not chased.
- **What.** Greedy: among the bundles of the most loaded brokers and the least loaded destinations
  the placement rules allow (:attr:`LoadSnapshot.allowed_destinations`, and after the cycle's
  earlier moves :attr:`LoadSnapshot.move_rules`), the move that lowers the projected variance
  most, from a broker above the mean to one below it (for a bundle the rules bind, the mean of
  the brokers it may be on). A spread over target starts a *balancing episode*: moves are repeated
  until the projected std is under the planning goal (three quarters of the target:
  :func:`planning_goal`),
  and the episode goes on, cycle after cycle, until the goal is met (hysteresis). An overloaded
  or underloaded broker alone (the spread under target) is relieved or filled, and the rest of
  the cluster left as it is: every move is one the clients feel. A move that would not lower the
  variance is never made, so the projected std only falls.
- **Limits.** At most ``max_brokers_per_cycle`` source brokers, or a quarter of the brokers when
  that is more (:data:`SOURCE_SHARE`), and ``max_moves_per_broker`` moves in or out of any one
  broker per cycle; never a broker's last bundle; never a bundle in its grace
  period, nor one another broker owns; never a bundle back to a broker it left
  :data:`PING_PONG_WINDOW_MS` ago or less.

Unlike Pulsar there is no cool-down that stops the whole cycle: the estimate already counts what a
cooling broker's report does not show yet. Load data older than ``load_data_ttl_s``, and a
registered broker that has never reported, stop the cycle as in Pulsar.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import HISTORY_PERCENTAGE, BrokerLoadData, BrokerUsage, BundleLoad
from lbd.core.settings import SheddingConfig
from lbd.core.shedding.model import (
    DecisionReason,
    LoadSnapshot,
    PastMove,
    ShedderState,
    SheddingResult,
    SkipReason,
    UnloadDecision,
    current_throughput,
    mean_and_std,
    usable_load,
)

PLAN_MARGIN = 0.75
"""A balancing episode plans down to this share of ``target_std``, so that drift within the target
does not bring the cluster straight back over it. Not lower: every move past the target is a
move the clients feel, and a tighter spread is what a lower ``target_std`` asks for. On seeds 1
to 100 of the generated clusters, 0.75 met every goal on 79 against 67 at 0.5, 76 at 0.65 and
76 at 0.85 (docs/balancing.md)."""
PING_PONG_WINDOW_MS = 3_600_000
"""A bundle never goes back to a broker it left this long ago or less (one hour): a return at
exactly the hour is a ping-pong too, as :func:`lbd.core.balance_metrics.ping_pongs` counts."""
SOURCE_SHARE = 0.25
"""The planner takes moves from up to this share of the brokers in one cycle, or from
``max_brokers_per_cycle`` of them when that is more. Pulsar's three sources a cycle bound a
shedder that moves pairs one at a time; the planner plans one episode of least movement, and three
sources a cycle left a 98-broker cluster 14 cycles filling 42 new brokers (docs/balancing.md)."""
SOURCES_TRIED = 4
"""Most loaded brokers considered as the source of each move."""
DESTINATIONS_TRIED = 6
"""Least loaded brokers considered as the destination of each bundle."""
MEASURABLE_SHARE = 0.05
"""A broker's own load per byte is used only when its throughput EMA is at least this share of
the mean broker's: a broker left with a trickle (its bundles moved away, its EMA decaying) would
otherwise price every byte moved to it as if it cost its whole base load."""
REACH_MARGIN = 0.01
"""When isolation policies raise the least reachable std (:func:`reachable_spread`) by more than
twice this, balancing starts at this over it, and an episode plans down to it: a spread the
rules make is not chased bundle by bundle. On seeds 1-100 of the generated clusters with rules,
0.01 met every goal on 33 of 55 against 31 without it and 27 at 0.04."""
_EPSILON = 1e-12


@dataclass(frozen=True, slots=True)
class Estimate:
    """Each usable broker's estimated current load and its load per byte/s."""

    loads: Mapping[BrokerId, float]
    per_byte: Mapping[BrokerId, float]
    from_memory: int = 0
    """Carried-out moves newer than the latest report of their source or owner: counted from
    the planner's memory (:attr:`ShedderState.moves`), not from the reports."""
    guessed: frozenset[BrokerId] = frozenset()
    """Brokers whose load per byte is the cluster's median, neither measured nor scaled by a
    known capacity (a new broker that reports only its EMAs): of unknown size."""
    worst_per_byte: float = 0.0
    """The highest load per byte measured: what a byte moved to a guessed broker may cost it."""

    def fill_per_byte(self, broker: BrokerId) -> float:
        """The load per byte to fill ``broker`` by: a guessed broker's is taken at the worst, so
        that a small broker is not filled past the others before its reports show its size."""
        if broker in self.guessed:
            return max(self.per_byte[broker], self.worst_per_byte)
        return self.per_byte[broker]

    def after(
        self, decisions: tuple[UnloadDecision, ...], throughput: Mapping[BundleId, float]
    ) -> dict[BrokerId, float]:
        """The loads once ``decisions`` (with a destination) have moved bundles of the given
        throughputs, as the planner projects them (a broker of unknown size filled at
        :meth:`fill_per_byte`)."""
        loads = dict(self.loads)
        for d in decisions:
            if d.dst is None:
                continue
            t = throughput[d.bundle]
            loads[d.src] -= t * self.per_byte[d.src]
            loads[d.dst] += t * self.fill_per_byte(d.dst)
        return loads


def estimate(
    snapshot: LoadSnapshot, loads: Mapping[BrokerId, BrokerLoadData], state: ShedderState
) -> Estimate | None:
    """The estimate of the module docstring over the brokers of ``loads``; None when no broker
    carries traffic (no load per byte is known)."""
    mean_throughput = math.fsum(d.msg_throughput_ema for d in loads.values()) / max(1, len(loads))
    measurable = max(_EPSILON, MEASURABLE_SHARE * mean_throughput)
    known = {
        b: d.weighted_max_ema / d.msg_throughput_ema
        for b, d in loads.items()
        if d.msg_throughput_ema >= measurable and d.weighted_max_ema > 0
    }
    if not known:
        return None
    median = statistics.median(known.values())
    by_capacity = [k * _capacity(loads[b]) for b, k in known.items() if _capacity(loads[b]) > 0]
    per_byte: dict[BrokerId, float] = {}
    guessed: set[BrokerId] = set()
    for broker, data in loads.items():
        if broker in known:
            per_byte[broker] = known[broker]
        elif by_capacity and _capacity(data) > 0:
            per_byte[broker] = statistics.median(by_capacity) / _capacity(data)
        else:
            per_byte[broker] = median
            guessed.add(broker)
    unabsorbed, from_memory = _unabsorbed_moves(snapshot, loads, state)
    estimated: dict[BrokerId, float] = {}
    for broker, data in loads.items():
        now = max(0.0, current_throughput(data) + unabsorbed.get(broker, 0.0))
        if ema_only(data):
            # No raw sample: its top bundles, as they were in its latest report, are a floor.
            reported = math.fsum(
                b.msg_throughput
                for b in snapshot.top_bundles.get(broker, ())
                if snapshot.owner_of(b.bundle, broker) == broker
            )
            now = max(now, reported)
        load = data.weighted_max_ema + per_byte[broker] * (now - data.msg_throughput_ema)
        estimated[broker] = max(0.0, load)
    return Estimate(
        loads=estimated,
        per_byte=per_byte,
        from_memory=from_memory,
        guessed=frozenset(guessed),
        worst_per_byte=max(known.values()),
    )


def ema_only(data: BrokerLoadData) -> bool:
    """Whether the broker's report carries no raw sample, only its EMAs."""
    return data.usage == BrokerUsage()


def _capacity(data: BrokerLoadData) -> float:
    """The broker's network capacity as it reports it (0 when unknown)."""
    return data.usage.bandwidth_in.limit + data.usage.bandwidth_out.limit


def _unabsorbed_moves(
    snapshot: LoadSnapshot, loads: Mapping[BrokerId, BrokerLoadData], state: ShedderState
) -> tuple[dict[BrokerId, float], int]:
    """Per broker, the throughput gained (+) or given (-) by carried-out moves that its latest
    report does not show: all of a move newer than the report; of an older one, when the broker
    reports only its EMAs, the share its EMA has not taken in yet (``HISTORY_PERCENTAGE`` to the
    power of the reports since the move, counted in :attr:`ShedderState.reports`). And how many
    moves are newer than a report of theirs (:attr:`Estimate.from_memory`)."""
    delta: dict[BrokerId, float] = {}
    newer = 0
    for move in state.moves:
        owner = snapshot.owners.get(move.bundle)
        if owner is None or owner == move.src:
            continue  # not carried out (dropped, or still moving)
        if move.dst is not None and owner != move.dst:
            continue  # moved again since, by someone else: the reports will show it
        unreported = False
        for broker, sign in ((move.src, -1.0), (owner, 1.0)):
            data = loads.get(broker)
            if data is None:
                continue
            if data.updated_at_ms <= move.at_ms:
                share = 1.0
                unreported = True
            elif ema_only(data):
                since = sum(1 for t in state.reports.get(broker, ()) if t > move.at_ms)
                share = HISTORY_PERCENTAGE ** max(1, since)
            else:
                continue
            delta[broker] = delta.get(broker, 0.0) + sign * move.throughput * share
        newer += unreported
    return delta, newer


def changes_of_owner(
    snapshot: LoadSnapshot, state: ShedderState, kept: tuple[PastMove, ...]
) -> tuple[PastMove, ...]:
    """The bundles that changed owner since the previous cycle other than by the planner's own
    moves (a lookup placed a dead broker's bundle, an operator moved one): remembered like its
    moves, so that a broker whose report does not show them yet (or whose EMA has not taken them
    in) is still estimated with them. Each is dated at the previous cycle, the latest instant
    known to be before it, and carries the throughput that cycle could tell
    (:attr:`ShedderState.rates_seen`)."""
    if not state.owners_seen:
        return ()
    mine = {(m.bundle, m.src) for m in kept}
    out: list[PastMove] = []
    for bundle, owner in snapshot.owners.items():
        before = state.owners_seen.get(bundle)
        if before is None or before == owner or (bundle, before) in mine:
            continue
        rate = state.rates_seen.get(bundle)
        if rate:
            out.append(PastMove(bundle, before, owner, rate, state.seen_at_ms, own=False))
    return tuple(out)


def bundle_rates(
    snapshot: LoadSnapshot, loads: Mapping[BrokerId, BrokerLoadData]
) -> dict[BundleId, float]:
    """Each bundle of a broker in ``loads`` at the throughput its owner reported for it among
    its top bundles; the owner's other bundles share the rest of its throughput equally."""
    holdings = snapshot.holdings()
    rates: dict[BundleId, float] = {}
    for broker, data in loads.items():
        owned = holdings.get(broker, frozenset())
        top = {
            b.bundle: b.msg_throughput
            for b in snapshot.top_bundles.get(broker, ())
            if b.bundle in owned
        }
        rest = max(0.0, current_throughput(data) - math.fsum(top.values()))
        share = rest / max(1, len(owned) - len(top))
        for bundle in owned:
            rates[bundle] = top.get(bundle, share)
    return rates


def source_limit(config: SheddingConfig, brokers: int) -> int:
    """How many brokers one cycle takes moves from (:data:`SOURCE_SHARE`)."""
    return max(config.max_brokers_per_cycle, math.ceil(SOURCE_SHARE * brokers))


def planning_goal(config: SheddingConfig) -> float:
    """The std a balancing episode plans down to."""
    return config.target_std * PLAN_MARGIN


def reachable_spread(
    snapshot: LoadSnapshot, est: Estimate, rates: Mapping[BundleId, float]
) -> float:
    """The least std the isolation policies leave reachable, when they raise it (0 when they do
    not, or there are none): every bundle, heaviest first, on the least loaded broker it may be
    on, as a placement made from scratch would spread them, once on the brokers the policies
    let it be on and once on any. A namespace isolated on a few brokers keeps them apart from
    the rest: their loads follow its traffic, not the cluster's mean. What both placements share
    (bundles too large to spread, rates the reports do not tell yet) is not the rules' doing,
    and is left to the target."""
    rules = snapshot.move_rules
    if rules is None or not rules.isolates:
        return 0.0
    heaviest = sorted(rates.items(), key=lambda item: (-item[1], item[0]))
    every = frozenset(est.per_byte)

    def hosts(bundle: BundleId) -> frozenset[BrokerId]:
        return (rules.hosts(bundle) & every) or every

    ruled = _spread_placed(heaviest, est.per_byte, hosts)
    anywhere = _spread_placed(heaviest, est.per_byte, lambda _: every)
    return ruled if ruled > anywhere + 2 * REACH_MARGIN else 0.0


def _spread_placed(
    heaviest: Sequence[tuple[BundleId, float]],
    per_byte: Mapping[BrokerId, float],
    hosts: Callable[[BundleId], frozenset[BrokerId]],
) -> float:
    """The std of the loads after placing each bundle in turn on the least loaded of its
    ``hosts``: one heap per distinct set of hosts (a namespace's, the brokers no policy
    reserves), entries of a broker whose load has changed since skipped when they surface."""
    loads = dict.fromkeys(per_byte, 0.0)
    heaps: dict[frozenset[BrokerId], list[tuple[float, BrokerId]]] = {}
    member: dict[BrokerId, list[list[tuple[float, BrokerId]]]] = {b: [] for b in per_byte}
    for bundle, rate in heaviest:
        on = hosts(bundle)
        heap = heaps.get(on)
        if heap is None:
            heap = heaps[on] = [(loads[b], b) for b in sorted(on)]
            heapq.heapify(heap)
            for b in on:
                member[b].append(heap)
        while heap[0][0] != loads[heap[0][1]]:
            heapq.heappop(heap)
        broker = heap[0][1]
        loads[broker] += rate * per_byte[broker]
        for other in member[broker]:
            heapq.heappush(other, (loads[broker], broker))
    return mean_and_std(loads.values())[1]


def plan_shed(
    snapshot: LoadSnapshot,
    config: SheddingConfig,
    state: ShedderState,
    now_ms: int,
    rng: random.Random,
) -> tuple[SheddingResult, ShedderState]:
    """Run one cluster_planner cycle; return its result and the state for the next cycle."""
    previous_ms = state.seen_at_ms
    memory = max(PING_PONG_WINDOW_MS, config.load_data_ttl_s * 1000)
    kept = tuple(m for m in state.moves if now_ms - m.at_ms <= memory)
    kept += changes_of_owner(snapshot, state, kept)
    usable = usable_load(snapshot, config, now_ms)
    state = replace(
        state,
        moves=kept,
        reports=_seen_reports(state.reports, usable.loads),
        owners_seen=snapshot.owners,
        rates_seen=bundle_rates(snapshot, usable.loads) or state.rates_seen,
        seen_at_ms=now_ms,
    )
    notes: list[str] = []

    def skip(reason: SkipReason, hit_count: int) -> tuple[SheddingResult, ShedderState]:
        result = SheddingResult((), reason, usable.avg, usable.std, tuple(notes))
        return result, replace(state, hit_count=hit_count, balancing=False)

    if usable.skip_reason not in (None, SkipReason.COOL_DOWN):
        assert usable.skip_reason is not None
        return skip(usable.skip_reason, state.hit_count)
    est = estimate(snapshot, usable.loads, state)
    if est is None:
        return skip(SkipReason.NO_BUNDLES, 0)
    notes += data_notes(usable.loads, est)
    plan = _Plan(snapshot, config, est, state, now_ms, rng)
    before, owned = state.owned, dict(plan.holding)
    state = replace(state, owned=owned)
    # The reachable spread can only raise the target: a cluster within the goal needs none.
    floor = reachable_spread(snapshot, est, state.rates_seen) if plan.imbalanced(plan.goal) else 0
    if floor > 0:
        plan.target = max(config.target_std, floor + REACH_MARGIN)
        plan.goal = max(plan.goal, floor)
        if plan.target > config.target_std:
            notes.append(
                f"the isolation policies leave a std of {floor:.3f} reachable: balancing "
                f"starts over {plan.target:.3f} and plans down to {plan.goal:.3f}"
            )
    # Hysteresis: a balancing episode under way goes on until the std is under the planning goal.
    goal = plan.goal if state.balancing else plan.target
    spread = plan.imbalanced(goal)
    persistent = spread or bool(plan.overloaded())
    hit_count = state.hit_count + 1 if persistent else 0
    # No spike empties a broker: an underloaded one is filled at once, and the spread it makes
    # is lasting too. What a spike cannot do either (:func:`witnessed`) has lasted.
    underloaded = bool(plan.underloaded())
    shown = persistent and _uneven(
        witnessed(usable.loads, est, before, owned, state.calm), config, goal
    )
    counted = hit_count > config.hit_count_threshold
    # A sample counts once: a broker that has not reported since the previous cycle shows the
    # sample it showed then, and a spike it caught would otherwise count again cycle after cycle.
    stale = (
        persistent
        and counted
        and not _uneven(heard(usable.loads, est, previous_ms, state.calm), config, goal)
    )
    lasting = state.balancing or underloaded or (counted and not stale) or shown
    if stale and not lasting:
        notes.append(
            f"waiting: the imbalance has lasted {hit_count} cycles only in samples already "
            f"counted (brokers that have not reported since the previous cycle)"
        )
    elif persistent and not lasting:
        notes.append(
            f"waiting: the imbalance shows in the latest samples only (a change of traffic, or "
            f"a spike), {hit_count} of the {config.hit_count_threshold + 1} cycles in a row "
            f"the hit count asks"
        )
    elif persistent and shown and not counted:
        notes.append("lasting: the EMAs, or brokers whose bundles changed owner, show it too")
    if not persistent:
        state = replace(state, calm={b: d.weighted_max_ema for b, d in usable.loads.items()})
    if not underloaded and not (persistent and lasting):
        return skip(SkipReason.HIT_COUNT, hit_count)
    # The whole cluster is balanced only when its spread is over target; an overloaded broker
    # alone is relieved, an underloaded one filled, and the rest left as it is.
    balancing = spread and lasting
    decisions = plan.run(balancing)
    if not decisions:
        return skip(plan.skip_reason(), hit_count)
    moves = kept + tuple(
        PastMove(d.bundle, d.src, d.dst, plan.throughput[d.bundle], now_ms) for d in decisions
    )
    result = SheddingResult(tuple(decisions), None, usable.avg, usable.std, tuple(notes))
    # A balancing episode that moved bundles goes on in the next cycle, while the spread is over
    # the planning goal, without waiting out the hit count again.
    return result, replace(state, hit_count=hit_count, moves=moves, balancing=balancing)


REPORTS_KEPT = 64
"""Report times remembered per broker: enough to count the reports since any move whose share an
EMA has not taken in yet (0.9 to the 64th power is 0.1%)."""


def _seen_reports(
    seen: Mapping[BrokerId, tuple[int, ...]], loads: Mapping[BrokerId, BrokerLoadData]
) -> dict[BrokerId, tuple[int, ...]]:
    """``seen`` with each broker's latest report time added (brokers gone are forgotten)."""
    out: dict[BrokerId, tuple[int, ...]] = {}
    for broker, data in loads.items():
        times = seen.get(broker, ())
        if not times or times[-1] != data.updated_at_ms:
            times = (*times, data.updated_at_ms)[-REPORTS_KEPT:]
        out[broker] = times
    return out


def data_notes(loads: Mapping[BrokerId, BrokerLoadData], est: Estimate) -> list[str]:
    """What the planner could not read from the reports, and how it planned instead."""
    notes: list[str] = []
    blind = sorted(b for b, d in loads.items() if ema_only(d))
    if blind:
        named = ", ".join(blind[:5]) + (f" and {len(blind) - 5} more" if len(blind) > 5 else "")
        notes.append(
            f"{len(blind)} of {len(loads)} brokers report only their EMAs ({named}): their "
            f"loads are the EMAs, with the share of the planner's moves an EMA has not taken in "
            f"yet, and at least their top bundles"
        )
    if est.from_memory:
        notes.append(
            f"{est.from_memory} move(s) or change(s) of owner newer than their brokers' latest "
            f"reports, counted from the planner's memory"
        )
    if est.guessed:
        named = ", ".join(sorted(est.guessed)[:5])
        more = f" and {len(est.guessed) - 5} more" if len(est.guessed) > 5 else ""
        notes.append(
            f"{len(est.guessed)} broker(s) of unknown size ({named}{more}: no traffic measured "
            f"yet, no capacity reported): filled at the highest load per byte measured"
        )
    return notes


def witnessed(
    loads: Mapping[BrokerId, BrokerLoadData],
    est: Estimate,
    before: Mapping[BrokerId, int],
    now: Mapping[BrokerId, int],
    calm: Mapping[BrokerId, float],
) -> dict[BrokerId, float]:
    """Each broker's load as far as a spike cannot have made it: its EMA as it stood before the
    imbalance under way began (``calm``: :attr:`ShedderState.calm`), or its EMA now when there is
    none (the first cycles, a broker new since). An EMA weighs the last ten reports or so, but a
    spike of several times a namespace's traffic still moves it by a tenth of the jump a report,
    enough to carry a cluster just under its target over it. A broker whose bundles changed
    since the previous cycle (a lookup placed some there, a broker joined or left, the planner
    moved some) counts with its estimate, since a change of owner is not a spike. ``before`` and
    ``now`` count each broker's bundles in the previous cycle and this one (empty before: the
    first cycle)."""
    out: dict[BrokerId, float] = {}
    for broker, data in loads.items():
        changed = bool(before) and before.get(broker) != now.get(broker)
        out[broker] = est.loads[broker] if changed else calm.get(broker, data.weighted_max_ema)
    return out


def heard(
    loads: Mapping[BrokerId, BrokerLoadData],
    est: Estimate,
    since_ms: int,
    calm: Mapping[BrokerId, float],
) -> dict[BrokerId, float]:
    """Each broker's load as the reports since ``since_ms`` (the previous cycle; 0: none) tell
    it: its estimate when it has reported since; else what it showed before the imbalance under
    way began (``calm``), since its latest sample, spike or not, has been counted already, and
    so has what that sample added to its EMA; its estimate without that sample when there is no
    such cycle (its EMA, moved by what the planner's memory adds)."""
    out: dict[BrokerId, float] = {}
    for broker, data in loads.items():
        load = est.loads[broker]
        if since_ms and data.updated_at_ms <= since_ms:
            lag = current_throughput(data) - data.msg_throughput_ema
            load = calm.get(broker, max(0.0, load - est.per_byte[broker] * lag))
        out[broker] = load
    return out


def _uneven(loads: Mapping[BrokerId, float], config: SheddingConfig, goal: float) -> bool:
    """Whether ``loads`` spread over ``goal`` or hold an overloaded broker."""
    return mean_and_std(loads.values())[1] > goal or bool(_overloaded(loads, config))


def _overloaded(loads: Mapping[BrokerId, float], config: SheddingConfig) -> set[BrokerId]:
    """Brokers at or over the overloaded threshold and over avg + target."""
    avg = mean_and_std(loads.values())[0]
    return {
        b
        for b, load in loads.items()
        if load >= config.overloaded_threshold and load > avg + config.target_std
    }


class _Plan:
    """One cycle's working state: projected loads, what may still move, the decisions."""

    def __init__(
        self,
        snapshot: LoadSnapshot,
        config: SheddingConfig,
        est: Estimate,
        state: ShedderState,
        now_ms: int,
        rng: random.Random,
    ) -> None:
        self.snapshot = snapshot
        self.config = config
        self.per_byte = est.per_byte
        self.fill_per_byte = {b: est.fill_per_byte(b) for b in est.per_byte}
        self.projected = dict(est.loads)
        ids = sorted(self.projected)
        rng.shuffle(ids)  # ties between equally loaded brokers go by the seeded shuffle
        self.order = ids
        self.left = {
            (m.bundle, m.src): m.at_ms
            for m in state.moves
            if m.own and now_ms - m.at_ms <= PING_PONG_WINDOW_MS
        }
        self.throughput: dict[BundleId, float] = {}
        self.movable: dict[BrokerId, list[BundleLoad]] = {}
        self.holding: dict[BrokerId, int] = {}
        self.without_top_bundles = 0
        holdings = snapshot.holdings()
        for broker in self.projected:
            reported = snapshot.top_bundles.get(broker, ())
            if not reported:
                self.without_top_bundles += 1
            self.movable[broker] = [
                b
                for b in reported
                if snapshot.owner_of(b.bundle, broker) == broker
                and not snapshot.in_grace_period(b.bundle, config, now_ms)
                and b.msg_throughput > 0
            ]
            self.throughput.update((b.bundle, b.msg_throughput) for b in reported)
            self.holding[broker] = len(holdings.get(broker, ()))
        self.sources: set[BrokerId] = set()
        self._source_limit = source_limit(config, len(self.order))
        self.moves_of: Counter[BrokerId] = Counter()
        self.decisions: list[UnloadDecision] = []
        self.target = config.target_std
        """The std over which the cluster is balanced: ``target_std``, or just over the least the
        isolation policies leave reachable when that is higher (:func:`reachable_spread`)."""
        self.goal = planning_goal(config)
        """The std a balancing episode plans down to."""

    # -- conditions ----------------------------------------------------------------------------

    def imbalanced(self, goal: float | None = None) -> bool:
        """Whether the projected std is over ``goal`` (the target by default)."""
        std = mean_and_std(self.projected.values())[1]
        return std > (self.target if goal is None else goal)

    def overloaded(self) -> set[BrokerId]:
        """Brokers at or over the overloaded threshold and over avg + target."""
        return _overloaded(self.projected, self.config)

    def underloaded(self) -> set[BrokerId]:
        """Nearly empty brokers (Pulsar's underloaded multiplier of the average)."""
        multiplier = min(0.5, max(0.0, self.config.target_std / 2.0))
        avg = mean_and_std(self.projected.values())[0]
        return {b for b, load in self.projected.items() if load < avg * multiplier}

    def skip_reason(self) -> SkipReason:
        """Why :meth:`run` decided nothing."""
        if self.without_top_bundles == len(self.projected):
            return SkipReason.NO_LOAD_DATA
        return SkipReason.NO_BUNDLES

    # -- the plan ------------------------------------------------------------------------------

    def run(self, balancing: bool) -> list[UnloadDecision]:
        """Add the best move while the cluster still needs one and a move still helps: down to
        the planning goal when ``balancing``, else until no broker is over- or underloaded."""
        goal = self.goal
        while True:
            under = self.underloaded()
            over = self.overloaded()
            if balancing and self.imbalanced(goal):
                sources, destinations = None, None
            elif over:
                sources, destinations = over, None
            elif under:
                sources, destinations = None, under
            else:
                break
            move = self._best_move(sources, destinations, under)
            if move is None:
                break
            self._apply(*move, underloaded=under)
        return self.decisions

    def _best_move(
        self,
        sources: set[BrokerId] | None,
        destinations: set[BrokerId] | None,
        underloaded: set[BrokerId],
    ) -> tuple[BundleLoad, BrokerId, BrokerId] | None:
        n = len(self.projected)
        s1 = math.fsum(self.projected.values())
        s2 = math.fsum(v * v for v in self.projected.values())
        variance = s2 / n - (s1 / n) ** 2
        mean = s1 / n
        best: tuple[float, float, BundleLoad, BrokerId, BrokerId] | None = None
        ascending = sorted(self.order, key=lambda b: self.projected[b])
        means: dict[frozenset[BrokerId], float] = {}
        for src, bundles, only_to in self._sources(ascending[::-1], sources, underloaded):
            ls = self.projected[src]
            to = destinations if only_to is None else only_to
            for bundle in bundles:
                # A bundle the placement rules bind is balanced among the brokers it may be on
                # (an isolated namespace's primaries may all be over the cluster's mean).
                bound = self.snapshot.allowed_destinations.get(bundle.bundle)
                centre = mean if bound is None else self._mean_of(bound | {src}, means)
                if ls <= centre:
                    continue
                t = bundle.msg_throughput
                for dst in self._destination_candidates(ascending, bundle, src, to):
                    out, into = t * self.per_byte[src], t * self.fill_per_byte[dst]
                    ld = self.projected[dst]
                    # Only from above the centre to below it, and never past each other: a
                    # source limited by max_brokers_per_cycle must not be drained to fill
                    # every idle broker.
                    if ld >= centre or ls - out < ld + into:
                        continue
                    d2 = (ls - out) ** 2 - ls * ls + (ld + into) ** 2 - ld * ld
                    gain = variance - ((s2 + d2) / n - ((s1 - out + into) / n) ** 2)
                    if gain <= _EPSILON:
                        continue
                    # The largest gain; between equal gains, the fewer bytes.
                    key = (gain, -t)
                    if best is None or key > best[:2]:
                        best = (gain, -t, bundle, src, dst)
        return None if best is None else best[2:]

    def _mean_of(
        self, brokers: frozenset[BrokerId], means: dict[frozenset[BrokerId], float]
    ) -> float:
        """The mean projected load of ``brokers`` (those the plan knows), remembered in
        ``means`` for the rest of the search."""
        found = means.get(brokers)
        if found is None:
            loads = [self.projected[b] for b in brokers if b in self.projected]
            found = means[brokers] = math.fsum(loads) / len(loads)
        return found

    def _sources(
        self, descending: list[BrokerId], only: set[BrokerId] | None, underloaded: set[BrokerId]
    ) -> list[tuple[BrokerId, Sequence[BundleLoad], set[BrokerId] | None]]:
        """The sources of the next move, each with the bundles to try and where they may go
        (None: wherever the move is allowed): every movable bundle of the
        :data:`SOURCES_TRIED` most loaded brokers; and, of any other broker, the bundles the
        placement rules bind that may go to an underloaded broker, to it only. A bound bundle
        is balanced among the brokers it may be on, so an isolated namespace left on one
        primary when another came back empty must fill that one from a broker under the
        cluster's mean. Only to fill an idle broker: a bound bundle under the mean is no
        reason to move otherwise."""
        allowed = self.snapshot.allowed_destinations
        idle = underloaded if allowed else set()
        out: list[tuple[BrokerId, Sequence[BundleLoad], set[BrokerId] | None]] = []
        tried = 0
        for broker in descending:
            if tried >= SOURCES_TRIED and not idle:
                break
            if not self._may_source(broker, only):
                continue
            if tried < SOURCES_TRIED:
                out.append((broker, self.movable[broker], None))
                tried += 1
                continue
            bound = [
                b for b in self.movable[broker] if not idle.isdisjoint(allowed.get(b.bundle, ()))
            ]
            if bound:
                out.append((broker, bound, idle))
        return out

    def _may_source(self, broker: BrokerId, only: set[BrokerId] | None) -> bool:
        if only is not None and broker not in only:
            return False
        if broker not in self.sources and len(self.sources) >= self._source_limit:
            return False
        return (
            self.moves_of[broker] < self.config.max_moves_per_broker
            and self.holding[broker] > 1
            and bool(self.movable[broker])
        )

    def _destination_candidates(
        self,
        ascending: list[BrokerId],
        bundle: BundleLoad,
        src: BrokerId,
        only: set[BrokerId] | None,
    ) -> list[BrokerId]:
        cap = self.config.max_moves_per_broker
        out: list[BrokerId] = []
        for broker in ascending:
            if broker == src or self.moves_of[broker] >= cap:
                continue
            if only is not None and broker not in only:
                continue
            if not self.snapshot.may_move_to(bundle.bundle, broker, self.decisions):
                continue
            if (bundle.bundle, broker) in self.left:
                continue
            out.append(broker)
            if len(out) == DESTINATIONS_TRIED:
                break
        return out

    def _apply(
        self, bundle: BundleLoad, src: BrokerId, dst: BrokerId, *, underloaded: set[BrokerId]
    ) -> None:
        t = bundle.msg_throughput
        self.projected[src] -= t * self.per_byte[src]
        self.projected[dst] += t * self.fill_per_byte[dst]
        self.movable[src].remove(bundle)
        self.holding[src] -= 1
        self.holding[dst] += 1
        self.sources.add(src)
        self.moves_of[src] += 1
        self.moves_of[dst] += 1
        reason = DecisionReason.UNDERLOADED if dst in underloaded else DecisionReason.OVERLOADED
        target = dst if self.config.transfer_enabled else None
        self.decisions.append(UnloadDecision(bundle.bundle, src, target, reason))
