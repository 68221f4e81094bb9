"""Benchmark of the deterministic simulation (:mod:`lbd.simulation.world`): seeds per second.

``python -m bench.sim_bench [--seeds N] [--jobs J]`` runs N seeds of the default schedule (3 to
5 brokers, every kind of fault in the first two thirds of ten virtual minutes, each run ending
when its faults are over and the orphan bound has passed) over J processes, the way ``lbd sim
check`` does, and prints seeds per second, virtual time per seed, and what 10,000 seeds would
take at that rate; then, for each planted bug (:mod:`lbd.simulation.mutations`), the first seed
of its search that finds it.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time

from rich.console import Console

from bench.report import measurements_table
from lbd.simulation import search
from lbd.simulation.mutations import MUTATIONS
from lbd.simulation.run import run_seed
from lbd.simulation.schedule import WorldSpec

VIRTUAL_S = 600.0


def run(*, seeds: int = 200, jobs: int | None = None) -> dict[str, float]:
    """Run ``seeds`` seeds the way ``lbd sim check --seeds`` does (no trace); rates and
    times."""
    jobs = jobs or os.cpu_count() or 1
    specs = [WorldSpec(seed, virtual_s=VIRTUAL_S) for seed in range(1, seeds + 1)]
    check = functools.partial(run_seed, trace=False)
    with search.pool(jobs) as pool:
        list(pool.map(check, specs[:jobs]))  # start the workers (imports) before timing
        started = time.perf_counter()
        outcomes = list(pool.map(check, specs, chunksize=4))
        took = time.perf_counter() - started
    virtual_s = math.fsum(o.virtual_s for o in outcomes)
    return {
        "seeds": float(seeds),
        "processes": float(jobs),
        "virtual_s_per_seed": virtual_s / seeds,
        "faults_per_seed": sum(len(o.faults) for o in outcomes) / seeds,
        "failed_seeds": float(sum(not o.ok for o in outcomes)),
        "seeds_per_s": seeds / took,
        "virtual_s_per_wall_s": virtual_s / took,
        "projected_10k_seeds_min": 10_000 / (seeds / took) / 60,
    }


def mutations(*, limit: int = 200, jobs: int | None = None) -> dict[str, float]:
    """For each planted bug, the first seed of its search that finds it (0: not found within
    ``limit`` seeds)."""
    found: dict[str, float] = {}
    with search.pool(jobs) as workers:
        for name in sorted(MUTATIONS):
            seed = search.first_failing(name, limit, workers)
            found[f"{name}: found at seed"] = float(seed or 0)
    return found


def main() -> None:
    """Run :func:`run` with the command-line arguments and print a table."""
    parser = argparse.ArgumentParser(prog="python -m bench.sim_bench", description=__doc__)
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args()
    console = Console()
    with console.status(f"simulation: {args.seeds} seeds..."):
        result = run(seeds=args.seeds, jobs=args.jobs)
    console.print(measurements_table("deterministic simulation", result))
    with console.status("planted bugs: searching..."):
        found = mutations()
    console.print(measurements_table("planted bugs (0: not found in 200 seeds)", found))


if __name__ == "__main__":
    main()
