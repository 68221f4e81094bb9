"""Planted bugs (lbd/simulation/mutations.py): the simulation finds each within its search, and
the seed that finds it holds every invariant without the bug."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from concurrent.futures import Executor

import pytest

from lbd.services.sidecar.broker_link import BrokerLink
from lbd.simulation import search
from lbd.simulation.mutations import MUTATIONS
from lbd.simulation.run import run_seed, shrink
from lbd.simulation.schedule import WorldSpec, search_spec

pytestmark = pytest.mark.slow  # searches of the simulation: left out of make test-fast

SEARCH = 200
"""Seeds a planted bug must be found within (a seed of a search takes a tenth of a second to a
second)."""
FOUND = {
    "lease-off": "serves it",
    "no-wait-out": "serves",
    "stale-table-vouch": "serves",
    "no-handover-wait": "serves",
    "wait-without-lease": "serves",
    "channel-window": "serves",
    "barrier-without-read": "serves",
    "lease-ground-unbounded": "serves",
    "no-reown": "which does not serve it",
    "lapse-ignored": "which does not serve it",
    "doubtful-own-kept": "serves",
    "no-resolver": "version went from",
}
"""Each bug the simulation must find, one per rule of the safety argument, and what its first
violation says. ``no-term-check`` is the one it does not find (docs/simulation.md says why)."""


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


@pytest.fixture(scope="module")
def workers() -> Iterator[Executor]:
    """Both cores for the searches (the seeds they run are the same as one after another)."""
    with search.pool() as pool:
        yield pool


def first_failing(mutation: str, workers: Executor) -> WorldSpec:
    seed = search.first_failing(mutation, SEARCH, workers)
    if seed is None:
        raise AssertionError(f"{mutation}: not found within {SEARCH} seeds")
    return search_spec(mutation, seed)


@pytest.mark.parametrize("mutation", sorted(FOUND))
def test_a_planted_bug_is_found_and_the_seed_holds_without_it(
    mutation: str, workers: Executor
) -> None:
    spec = first_failing(mutation, workers)
    outcome = run_seed(spec)
    assert any(FOUND[mutation] in v for v in outcome.violations), outcome.violations
    clean = run_seed(dataclasses.replace(spec, mutation=""))
    assert clean.ok, (spec.seed, clean.violations)


def test_a_planted_bug_is_undone_after_its_run() -> None:
    original = BrokerLink.wait_out_lease
    run_seed(dataclasses.replace(search_spec("no-wait-out", 1), virtual_s=60))
    assert BrokerLink.wait_out_lease is original


def test_a_failure_shrinks_to_the_faults_that_cause_it(workers: Executor) -> None:
    spec = first_failing("lease-off", workers)
    outcome = run_seed(spec)
    shrunk = shrink(spec, outcome)
    assert not shrunk.ok
    assert 1 <= len(shrunk.faults) < len(outcome.faults)
    assert {f.kind for f in shrunk.faults} == {"pause-sidecar"}
    # Each fault left is needed: without any one of them the run holds.
    for n in range(len(shrunk.faults)):
        assert run_seed(spec, shrunk.faults[:n] + shrunk.faults[n + 1 :]).ok


def test_every_mutation_has_a_search() -> None:
    assert set(FOUND) <= set(MUTATIONS)
    for name, mutation in MUTATIONS.items():
        assert mutation.name == name and mutation.what
