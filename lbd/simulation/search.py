"""The search for a planted bug (:mod:`lbd.simulation.mutations`), over several processes.

:func:`first_failing` runs a mutation's search seeds (:func:`~lbd.simulation.schedule.search_spec`)
in order, a batch at a time over a process pool, and returns the first seed whose run breaks an
invariant: the same seed a run of one seed after another finds, in about half the time on two
cores. The test of the planted bugs and the simulation benchmark share it.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
from concurrent.futures import Executor, ProcessPoolExecutor

from lbd.simulation.run import run_seed
from lbd.simulation.schedule import search_spec


def quiet() -> None:
    """A worker's initializer: the sidecars' own logs are off (the trace says what happened),
    and what importing lbd made is moved out of the cycle collector's sight (it lives as long
    as the worker; with it, every full collection a seed's runs set off scans it again: 3% of
    a seed's time)."""
    logging.disable(logging.CRITICAL)
    gc.freeze()


def pool(jobs: int | None = None) -> ProcessPoolExecutor:
    """Worker processes for seeds. Spawned, not forked: a fork of a process with threads (gRPC,
    the Pulsar client) can hang."""
    return ProcessPoolExecutor(
        jobs or os.cpu_count() or 1,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=quiet,
    )


def _fails(job: tuple[str, int]) -> bool:
    mutation, seed = job
    return not run_seed(search_spec(mutation, seed), trace=False).ok


def first_failing(mutation: str, limit: int, workers: Executor, *, batch: int = 4) -> int | None:
    """The first of seeds 1..``limit`` of ``mutation``'s search that breaks an invariant (None:
    none does). Seeds run ``batch`` at a time; a batch past the one that finds it is not run."""
    for start in range(1, limit + 1, batch):
        seeds = range(start, min(start + batch, limit + 1))
        failures = workers.map(_fails, [(mutation, s) for s in seeds])
        for seed, failed in zip(seeds, failures, strict=True):
            if failed:
                return seed
    return None
