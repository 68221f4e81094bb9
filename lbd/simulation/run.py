"""One seed run from start to end, and the shrinking of a failing one to the fewest faults."""

from __future__ import annotations

import contextlib

from lbd.core import probes
from lbd.simulation import loop
from lbd.simulation.mutations import MUTATIONS
from lbd.simulation.schedule import Fault, Outcome, WorldSpec
from lbd.simulation.world import World


def run_seed(
    spec: WorldSpec, faults: tuple[Fault, ...] | None = None, *, trace: bool = True
) -> Outcome:
    """Run one world in a fresh event loop on virtual time (deterministic: nothing else runs on
    it); ``trace``: keep its trace. An exception out of the run (lbd's bug, or the world's) is a
    violation of its own, reported and shrunk like any other."""
    world = World(spec, faults, trace=trace)
    planted = MUTATIONS[spec.mutation].planted() if spec.mutation else contextlib.nullcontext()
    with planted, probes.recording() as hits:
        try:
            outcome = loop.run(world.clock, world.run)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a CancelledError too: the seed fails, the check goes on
            outcome = world.outcome
            outcome.violations.append(f"the run crashed: {type(e).__name__}: {e}".rstrip(": "))
    outcome.probes = frozenset(hits)
    for name in probes.unknown(hits):
        outcome.violations.append(f"probe {name!r} is not in lbd.core.probes.PROBES")
    return outcome


def shrink(spec: WorldSpec, outcome: Outcome) -> Outcome:
    """The failing ``outcome`` of ``spec`` with as few faults as still fail: faults are dropped
    one at a time, each drop kept when the run still violates an invariant."""
    best = outcome
    changed = True
    while changed:
        changed = False
        for n in range(len(best.faults)):
            fewer = best.faults[:n] + best.faults[n + 1 :]
            tried = run_seed(spec, fewer)
            if not tried.ok:
                best, changed = tried, True
                break
    return best
