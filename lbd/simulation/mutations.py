"""Planted bugs: test-only switches that each take one safety measure out, so that the simulation
can show it finds what that measure prevents.

Each :class:`Mutation` patches one place while a world runs (inside the process that runs it,
restored afterwards) and names the search it is found with: the faults and timings that reach
it. ``lbd sim check --mutation NAME`` runs seeds with the bug planted; the check must then fail.
:mod:`tests.unit.test_mutations` asserts each is found within its search.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from lbd.core import table
from lbd.core.state import ServiceUnitStateData, Verdict, resolve
from lbd.core.tuning import SidecarTimings
from lbd.services.sidecar.broker_link import BrokerLink
from lbd.services.sidecar.fencing import Fence
from lbd.services.sidecar.ownership import OwnershipReactor


@dataclass(frozen=True, slots=True)
class Mutation:
    """One planted bug."""

    name: str
    what: str
    """The measure taken out, and what it lets happen."""
    patches: tuple[tuple[object, str, object], ...] = ()
    """(owner, attribute, replacement) set while the world runs."""
    faults: tuple[str, ...] = ()
    """The faults its search schedules (all kinds when empty)."""
    timings: dict[str, float] | None = None
    """Changes to the world's timings for its search (none when None)."""
    mean_fault_gap_s: float = 20.0
    fault_s: tuple[float, float] = (1.0, 45.0)
    orphan_grace_s: float | None = None
    """``monitor.orphan_cleanup_grace_s`` for its search (the world's when None)."""
    virtual_s: float = 600.0

    @contextlib.contextmanager
    def planted(self) -> Iterator[None]:
        """The bug in place, for the duration of the block."""
        saved = [(owner, name, vars(owner)[name]) for owner, name, _ in self.patches]
        try:
            for owner, name, replacement in self.patches:
                setattr(owner, name, replacement)
            yield
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)


async def _no_wait(self: BrokerLink) -> None:
    """``wait_out_lease`` that moves on at once."""
    self._served.clear()


def _lease_vouches_at_once(self: Fence) -> bool:
    """The lease ground without "read the channel since the lease was granted"."""
    return bool(self._lease_stale_s() < self._fence_after_s)


def _channel_vouches_too_long(self: Fence) -> bool:
    """The channel ground for ten times its window: longer than the hand-over wait allows."""
    began = self._barrier_began
    return began is not None and self._clock.monotonic() - began < 10 * self._channel_fence_after_s


async def _never_reown(self: OwnershipReactor) -> None:
    """``_reown_unserved`` that never offers anything again (and never ends)."""
    await asyncio.get_running_loop().create_future()


def _resolve_ignoring_forced_terms(
    cur: ServiceUnitStateData | None, new: ServiceUnitStateData | None, *, highest_term: int
) -> Verdict:
    """``resolve`` that accepts a forced write from a deposed leader's term."""
    if new is not None and new.force and new.leader_term is not None:
        highest_term = min(highest_term, new.leader_term)
    return resolve(cur, new, highest_term=highest_term)


def _no_handover_wait(self: SidecarTimings) -> float:
    return 0.0


MUTATIONS: dict[str, Mutation] = {
    m.name: m
    for m in (
        Mutation(
            "lease-off",
            "brokers ignore their serving lease: a paused sidecar's broker serves on while its "
            "bundles move",
            faults=("pause-sidecar",),
            virtual_s=300.0,
        ),
        Mutation(
            "no-wait-out",
            "a release the broker did not acknowledge moves on at once instead of waiting out "
            "the broker's serving lease",
            patches=((BrokerLink, "wait_out_lease", _no_wait),),
            faults=("pause-broker", "transfer"),
            timings={"release_ack_timeout_s": 0.5},
            mean_fault_gap_s=4.0,
            virtual_s=240.0,
        ),
        Mutation(
            "stale-table-vouch",
            "a sidecar vouches on a new etcd lease before it has read the channel since (the "
            "bug of seeds 250 and 415): its table may still name its broker owner of bundles "
            "handed over meanwhile",
            patches=((Fence, "_lease_vouches", _lease_vouches_at_once),),
            faults=("etcd-cut-one", "channel-cut-one"),
            mean_fault_gap_s=10.0,
            fault_s=(1.0, 60.0),
        ),
        Mutation(
            "channel-window",
            "a sidecar vouches on a channel read barrier for ten times the channel window: cut "
            "off from etcd and the channel, it keeps its broker serving past the leader's "
            "hand-over wait",
            patches=((Fence, "_channel_vouches", _channel_vouches_too_long),),
            faults=("isolate-sidecar",),
            mean_fault_gap_s=10.0,
            fault_s=(10.0, 40.0),
        ),
        Mutation(
            "no-reown",
            "an Own the broker never acknowledged is never offered again (the bug of seed 440): "
            "a bundle stays Owned by a broker that does not serve it",
            patches=((OwnershipReactor, "_reown_unserved", _never_reown),),
            faults=("pause-sidecar", "pause-broker"),
            mean_fault_gap_s=5.0,
            fault_s=(1.0, 10.0),
        ),
        Mutation(
            "no-term-check",
            "a forced write from a deposed leader's term is applied",
            patches=((table, "resolve", _resolve_ignoring_forced_terms),),
        ),
        Mutation(
            "no-handover-wait",
            "the leader hands a gone broker's bundle over as soon as it announced the move, "
            "not after the hand-over wait",
            patches=((SidecarTimings, "handover_wait_s", property(_no_handover_wait)),),
            faults=("isolate-sidecar", "pause-sidecar"),
            # The grace is kept longer than fencing plus the serving lease as a second margin:
            # the search takes that margin away (a short grace, a long serving lease) to show
            # what the hand-over wait alone does.
            timings={"serving_lease_s": 20.0, "silence_timeout_s": 30.0},
            orphan_grace_s=2.0,
        ),
    )
}
