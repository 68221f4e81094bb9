"""``lbd sim check``: seeded simulated clusters with faults (:mod:`lbd.simulation.world`).

``--seeds N`` runs seeds ``--first`` .. ``--first + N - 1`` over ``--jobs`` processes and prints
each failing seed with what it violated and its fault schedule shrunk to the fewest faults that
still fail; ``--seed S --trace`` replays one seed exactly and prints its trace. ``--mutation
NAME`` plants one of the bugs of :mod:`lbd.simulation.mutations` and runs the search that finds
it. After the seeds it prints how many reached each probe of :mod:`lbd.core.probes`. Exit code
1 when any seed failed, or when a required probe was reached by fewer than its share of the
seeds of a default world.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from collections import Counter

from lbd.core.errors import InvalidInputError
from lbd.core.probes import PROBES, REQUIRED, REQUIRED_FROM_SEEDS
from lbd.simulation import search
from lbd.simulation.mutations import MUTATIONS
from lbd.simulation.run import run_seed, shrink
from lbd.simulation.schedule import FAULTS, Fault, Outcome, WorldSpec, schedule, search_spec

SHRUNK_AT_MOST = 3
"""Failing seeds whose schedules are shrunk (each shrink reruns the seed once per fault)."""


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lbd sim check`` to the ``lbd sim`` verbs."""
    p = verbs.add_parser(
        "check", help="run seeded simulated clusters with faults", description=__doc__
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--seeds", type=int, metavar="N", help="run N seeds")
    which.add_argument("--seed", type=int, metavar="S", help="run one seed")
    p.add_argument("--first", type=int, default=1, metavar="S", help="the first of --seeds")
    p.add_argument("--trace", action="store_true", help="with --seed: print the event trace")
    p.add_argument(
        "--keep",
        default=None,
        metavar="I,J",
        help="with --seed: run only these faults of the seed's schedule (as a shrink prints)",
    )
    p.add_argument(
        "--virtual-s",
        type=float,
        default=None,
        metavar="S",
        help="the span of each seed's schedule in virtual seconds, faults in its first two "
        "thirds; a run ends 25 s after its faults (default 600, or the mutation's search)",
    )
    p.add_argument(
        "--faults",
        default=None,
        metavar="K,K",
        help=f"only these (default all, or the mutation's search): {', '.join(FAULTS)}",
    )
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="J")
    p.add_argument(
        "--mutation",
        default="",
        choices=sorted(MUTATIONS),
        metavar="NAME",
        help="plant this bug (the check must then fail) and run its search's faults and "
        f"timings: {', '.join(sorted(MUTATIONS))}",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the seeds; 0 when every one held every invariant."""
    faults = None if args.faults is None else tuple(k for k in args.faults.split(",") if k)
    unknown = sorted(set(faults or ()) - set(FAULTS))
    if unknown:
        raise InvalidInputError(f"--faults: unknown {unknown}; known: {', '.join(FAULTS)}")
    if args.virtual_s is not None and args.virtual_s < 60:
        raise InvalidInputError(f"--virtual-s must be >= 60, got {args.virtual_s}")
    logging.disable(logging.CRITICAL)  # the sidecars' own logs; the trace says what happened

    def spec(seed: int) -> WorldSpec:
        world = search_spec(args.mutation, seed) if args.mutation else WorldSpec(seed)
        if faults is not None:
            world = dataclasses.replace(world, faults=faults)
        if args.virtual_s is not None:
            world = dataclasses.replace(world, virtual_s=args.virtual_s)
        return world

    if args.seed is not None:
        outcome = run_seed(spec(args.seed), _kept(spec(args.seed), args.keep))
        if args.trace:
            print("\n".join(outcome.trace))
        _report(outcome)
        if not outcome.ok:
            _report_shrunk(spec(args.seed), shrink(spec(args.seed), outcome))
        return 0 if outcome.ok else 1
    if args.seeds < 1 or args.jobs < 1:
        raise InvalidInputError("--seeds and --jobs must be >= 1")
    started = time.perf_counter()
    seeds = range(args.first, args.first + args.seeds)
    failed: list[Outcome] = []
    reached: Counter[str] = Counter()
    virtual_s = 0.0
    with search.pool(args.jobs) as pool:
        for outcome in pool.map(_check, map(spec, seeds), chunksize=4):
            reached.update(outcome.probes)
            virtual_s += outcome.virtual_s
            if not outcome.ok:
                failed.append(outcome)
                _report(outcome)
    took = time.perf_counter() - started
    for outcome in failed[:SHRUNK_AT_MOST]:
        _report_shrunk(spec(outcome.seed), shrink(spec(outcome.seed), outcome))
    judged = (
        args.seeds >= REQUIRED_FROM_SEEDS
        and not args.mutation
        and faults is None
        and args.virtual_s is None
    )
    short = _report_probes(reached, args.seeds, judged=judged)
    print(
        f"{args.seeds} seeds, {len(failed)} failed, {took:.1f}s "
        f"({args.seeds / took:.2f} seeds/s, {virtual_s / args.seeds:.0f} virtual s a seed, "
        f"{args.jobs} processes)"
    )
    if short:
        print(
            f"{len(short)} required probe(s) reached by too few seeds: {', '.join(short)} "
            "(the faults no longer reach what the safety argument counts on)"
        )
    return 1 if failed or short else 0


def _report_probes(reached: Counter[str], seeds: int, *, judged: bool) -> list[str]:
    """Print how many seeds reached each probe; the required ones reached by too few seeds
    (only when ``judged``: a default world of enough seeds)."""
    short = []
    print("probes: seeds that reached each (lbd/core/probes.py)")
    for name in sorted(PROBES, key=lambda n: (-reached[n], n)):
        share = reached[name] / seeds
        need = REQUIRED.get(name)
        mark = ""
        if need is not None:
            mark = f"  required >= {need:.1%}"
            if judged and share < need:
                short.append(name)
                mark += "  TOO FEW"
        print(f"  {name:<24} {reached[name]:>6} {share:>6.1%}{mark}")
    if not judged and REQUIRED:
        print(
            f"  (shares are judged only for at least {REQUIRED_FROM_SEEDS} seeds of the default "
            "world: every fault, no mutation, the default virtual time)"
        )
    return short


def _check(spec: WorldSpec) -> Outcome:
    """One seed of a bulk run, without its trace (a failing one is replayed with it)."""
    return run_seed(spec, trace=False)


def _kept(spec: WorldSpec, keep: str | None) -> tuple[Fault, ...] | None:
    if keep is None:
        return None
    _, faults = schedule(spec)
    try:
        indices = [int(i) for i in keep.split(",") if i]
        return tuple(faults[i] for i in indices)
    except (ValueError, IndexError):
        raise InvalidInputError(
            f"--keep: indices of the seed's {len(faults)} faults, 0 to {len(faults) - 1}, "
            f"got {keep!r}"
        ) from None


def _report(outcome: Outcome) -> None:
    status = "ok" if outcome.ok else f"FAILED ({len(outcome.violations)} violations)"
    print(f"seed {outcome.seed}: {status}, {len(outcome.faults)} faults")
    for violation in outcome.violations[:5]:
        print(f"  {violation}")


def _report_shrunk(spec: WorldSpec, outcome: Outcome) -> None:
    faults = ", ".join(str(f) for f in outcome.faults) or "none"
    print(f"seed {outcome.seed} still fails with {len(outcome.faults)} fault(s): {faults}")
    _, scheduled = schedule(spec)
    keep = ",".join(str(scheduled.index(f)) for f in outcome.faults)
    flags = f" --virtual-s {spec.virtual_s:g} --faults {','.join(spec.faults or FAULTS)}"
    if spec.mutation:
        flags += f" --mutation {spec.mutation}"
    print(f"  replay: lbd sim check --seed {outcome.seed} --keep {keep}{flags} --trace")
