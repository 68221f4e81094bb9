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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lbd.core import table
from lbd.core.ids import BundleId
from lbd.core.settings import SidecarTimings
from lbd.core.state import Rule, ServiceUnitStateData, Verdict, resolve
from lbd.services.sidecar.broker_link import BrokerLink
from lbd.services.sidecar.fencing import Fence
from lbd.services.sidecar.reactor import OwnershipReactor


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


_on_lease_request = BrokerLink._on_lease_request


def _lapse_ignored(self: BrokerLink, request: Any, session: Any) -> None:
    """A lease request handled as ever, but a lapse it reports leaves the bundles the sidecar
    counts as served in place."""
    served = set(self._served)
    _on_lease_request(self, request, session)
    self._served |= served


async def _no_close_in_doubt(self: BrokerLink, bundle: BundleId, doubt: str) -> None:
    """An Own in doubt leaves the bundle with the broker instead of closing it."""


async def _barrier_without_reading(self: Fence) -> None:
    """A read barrier that vouches from the moment it began without reading anything."""
    self._barrier_began = self._clock.monotonic()


def _resolve_everything(
    cur: ServiceUnitStateData | None, new: ServiceUnitStateData | None, *, highest_term: int
) -> Verdict:
    """``resolve`` that accepts every value: stale versions and forbidden transitions too."""
    return Verdict(True, Rule.FORCED, "accepted without a check")


def _wait_without_lease(self: SidecarTimings) -> float:
    return self.channel_fence_after_s + self.lease_margin_s


def _lease_never_stale(self: Fence, now: float | None = None) -> float:
    """The lease's age as the lease ground sees it: never any."""
    return 0.0


def _cut_off(name: str, what: str, patch: tuple[object, str, object]) -> Mutation:
    """A bug searched for with sidecars cut off from etcd and the channel for 10 to 40 s: the
    grounds to vouch are all a cut-off sidecar has to stop its broker serving."""
    return Mutation(
        name,
        what,
        patches=(patch,),
        faults=("isolate-sidecar",),
        mean_fault_gap_s=10.0,
        fault_s=(10.0, 40.0),
    )


def _handover_wait(name: str, what: str, wait: Callable[[SidecarTimings], float]) -> Mutation:
    """A bug of the hand-over wait, searched for with its second margin taken away. The grace is
    kept longer than fencing plus the serving lease as a second margin: the search takes that
    margin away (a short grace, a long serving lease) to show what the hand-over wait alone
    does."""
    return Mutation(
        name,
        what,
        patches=((SidecarTimings, "handover_wait_s", property(wait)),),
        faults=("isolate-sidecar", "pause-sidecar"),
        timings={"serving_lease_s": 20.0, "silence_timeout_s": 30.0},
        orphan_grace_s=2.0,
    )


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
        _cut_off(
            "channel-window",
            "a sidecar vouches on a channel read barrier for ten times the channel window: cut "
            "off from etcd and the channel, it keeps its broker serving past the leader's "
            "hand-over wait",
            (Fence, "_channel_vouches", _channel_vouches_too_long),
        ),
        Mutation(
            "no-reown",
            "an Own the broker never acknowledged is never offered again (the bug of seed 440): "
            "a bundle stays Owned by a broker that does not serve it",
            patches=((OwnershipReactor, "_reown_unserved", _never_reown),),
            faults=("pause-sidecar", "pause-broker"),
            mean_fault_gap_s=5.0,
            fault_s=(1.0, 10.0),
            virtual_s=240.0,
        ),
        Mutation(
            "no-term-check",
            "a forced write from a deposed leader's term is applied",
            patches=((table, "resolve", _resolve_ignoring_forced_terms),),
        ),
        Mutation(
            "lapse-ignored",
            "a broker's report that its serving lease ran out leaves its sidecar counting every "
            "bundle it had as served: none is offered to it again, and they stay unserved",
            patches=((BrokerLink, "_on_lease_request", _lapse_ignored),),
            faults=("pause-broker", "pause-sidecar"),
            mean_fault_gap_s=10.0,
            fault_s=(1.0, 20.0),
        ),
        Mutation(
            "doubtful-own-kept",
            "an Own whose outcome is in doubt is not followed by a Close: the broker may hold a "
            "bundle its sidecar does not count, and serve it under the next lease after the "
            "bundle moved on",
            patches=((BrokerLink, "_close_in_doubt", _no_close_in_doubt),),
            faults=("pause-broker", "pause-sidecar", "transfer", "unload"),
            mean_fault_gap_s=5.0,
            fault_s=(1.0, 10.0),
            virtual_s=240.0,
        ),
        _cut_off(
            "barrier-without-read",
            "the channel read barrier vouches without reading the channel: a sidecar cut off "
            "from etcd and the channel keeps its broker serving bundles handed over meanwhile",
            (Fence, "_barrier", _barrier_without_reading),
        ),
        Mutation(
            "no-resolver",
            "every sidecar applies every value of the channel: stale versions and forbidden "
            "transitions included (a late write lands on a newer value)",
            patches=((table, "resolve", _resolve_everything),),
        ),
        _handover_wait(
            "wait-without-lease",
            "the hand-over wait leaves out the serving lease (the channel window and the margin "
            "only): a cut-off sidecar's broker still holds a lease granted before it stopped "
            "vouching when the new owner is told",
            _wait_without_lease,
        ),
        _cut_off(
            "lease-ground-unbounded",
            "a sidecar vouches on its etcd lease however long ago it was last renewed: cut off "
            "from etcd and the channel, it keeps its broker serving bundles handed over meanwhile",
            (Fence, "_lease_stale_s", _lease_never_stale),
        ),
        _handover_wait(
            "no-handover-wait",
            "the leader hands a gone broker's bundle over as soon as it announced the move, "
            "not after the hand-over wait",
            _no_handover_wait,
        ),
    )
}
