"""The simulated world (lbd/simulation/world.py): the same seed gives the same run, seeds with
faults hold every invariant, and planted bugs are found."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterator

import pytest

from lbd.simulation.run import run_seed
from lbd.simulation.schedule import FAULTS, Fault, WorldSpec, schedule, search_spec
from lbd.simulation.world import World


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def first_failure(specs: Iterator[WorldSpec]) -> tuple[WorldSpec, object] | None:
    for spec in specs:
        outcome = run_seed(spec)
        if not outcome.ok:
            return spec, outcome
    return None


def test_a_seed_replays_bit_for_bit() -> None:
    spec = WorldSpec(11, virtual_s=240, mean_fault_gap_s=10.0)
    first, second = run_seed(spec), run_seed(spec)
    assert first.trace == second.trace
    assert any("owns" in line for line in first.trace)
    assert any(line.split()[1] == "fault" for line in first.trace)
    assert run_seed(dataclasses.replace(spec, seed=12)).trace != first.trace


def test_a_schedule_is_the_seeds_and_covers_every_kind_of_fault() -> None:
    spec = WorldSpec(5)
    assert schedule(spec) == schedule(spec)
    kinds = {f.kind for seed in range(1, 30) for f in schedule(WorldSpec(seed))[1]}
    assert kinds == set(FAULTS)
    brokers = {schedule(WorldSpec(seed))[0] for seed in range(1, 30)}
    assert brokers == {3, 4, 5}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_seeds_with_every_kind_of_fault_hold_every_invariant(seed: int) -> None:
    outcome = run_seed(WorldSpec(seed, virtual_s=300, mean_fault_gap_s=8.0))
    assert outcome.ok, outcome.violations
    assert len(outcome.faults) >= 10


def test_a_fault_reads_as_its_schedule_entry() -> None:
    assert str(Fault(12.34, "etcd-down", 1, 5.0)) == "etcd-down@12.3s(node 1, 5.0s)"


PINNED = {
    "a sidecar that re-registered its silent broker vouched on its lease before reading the "
    "hand-over announced meanwhile": (
        6,
        5,
        (
            Fault(67.8, "pause-broker", 4, 77.1),
            Fault(94.8, "channel-cut-one", 4, 32.2),
            Fault(101.1, "channel-cut-one", 4, 63.6),
        ),
    ),
    "the leader finished a stuck split without cutting the namespace layout": (
        387,
        5,
        (
            Fault(42.6, "pause-broker", 4, 18.5),
            Fault(60.5, "unload", 4, 2.2),
            Fault(275.6, "etcd-cut-one", 0, 36.9),
            Fault(291.4, "split", 2, 29.7),
            Fault(322.9, "unload", 3, 37.0),
        ),
    ),
    "a child handed over during its split while the parent was still served": (
        302,
        5,
        (
            Fault(34.0, "split", 4, 19.4),
            Fault(47.5, "split", 0, 30.8),
            Fault(102.4, "etcd-cut-one", 1, 25.9),
            Fault(112.2, "split", 0, 27.7),
        ),
    ),
    "a leader duty cancelled while a proposal reaped its watcher swallowed the cancellation and "
    "ran on after its sidecar left": (
        729,
        5,
        (
            Fault(51.4, "channel-cut-one", 0, 31.8),
            Fault(60.8, "leave", 2, 19.2),
            Fault(105.2, "leave", 4, 17.0),
            Fault(125.5, "channel-cut-one", 3, 37.3),
            Fault(130.8, "pause-sidecar", 3, 10.6),
        ),
    ),
    "a leader's fix decided before a split finished resurrected the deleted parent": (
        7228,
        3,
        (
            Fault(6.5, "crash-sidecar", 1, 7.8),
            Fault(41.3, "pause-broker", 1, 31.6),
            Fault(110.1, "crash-sidecar", 2, 8.4),
            Fault(163.5, "transfer", 1, 34.7),
            Fault(171.4, "split", 1, 28.0),
            Fault(173.2, "transfer", 0, 2.0),
            Fault(184.3, "pause-sidecar", 0, 37.1),
            Fault(215.7, "channel-cut-one", 1, 30.2),
            Fault(234.0, "split", 2, 11.1),
        ),
    ),
    "a split undone while its children were written left both, and the parent was served "
    "beside a child the shedder moved": (
        7980,
        3,
        (
            Fault(15.4, "pause-broker", 0, 24.2),
            Fault(33.7, "split", 1, 25.4),
            Fault(38.6, "channel-down", 1, 21.5),
            Fault(99.4, "crash-sidecar", 1, 23.5),
            Fault(103.9, "channel-down", 2, 43.5),
        ),
    ),
    "an admin split waiting for its bundle when its sidecar crashed got a cancellation nobody "
    "asked for, which killed the simulation's run": (
        1191,
        5,
        (
            Fault(7.5, "crash-sidecar", 3, 29.5),
            Fault(80.8, "etcd-cut-one", 4, 25.0),
            Fault(281.0, "etcd-down", 0, 32.9),
            Fault(293.0, "split", 4, 32.4),
            Fault(296.1, "crash-sidecar", 2, 25.3),
        ),
    ),
}
"""Schedules that found bugs, shrunk, pinned as faults (a seed's own schedule changes whenever
the kinds of fault do)."""


@pytest.mark.parametrize("what", sorted(PINNED))
def test_schedules_that_found_bugs_hold_now(what: str) -> None:
    seed, brokers, faults = PINNED[what]
    outcome = run_seed(WorldSpec(seed, brokers=brokers), faults)
    assert outcome.ok, (what, outcome.violations)


def test_a_bulk_run_finds_what_a_traced_run_finds() -> None:
    spec = next(
        spec
        for spec in (search_spec("lease-off", seed) for seed in range(1, 61))
        if not run_seed(spec, trace=False).ok
    )
    traced, bulk = run_seed(spec), run_seed(spec, trace=False)
    assert traced.violations == bulk.violations and traced.violations
    assert traced.trace and not bulk.trace


def test_load_swings_make_the_split_scheduler_and_the_shedder_act() -> None:
    acted: dict[str, int] = {}
    for seed in range(1, 11):
        outcome = run_seed(
            WorldSpec(seed, faults=("load-swing",), mean_fault_gap_s=15.0), trace=False
        )
        assert outcome.ok, (seed, outcome.violations)
        for kind, count in outcome.balancing.items():
            acted[kind] = acted.get(kind, 0) + count
        if acted.get("scheduled_splits") and acted.get("shed"):
            return
    raise AssertionError(f"in 10 seeds of load swings the balancer did only {acted}")


def test_an_exception_out_of_a_run_fails_the_seed_and_the_next_seed_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def crash(self: World) -> None:
        raise asyncio.CancelledError

    with monkeypatch.context() as patched:
        patched.setattr(World, "_check_converged", crash)
        outcome = run_seed(WorldSpec(1, virtual_s=60))
    assert not outcome.ok and outcome.violations[-1] == "the run crashed: CancelledError"
    assert run_seed(WorldSpec(1, virtual_s=60)).ok
