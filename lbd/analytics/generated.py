"""A generated cluster's history: what the history sink would record of it under the default
strategy.

:func:`lbd.workload.generator.generate` draws a cluster and what happens to it (brokers of mixed
sizes, namespaces, bundle traffic, joins, leaves, restarts, hot namespaces, brokers that report
only the EMAs or only every second or third cycle). :func:`outcomes` plays it cycle by cycle on
the scenario suite's driver (:class:`~lbd.workload.balance.BalanceSim`), with the default
strategy deciding, and turns each cycle into the :class:`~lbd.analytics.engine.StepOutcome` that
``lbd analytics synth`` writes:

- a ``broker_load`` row for each broker that reported in the cycle: a broker that joins has no
  row before it joins, one that leaves none after, a late reporter a row every second or third
  cycle, and a broker that reports only the EMAs a row without the raw sample (its ``max_usage``
  and throughputs 0), as the sink records such a report;
- a ``bundle_load`` row for each bundle of a broker that reported, with its owner when it
  reported;
- a decision for each move of the shedder (with its reason), each placement of an unloaded
  bundle (``Lookup``) and each placement of a left broker's bundle (``Orphan``).

The demand, the load and the strategy are the generator's and the load model's: nothing here
models load.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from lbd.analytics.engine import BundleSample, Decision, StepOutcome, decision_row
from lbd.core.ids import BrokerId, BundleId
from lbd.core.settings import SheddingConfig
from lbd.core.shedding import DEFAULT_STRATEGY
from lbd.history.schema import DecisionKind
from lbd.workload.balance import BalanceSim, Cycle
from lbd.workload.generator import generate
from lbd.workload.model import LoadModel, Move


def outcomes(seed: int, config: SheddingConfig | None = None) -> Iterator[StepOutcome]:
    """The history of the generated cluster of ``seed`` under the default strategy, one
    outcome per cycle."""
    config = config or SheddingConfig()
    generated = generate(seed, config.target_std)
    sim = BalanceSim(generated.scenario, DEFAULT_STRATEGY, config, seed=seed)
    model = sim.model
    for n in range(generated.scenario.cycles):
        before = dict(model.owners)
        cycle = sim.cycle(n)
        now = model.now_ms
        reported = dict(model.owners)
        for move in reversed(cycle.moved):  # the owners as the brokers reported them
            if move.src is not None:
                reported[move.bundle] = move.src
        loads = {b: d for b, d in sorted(model.loads.items()) if d.updated_at_ms == now}
        bundles = {
            bundle: BundleSample(reported[bundle], traffic / 2, traffic / 2)
            for bundle, traffic in sorted(model.traffic.items())
            if reported.get(bundle) in loads
        }
        decisions = _decisions(now, cycle, before, reported, model)
        yield StepOutcome(
            now,
            loads,
            {b: s.owner for b, s in bundles.items()},
            bundles,
            cycle.shed.avg,
            cycle.shed.std,
            decisions,
        )


def _decisions(
    now: int,
    cycle: Cycle,
    before: Mapping[BundleId, BrokerId],
    reported: Mapping[BundleId, BrokerId],
    model: LoadModel,
) -> tuple[Decision, ...]:
    """The cycle's placements (before the reports), then the shedder's moves."""
    loads = model.loads
    stats = (cycle.shed.avg, cycle.shed.std)
    looked_up = {m.bundle for m in cycle.placed}
    out = [
        decision_row(now, DecisionKind.ASSIGN, m, "Lookup", None, stats, loads)
        for m in cycle.placed
    ]
    for bundle, owner in reported.items():
        left = before.get(bundle)
        if left is not None and left != owner and bundle not in looked_up:
            orphan = Move(now, bundle, left, owner, model.traffic.get(bundle, 0.0))
            out.append(decision_row(now, DecisionKind.ASSIGN, orphan, "Orphan", None, stats, loads))
    reasons = {d.bundle: str(d.reason) for d in cycle.shed.decisions}
    for m in cycle.moved:
        kind = DecisionKind.UNLOAD if m.dst is None else DecisionKind.TRANSFER
        out.append(decision_row(now, kind, m, reasons[m.bundle], DEFAULT_STRATEGY, stats, loads))
    return tuple(out)
