"""Clusters nobody wrote down: balancing scenarios drawn from a seed, and how each strategy fares.

The standard scenarios (:mod:`lbd.workload.scenarios`) are seven clusters a person chose. A
strategy tuned on them may fail on the next one, so :func:`generate` draws a whole cluster and
its history from one seed, on the same load model:

- 3 to 200 brokers (log-uniform: many small clusters, some large), all of one size or of mixed
  sizes (62.5, 125 and 250 MB/s each way);
- 1 to 50 namespaces of 4 to 32 bundles (more when needed for eight bundles per broker); bundle
  traffic log-normal (spread drawn per cluster) or Zipf, no bundle above a quarter of the
  smallest broker (a larger one is a split's work, not a move's); the cluster at 15% to 60% of
  its capacity;
- all brokers reporting a raw sample beside their EMAs, some (a third) or none reporting only
  the EMAs (a broker of another version, or a scenario file); all reporting every cycle, or some
  (a third) only every second or third cycle, so that the leader plans on reports older than its
  last moves;
- a start that is balanced, skewed (a few brokers hold the heaviest bundles) or random;
- one to three disturbances, at least 15 cycles apart: brokers joining, leaving, restarting (gone
  for a few cycles, back empty), a namespace turning hot (2x to 8x), a hot spot moving to another
  namespace;
- placement rules on three clusters in five (:func:`draw_rules`): namespaces isolated on a few
  primary brokers (with or without every other broker as secondary), an anti-affinity group of
  namespaces, or both. The start, and the hand-made placement the targets come from, follow
  them; a transfer they forbid is counted against the strategy that made it.

:func:`evaluate` runs a strategy on one and judges it against a target it can reach: a cluster
whose bundles cannot be spread under ``target_std`` (one bundle larger than a broker's share) is
judged against the spread of the best placement a person could make by hand (each bundle,
heaviest first, on the least loaded broker for its size) plus :data:`SLACK`. It reports the worst
number of cycles from a disturbance until the carried load's std is under that target ("never"
when it is not before the next disturbance or the end), the moves, the final std and the
ping-pongs. :func:`shrink` drops disturbances one at a time while a failure still shows, as the
simulation shrinks its fault schedules.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from lbd.core.assign import BrokerCandidate, PlacementRules
from lbd.core.bundles import NamespaceBundles, parse_bundle_id
from lbd.core.ids import BrokerId, BundleId
from lbd.core.names import NamespaceName
from lbd.core.namespace import IsolationPolicy, NamespacePolicies
from lbd.core.settings import MB, AssignmentConfig, SheddingConfig
from lbd.core.shedding import mean_and_std
from lbd.workload.balance import BalanceScenario, BalanceSim, Event, RunResult

SIZES = (62.5, 125.0, 250.0)
"""Broker sizes, MB/s each way (a 500 Mbit, 1 Gbit and 2 Gbit NIC)."""
SLACK = 0.02
"""How far over the hand-made placement's spread a cluster that cannot reach the target may end."""
MIN_GAP = 15
"""Cycles between two disturbances at the least."""
SETTLE = 30
"""Cycles after the last disturbance."""
MAX_BUNDLES = 4000
BUNDLES_PER_BROKER = 8
"""Bundles per broker at the least."""
LARGEST_SHARE = 0.25
"""The largest bundle's traffic as a share of the smallest broker's capacity."""
ASSIGNMENT = AssignmentConfig()
EMA_ONLY_SHARES = (0.0, 0.0, 1 / 3, 1.0)
"""The share of a cluster's brokers that report only the EMAs, one drawn per cluster."""
LATE_SHARES = (0.0, 0.0, 1 / 3)
"""The share of a cluster's brokers that report only every second or third cycle."""


@dataclass(frozen=True, slots=True)
class Generated:
    """A generated cluster: its scenario, and the target each disturbance is judged against."""

    seed: int
    scenario: BalanceScenario
    targets: tuple[float, ...]
    """One per disturbance (in :attr:`RunResult.disturbed_at` order)."""
    kinds: tuple[str, ...]
    """What each disturbance was."""


