"""Benchmark of the deterministic simulation (:mod:`lbd.simulation.world`): seeds per second.

``python -m bench.sim_bench [--seeds N] [--jobs J]`` runs N seeds of ten virtual minutes each
(3 to 5 brokers, every kind of fault) over J processes, the way ``lbd sim check`` does, and
prints seeds per second, virtual time per seed, and what 10,000 seeds would take at that rate.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

from rich.console import Console

from bench.report import measurements_table
from lbd.simulation.world import WorldSpec, run_seed

VIRTUAL_S = 600.0


def _quiet() -> None:
    logging.disable(logging.CRITICAL)


def run(*, seeds: int = 200, jobs: int | None = None) -> dict[str, float]:
    """Run ``seeds`` seeds; rates and times."""
    jobs = jobs or os.cpu_count() or 1
    specs = [WorldSpec(seed, virtual_s=VIRTUAL_S) for seed in range(1, seeds + 1)]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=_quiet) as pool:
        list(pool.map(run_seed, specs[:jobs]))  # start the workers (imports) before timing
        started = time.perf_counter()
        outcomes = list(pool.map(run_seed, specs, chunksize=4))
        took = time.perf_counter() - started
    return {
        "seeds": float(seeds),
        "processes": float(jobs),
        "virtual_s_per_seed": VIRTUAL_S,
        "failed_seeds": float(sum(not o.ok for o in outcomes)),
        "seeds_per_s": seeds / took,
        "virtual_s_per_wall_s": seeds * VIRTUAL_S / took,
        "projected_10k_seeds_min": 10_000 / (seeds / took) / 60,
    }


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


if __name__ == "__main__":
    main()