@dataclass(frozen=True, slots=True)
class Judged:
    """One strategy on one generated cluster."""

    seed: int
    strategy: str
    brokers: int
    bundles: int
    kinds: tuple[str, ...]
    cycles_to_target: int | None
    """The worst over the disturbances (None: one never got under its target in time)."""
    moves: int
    final_std: float
    ping_pongs: int
    run: RunResult
    forbidden_moves: int = 0
    """Transfers the cluster's placement rules did not allow when they were made."""


def _names(brokers: int, first: int = 1) -> list[BrokerId]:
    return [BrokerId(f"broker-{i}") for i in range(first, first + brokers)]


def _weights(count: int, rng: random.Random) -> list[float]:
    if rng.random() < 0.5:
        sigma = rng.uniform(0.4, 1.4)
        return [rng.lognormvariate(0.0, sigma) for _ in range(count)]
    s = rng.uniform(0.6, 1.2)
    weights = [1.0 / (rank + 1) ** s for rank in range(count)]
    rng.shuffle(weights)
    return weights


def _spread(weights: Sequence[float], total: float, largest: float) -> list[float]:
    """``total`` shared out by ``weights``, no share above ``largest`` (the excess goes to the
    others by their weights, as far as they can take it)."""
    shares = [0.0] * len(weights)
    open_ = set(range(len(weights)))
    left = min(total, largest * len(weights))
    while left > 1e-9 * total and open_:
        weight = math.fsum(weights[i] for i in open_)
        clipped = False
        for i in sorted(open_):
            share = left * weights[i] / weight
            if shares[i] + share >= largest:
                clipped = True
        if not clipped:
            for i in open_:
                shares[i] += left * weights[i] / weight
            break
        for i in sorted(open_):
            share = left * weights[i] / weight
            if shares[i] + share >= largest:
                left -= largest - shares[i]
                shares[i] = largest
                open_.discard(i)
    return shares


def best_spread(
    traffic: Mapping[BundleId, float],
    capacity: Mapping[BrokerId, float],
    rules: PlacementRules | None = None,
) -> float:
    """The std of the carried load after a placement made by hand: each bundle, heaviest first,
    on the broker with the least load for its size that the placement ``rules`` allow."""
    carried = dict.fromkeys(capacity, 0.0)
    _fill(traffic, capacity, capacity, carried, rules or PlacementRules({}))
    return mean_and_std(c / 2 / (capacity[b] * MB) for b, c in carried.items())[1]


def _fill(
    traffic: Mapping[BundleId, float],
    capacity: Mapping[BrokerId, float],
    weight: Mapping[BrokerId, float],
    carried: dict[BrokerId, float],
    rules: PlacementRules,
) -> dict[BundleId, BrokerId]:
    """Each bundle, heaviest first, on the broker with the least ``carried`` load for its
    ``weight`` among those the ``rules`` allow (all of them when the rules leave none)."""
    placement: dict[BundleId, BrokerId] = {}
    moves = rules.at([BrokerCandidate(b) for b in sorted(capacity)], ASSIGNMENT, {})
    for bundle in sorted(traffic, key=lambda b: (-traffic[b], b)):
        allowed = moves.allowed(bundle) or carried
        broker = min(allowed, key=lambda b: (carried[b] / weight[b], b))
        placement[bundle] = broker
        moves.placed(bundle, broker)
        carried[broker] += traffic[bundle]
    return placement


def draw_rules(
    names: Sequence[NamespaceName],
    brokers: Sequence[BrokerId],
    traffic: Mapping[BundleId, float],
    rng: random.Random,
) -> dict[NamespaceName, NamespacePolicies]:
    """The placement rules of a cluster: none on two clusters in five; else namespaces isolated
    on primaries enough for their traffic (and a spare), an anti-affinity group of two to five
    namespaces, or both. Joining brokers are never primaries, and the isolated namespaces never
    reserve every broker: an isolation that would is not drawn, as an operator leaves brokers
    for the namespaces nobody isolated (with none left, their bundles could go nowhere)."""
    kind = rng.choice(("none", "none", "isolation", "anti-affinity", "both"))
    policies: dict[NamespaceName, NamespacePolicies] = {}
    if kind in ("isolation", "both") and len(names) >= 2 and len(brokers) >= 4:
        isolated = rng.sample(list(names), rng.randint(1, min(3, len(names) // 2)))
        total = math.fsum(traffic.values())
        reserved: set[BrokerId] = set()
        for namespace in isolated:
            share = math.fsum(t for b, t in traffic.items() if b.startswith(f"{namespace}/"))
            need = math.ceil(len(brokers) * share / total) + 1
            primaries = sorted(rng.sample(list(brokers), min(len(brokers) // 2, max(2, need))))
            secondary = (".*",) if rng.random() < 0.5 else ()
            if reserved.union(primaries) >= set(brokers):
                continue
            reserved.update(primaries)
            policies[namespace] = NamespacePolicies(
                isolation=IsolationPolicy(
                    primary=("|".join(re.escape(b) for b in primaries),), secondary=secondary
                )
            )
    if kind in ("anti-affinity", "both"):
        free = [n for n in names if n not in policies]
        for namespace in rng.sample(free, min(len(free), rng.randint(2, 5))):
            policies[namespace] = NamespacePolicies(anti_affinity_group="spread")
    return policies


def _describe_rules(policies: Mapping[NamespaceName, NamespacePolicies]) -> str:
    isolated = sum(1 for p in policies.values() if p.isolation is not None)
    grouped = sum(1 for p in policies.values() if p.anti_affinity_group is not None)
    parts = [f"{isolated} namespaces isolated"] if isolated else []
    parts += [f"{grouped} in an anti-affinity group"] if grouped else []
    return f" ({', '.join(parts)})" if parts else ""


def generate(seed: int, target_std: float, *, rules: bool = True) -> Generated:
    """The cluster of ``seed``, judged against ``target_std`` where it can reach it; without
    placement rules when not ``rules`` (the clusters as drawn before there were any)."""
    rng = random.Random(f"cluster-{seed}")
    count = round(math.exp(rng.uniform(math.log(3), math.log(200))))
    mixed = rng.random() < 0.5
    capacity = {b: rng.choice(SIZES) if mixed else SIZES[1] for b in _names(count)}
    namespaces = rng.randint(1, 50)
    per_namespace = rng.choice((4, 8, 16, 32))
    while namespaces * per_namespace < BUNDLES_PER_BROKER * count:
        per_namespace *= 2
    while namespaces * per_namespace > MAX_BUNDLES and namespaces > 1:
        namespaces -= 1
    names = [NamespaceName("tenant", f"ns-{i}") for i in range(namespaces)]
    bundles = [b.id for ns in names for b in NamespaceBundles.default(ns, per_namespace).bundles()]
    weights = _weights(len(bundles), rng)
    utilisation = rng.uniform(0.15, 0.6)
    total = 2 * utilisation * math.fsum(capacity.values()) * MB
    largest = LARGEST_SHARE * 2 * min(capacity.values()) * MB
    traffic = dict(zip(bundles, _spread(weights, total, largest), strict=True))
    start = rng.choice(("balanced", "skewed", "random"))
    # Drawn apart, so that a cluster's rules do not change the rest of it.
    policies = (
        draw_rules(names, sorted(capacity), traffic, random.Random(f"rules-{seed}"))
        if rules
        else {}
    )
    placement_rules = PlacementRules(policies)
    placement = _place(start, traffic, capacity, rng, placement_rules)

    events: list[Event] = []
    kinds: list[str] = []
    targets: list[float] = []
    up = dict(capacity)
    factors: dict[NamespaceName, float] = {}
    hot: NamespaceName | None = None
    spare = count + 1  # the next new broker's number
    if start != "balanced":
        kinds.append(f"{start} start")
        targets.append(_target(traffic, factors, up, target_std, placement_rules))
    at = 1 if start == "balanced" else rng.randint(MIN_GAP, 2 * MIN_GAP)
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(("join", "leave", "restart", "hot", "hot-moves"))
        if (kind == "leave" and len(up) <= 2) or (kind == "hot-moves" and hot is None):
            kind = "join"
        if kind == "join":
            joining = {
                b: rng.choice(SIZES) if mixed else SIZES[1]
                for b in _names(rng.randint(1, max(1, len(up) // 2)), first=spare)
            }
            spare += len(joining)
            up.update(joining)
            events.append(Event(at=at, join=joining))
            kinds.append(f"{len(joining)} join")
        elif kind in ("leave", "restart"):
            leaving = tuple(rng.sample(sorted(up), rng.randint(1, max(1, len(up) // 4))))
            sizes = {b: up.pop(b) for b in leaving}
            events.append(Event(at=at, leave=leaving))
            kinds.append(f"{len(leaving)} {kind}")
            if kind == "restart":
                back = at + rng.randint(2, 5)
                targets.append(_target(traffic, factors, up, target_std, placement_rules))
                up.update(sizes)
                events.append(Event(at=back, join=sizes))
                kinds.append(f"{len(leaving)} back")
                at = back
        else:
            factor = rng.choice((2.0, 4.0, 8.0))
            change: dict[NamespaceName, float] = {}
            if kind == "hot-moves" and hot is not None:
                change[hot] = 1.0 / factors[hot]
                factors[hot] = 1.0
            hot = rng.choice(names)
            change[hot] = change.get(hot, 1.0) * factor
            factors[hot] = factors.get(hot, 1.0) * factor
            events.append(Event(at=at, traffic=change))
            kinds.append(f"{hot} x{factor:g}" + (" (moved)" if kind == "hot-moves" else ""))
        targets.append(_target(traffic, factors, up, target_std, placement_rules))
        at += rng.randint(MIN_GAP, 2 * MIN_GAP)
    everyone = sorted(set(capacity) | {b for e in events for b in e.join})
    ema_share = rng.choice(EMA_ONLY_SHARES)
    ema_only = frozenset(b for b in everyone if rng.random() < ema_share)
    late_share = rng.choice(LATE_SHARES)
    report_every = {b: rng.choice((2, 3)) for b in everyone if rng.random() < late_share}
    reports = "" if not ema_only else f", {len(ema_only)} reporting only the EMAs"
    if report_every:
        reports += f", {len(report_every)} reporting every 2 or 3 cycles"
    scenario = BalanceScenario(
        name=f"generated {seed}",
        description=f"{count} brokers ({'mixed sizes' if mixed else 'one size'}{reports}), "
        f"{len(bundles)} bundles in {namespaces} namespaces{_describe_rules(policies)} at "
        f"{utilisation:.0%}; " + ", ".join(kinds),
        brokers=capacity,
        traffic=traffic,
        placement=placement,
        cycles=at - MIN_GAP + SETTLE,
        events=tuple(events),
        disturbed_at_start=start != "balanced",
        ema_only=ema_only,
        report_every=report_every,
        policies=policies,
    )
    return Generated(seed, scenario, tuple(targets), tuple(kinds))


def _place(
    start: str,
    traffic: Mapping[BundleId, float],
    capacity: Mapping[BrokerId, float],
    rng: random.Random,
    rules: PlacementRules,
) -> dict[BundleId, BrokerId]:
    brokers = sorted(capacity)
    if start == "random":
        moves = rules.at([BrokerCandidate(b) for b in brokers], ASSIGNMENT, {})
        placement: dict[BundleId, BrokerId] = {}
        for bundle in traffic:
            placement[bundle] = rng.choice(sorted(moves.allowed(bundle)) or brokers)
            moves.placed(bundle, placement[bundle])
        return placement
    weight = dict(capacity)
    if start == "skewed":  # a few brokers count as a third of their size when placing
        for b in rng.sample(brokers, max(1, len(brokers) // 5)):
            weight[b] = capacity[b] / 3
    return _fill(traffic, capacity, weight, dict.fromkeys(brokers, 0.0), rules)


def _target(
    traffic: Mapping[BundleId, float],
    factors: Mapping[NamespaceName, float],
    capacity: Mapping[BrokerId, float],
    target_std: float,
    rules: PlacementRules,
) -> float:
    now = {b: t * factors.get(NamespaceName(*b.split("/")[:2]), 1.0) for b, t in traffic.items()}
    return max(target_std, best_spread(now, capacity, rules) + SLACK)


def evaluate(generated: Generated, strategy: str, config: SheddingConfig) -> Judged:
    """``strategy`` on ``generated`` with ``config``: how it fared against the cluster's targets."""
    run = BalanceSim(generated.scenario, strategy, config, seed=generated.seed).run()
    series, starts = run.std_series, run.disturbed_at
    worst: int | None = 0
    for i, (start, target) in enumerate(zip(starts, generated.targets, strict=True)):
        end = starts[i + 1] if i + 1 < len(starts) else len(series)
        back = next((c for c in range(start, end) if series[c] <= target), None)
        if back is None:
            worst = None
            break
        assert worst is not None
        worst = max(worst, back - start + 1)
    return Judged(
        seed=generated.seed,
        strategy=strategy,
        brokers=len(generated.scenario.brokers),
        bundles=len(generated.scenario.traffic),
        kinds=generated.kinds,
        cycles_to_target=worst,
        moves=run.moves,
        final_std=run.final_std,
        ping_pongs=run.ping_pongs,
        run=run,
        forbidden_moves=run.forbidden_moves,
    )


def shrink(generated: Generated, fails: Callable[[Generated], bool]) -> Generated:
    """``generated`` with as few disturbances as still ``fails``: each dropped in turn, the drop
    kept when the failure still shows. A restart's leave and return go together."""
    best = generated
    changed = True
    while changed:
        changed = False
        for index in range(len(best.scenario.events)):
            fewer = without(best, index)
            if fewer is not None and fails(fewer):
                best, changed = fewer, True
                break
    return best


def without(generated: Generated, index: int) -> Generated | None:
    """``generated`` without its ``index``-th event (and the return of a restart it starts)."""
    scenario = generated.scenario
    events = list(scenario.events)
    dropped = [index]
    kinds = list(generated.kinds)
    offset = 1 if scenario.disturbed_at_start else 0
    if kinds[index + offset].endswith("restart"):
        dropped.append(index + 1)
    elif kinds[index + offset].endswith("back"):
        return None  # dropped with its leave
    kept = [e for i, e in enumerate(events) if i not in dropped]
    if not kept and not scenario.disturbed_at_start:
        return None
    up = set(scenario.brokers)
    for event in kept:
        if not up.issuperset(event.leave):
            return None  # a broker leaves that joined only in a dropped event
        up.update(event.join)
        up.difference_update(event.leave)
    keep = [i for i in range(len(kinds)) if i - offset not in dropped]
    return Generated(
        generated.seed,
        replace(scenario, events=tuple(kept)),
        tuple(generated.targets[i] for i in keep),
        tuple(kinds[i] for i in keep),
    )


def percentile(values: Sequence[float], share: float) -> float:
    """The nearest-rank percentile of ``values`` (``share`` in [0, 1])."""
    ordered = sorted(values)
    rank = max(0, math.ceil(share * len(ordered)) - 1)
    return ordered[rank]


GOAL_CYCLES = 3
"""The planner's goal: back under target within this many cycles of each disturbance."""
PLANNER, BASELINE = "cluster_planner", "transfer_shedder"


def judge_all(
    seed: int, strategies: Sequence[str], config: SheddingConfig, *, rules: bool = True
) -> list[Judged]:
    """Every strategy on the cluster of ``seed`` (one unit of work for a process pool)."""
    generated = generate(seed, config.target_std, rules=rules)
    return [evaluate(generated, strategy, config) for strategy in strategies]


def misses(judged: Sequence[Judged]) -> list[str]:
    """Why the planner's run on one cluster misses its goals (none: it meets them), given every
    strategy's run on it."""
    mine = next((j for j in judged if j.strategy == PLANNER), None)
    if mine is None:
        return []
    out: list[str] = []
    if mine.cycles_to_target is None:
        out.append("never under target")
    elif mine.cycles_to_target > GOAL_CYCLES:
        out.append(f"{mine.cycles_to_target} cycles to target")
    baseline = next((j for j in judged if j.strategy == BASELINE), None)
    if baseline is not None and mine.moves > baseline.moves:
        out.append(f"{mine.moves} moves against {BASELINE}'s {baseline.moves}")
    if mine.ping_pongs:
        out.append(f"{mine.ping_pongs} ping-pongs")
    if mine.forbidden_moves:
        out.append(f"{mine.forbidden_moves} moves a placement rule forbids")
    return out


DISTRIBUTION_COLUMNS = (
    "strategy",
    "clusters",
    "under target",
    f"within {GOAL_CYCLES} cycles",
    "cycles p50/p90/p99",
    "moves p50/p90/p99",
    "final std p50/p90/p99",
    "with ping-pongs",
    "with forbidden moves",
)


def distribution(judged: Sequence[Judged], strategies: Sequence[str]) -> list[tuple[str, ...]]:
    """One row per strategy: how it fared over every cluster."""
    rows: list[tuple[str, ...]] = []
    for strategy in strategies:
        mine = [j for j in judged if j.strategy == strategy]
        if not mine:
            continue
        reached = [j for j in mine if j.cycles_to_target is not None]
        cycles = [math.inf if j.cycles_to_target is None else j.cycles_to_target for j in mine]
        within = sum(1 for c in cycles if c <= GOAL_CYCLES)
        rows.append(
            (
                strategy,
                str(len(mine)),
                f"{len(reached) / len(mine):.1%}",
                f"{within / len(mine):.1%}",
                "/".join(_cycles(percentile(cycles, p)) for p in (0.5, 0.9, 0.99)),
                "/".join(f"{percentile([j.moves for j in mine], p):g}" for p in (0.5, 0.9, 0.99)),
                "/".join(
                    f"{percentile([j.final_std for j in mine], p):.3f}" for p in (0.5, 0.9, 0.99)
                ),
                str(sum(1 for j in mine if j.ping_pongs)),
                str(sum(1 for j in mine if j.forbidden_moves)),
            )
        )
    return rows


def _cycles(value: float) -> str:
    return "never" if math.isinf(value) else f"{value:g}"


# -- spikes ------------------------------------------------------------------------------------

SPIKE_AT = 20
"""Cycles of rest before the spike: the evenly placed cluster's EMAs settle in far fewer."""
SPIKE_AFTER = 12
"""Cycles after the spike in which a strategy may still act on it."""
SPIKE_LENGTHS = (1, 2, 3)
"""Spikes of one to three cycles: Pulsar's hit count (3 by default) waits out three."""


@dataclass(frozen=True, slots=True)
class Spiked:
    """One strategy on one generated cluster at rest, spiked."""

    seed: int
    strategy: str
    spike: str
    """The namespace and its factor, as the disturbances are named."""
    at_rest: bool
    """The cluster, evenly placed and left alone, is under its target (or what it can reach, as
    the disturbances are judged) and moves nothing in the cycles the spikes are judged on: a
    move then is the spike's doing."""
    moves: tuple[int, ...]
    """Per length of :data:`SPIKE_LENGTHS`: the moves from the spike on, less those the same
    strategy makes in the same cycles without it."""


def at_rest(generated: Generated) -> tuple[BalanceScenario, NamespaceName, float]:
    """``generated``'s cluster placed evenly and left alone (no disturbance), and the namespace
    and factor of its spike, drawn from the cluster's seed (:func:`spiked`)."""
    scenario = generated.scenario
    rng = random.Random(f"spike-{generated.seed}")
    placement = _place(
        "balanced", scenario.traffic, scenario.brokers, rng, PlacementRules(scenario.policies)
    )
    namespaces = sorted({parse_bundle_id(b).namespace for b in scenario.traffic})
    namespace = rng.choice(namespaces)
    factor = rng.choice((2.0, 4.0, 8.0))
    quiet = replace(
        scenario,
        name=f"{scenario.name}, spiked",
        placement=placement,
        events=(),
        disturbed_at_start=False,
        cycles=SPIKE_AT + max(SPIKE_LENGTHS) + SPIKE_AFTER,
    )
    return quiet, namespace, factor


def spiked(
    quiet: BalanceScenario, namespace: NamespaceName, factor: float, length: int
) -> BalanceScenario:
    """The cluster at rest (:func:`at_rest`) with ``namespace``'s traffic multiplied by
    ``factor`` for ``length`` cycles from cycle :data:`SPIKE_AT` on."""
    return replace(
        quiet,
        events=(
            Event(at=SPIKE_AT, traffic={namespace: factor}, disturbs=False),
            Event(at=SPIKE_AT + length, traffic={namespace: 1 / factor}, disturbs=False),
        ),
    )


def judge_spikes(seed: int, strategies: Sequence[str], config: SheddingConfig) -> list[Spiked]:
    """Every strategy on the cluster of ``seed`` at rest and under spikes of each length (one
    unit of work for a process pool)."""
    generated = generate(seed, config.target_std)
    quiet, namespace, factor = at_rest(generated)
    rules = PlacementRules(quiet.policies)
    target = _target(quiet.traffic, {}, quiet.brokers, config.target_std, rules)
    scenarios = [spiked(quiet, namespace, factor, length) for length in SPIKE_LENGTHS]
    out: list[Spiked] = []
    for strategy in strategies:
        sim = BalanceSim(quiet, strategy, config, seed=seed)
        cycles = [sim.cycle(c) for c in range(quiet.cycles)]
        rest = cycles[SPIKE_AT - 1].std <= target and not any(
            c.moved or c.placed for c in cycles[SPIKE_AT:]
        )
        base = sum(len(c.moved) for c in cycles[SPIKE_AT:])
        moves = []
        for scenario in scenarios:
            sim = BalanceSim(scenario, strategy, config, seed=seed)
            made = [len(sim.cycle(c).moved) for c in range(scenario.cycles)]
            moves.append(sum(made[SPIKE_AT:]) - base)
        out.append(Spiked(seed, strategy, f"{namespace} x{factor:g}", rest, tuple(moves)))
    return out


SPIKE_COLUMNS = (
    "strategy",
    "clusters at rest",
    *(f"moved on a {n}-cycle spike" for n in SPIKE_LENGTHS),
)


def spike_table(spikes: Sequence[Spiked], strategies: Sequence[str]) -> list[tuple[str, ...]]:
    """One row per strategy over the clusters at rest: on how many a spike of each length made
    it move, and how many bundles in all."""
    rows: list[tuple[str, ...]] = []
    for strategy in strategies:
        mine = [s for s in spikes if s.strategy == strategy and s.at_rest]
        if not any(s.strategy == strategy for s in spikes):
            continue
        cells = []
        for i in range(len(SPIKE_LENGTHS)):
            moved = [s.moves[i] for s in mine if s.moves[i] > 0]
            cells.append(f"{len(moved)} ({sum(moved)} bundles)")
        rows.append((strategy, str(len(mine)), *cells))
    return rows
