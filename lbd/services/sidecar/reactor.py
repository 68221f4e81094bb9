"""The ownership reactor: per-bundle reconciliation of this sidecar's broker with the table.

Who writes what (docs/sidecar.md, "Ownership protocol"): on ``Assigning(dst=me)`` the broker is
told to Own and, once it acknowledged, ``Owned(me)`` is proposed; on ``Releasing(src=me)`` the
broker is told to Release (to the new owner) and, once it acknowledged or the ack timed out,
``Assigning(dst, src=me)`` or ``Free(src=me)`` is proposed; on ``Splitting(src=me)`` the split is
finished. After every change of a bundle (and for all of them on attach, start and unfence) the
broker is reconciled with the table: it serves exactly the bundles that are ``Owned(me)``,
``Releasing(src=me)`` (until released) or ``Splitting(src=me)``.

Each bundle has at most one worker at a time, acting on the bundle's *current* value, so a
burst of changes of one bundle is handled once, and slow acks of one bundle never hold up others.
(Whether the broker is registered at all is :mod:`lbd.services.sidecar.registration`'s job.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator

from lbd.core.broker_info import BrokerInfo
from lbd.core.bundles import parse_bundle_id, split_points
from lbd.core.errors import DeadlineError, InvalidInputError, LbdError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.probes import probe
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, owner_of, server_of
from lbd.core.table import ApplyResult
from lbd.metrics import Metrics
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.services.channel.follower import ChannelFollower
from lbd.services.channel.proposals import Proposer
from lbd.services.cluster.namespaces import NamespaceService
from lbd.services.cluster.registry import BrokerRegistry
from lbd.services.sidecar.broker_link import BrokerLink, LinkEvent, LinkEventKind
from lbd.services.sidecar.fencing import Fence
from lbd.tasks import Component, Tasks, cancel_and_wait, guard

_log = logging.getLogger(__name__)

_S = ServiceUnitState

SPLIT_WRITE_WINDOW = 128
"""How many of a split's children have their Owned value in flight on the channel at once."""


def names(value: ServiceUnitStateData | None, broker: BrokerId) -> bool:
    """Whether ``value`` names ``broker`` as its dst or source broker."""
    return value is not None and broker in (value.dst_broker, value.source_broker)


class OwnershipReactor(Component):
    """Reacts to channel values naming this broker and keeps the broker equal to the table."""

    def __init__(
        self,
        me: BrokerId,
        *,
        follower: ChannelFollower,
        proposer: Proposer,
        link: BrokerLink,
        registry: BrokerRegistry,
        namespaces: NamespaceService,
        clock: Clock,
        fence: Fence,
        retry_s: float,
        reown_interval_s: float,
        metrics: Metrics,
    ) -> None:
        """``retry_s`` is the pause before retrying a proposal that met an outage;
        ``reown_interval_s`` how often bundles Owned by this broker that it does not serve are
        offered to it again (an Own it never acknowledged is not retried otherwise)."""
        self._me = me
        self._metrics = metrics
        self._follower = follower
        self._proposer = proposer
        self._link = link
        self._registry = registry
        self._namespaces = namespaces
        self._clock = clock
        self._fence = fence
        self._retry_s = retry_s
        self._reown_interval_s = reown_interval_s
        self._tasks = Tasks(f"the ownership reactor of {me}")
        self._workers: dict[BundleId, asyncio.Task[None]] = {}
        self._dirty: set[BundleId] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._released: dict[BundleId, int] = {}
        self._splitting_children: set[BundleId] = set()
        self.release_timeouts = 0
        """Releases that moved on without the broker's acknowledgement (timeout or refusal)."""

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Start reacting: reconcile every bundle now, then after every change."""
        if self._tasks:
            return
        # Each feed subscribes when called, and the table is read right after without an
        # await: no change falls between the first reconciliation and the feed.
        changes = self._follower.changes()
        link_events = self._link.events()
        fence_states = self._fence.states()
        await self.reconcile()
        self._tasks.spawn(self._follow_changes(changes), name=f"ownership-reactor-{self._me}")
        self._tasks.spawn(self._follow_link(link_events), name=f"broker-link-{self._me}")
        self._tasks.spawn(self._follow_fence(fence_states), name=f"fence-{self._me}")
        self._tasks.spawn(self._reown_unserved(), name=f"reown-{self._me}")

    async def close(self) -> None:
        """Stop reacting (in-progress work is cancelled). Idempotent."""
        workers = list(self._workers.values())
        await self._tasks.close()
        for worker in workers:
            await cancel_and_wait(worker)

    @property
    def busy(self) -> bool:
        """Whether some bundle has work in progress."""
        return bool(self._workers)

    async def idle(self) -> None:
        """Return once no bundle has work in progress (bound it with a timeout)."""
        while self._workers:
            await self._idle.wait()

    async def reconcile(self) -> None:
        """Check every bundle this broker serves or the table names it in."""
        bundles = set(self._link.served())
        bundles.update(b for b, v in self._follower.table.items() if names(v, self._me))
        _log.debug("reconciling %d bundle(s) of %s", len(bundles), self._me)
        for bundle in sorted(bundles):
            self._kick(bundle)

    # -- following ---------------------------------------------------------------------------

    async def _follow_changes(self, changes: AsyncGenerator[ApplyResult, None]) -> None:
        async with contextlib.aclosing(changes):
            async for result in changes:
                self._on_change(result)

    def _on_change(self, result: ApplyResult) -> None:
        bundle = result.key
        new = result.new
        if not (new is not None and new.state is _S.Releasing):
            self._released.pop(bundle, None)
        if (
            names(result.old, self._me)
            or self._link.serves(bundle)
            or bundle in self._splitting_children
            or (names(new, self._me) and not self._only_announced_to_me(new))
        ):
            self._kick(bundle)

    def _only_announced_to_me(self, new: ServiceUnitStateData | None) -> bool:
        """Whether ``new`` names this broker only as where another broker's bundle is going
        (a Releasing from another source): nothing to do until the Assigning that follows.
        A leader's repair announces ten thousand such moves at once."""
        return new is not None and new.state is _S.Releasing and new.source_broker != self._me

    async def _follow_link(self, events: AsyncGenerator[LinkEvent, None]) -> None:
        async with contextlib.aclosing(events):
            async for event in events:
                if event.kind in (LinkEventKind.ATTACHED, LinkEventKind.LAPSED):
                    await self.reconcile()

    async def _follow_fence(self, states: AsyncGenerator[bool, None]) -> None:
        async with contextlib.aclosing(states):
            async for fenced in states:
                if not fenced:
                    await self.reconcile()

    async def _reown_unserved(self) -> None:
        """Offer the broker again what it owns but does not serve. An Own that timed out (the
        broker was paused, or its stream stalled) is otherwise never sent again: nothing in the
        table changes, and a broker that lost its lease meanwhile reports no new lapse."""
        while True:
            await self._clock.sleep(self._reown_interval_s)
            if self._fenced or not (self._link.attached or self._link.auto_ack):
                continue
            served = self._link.served()
            for bundle in self._follower.table.owned_by(self._me):
                if bundle not in served:
                    probe("own.reoffer")
                    self._kick(bundle)

    # -- per-bundle work ---------------------------------------------------------------------

    def _kick(self, bundle: BundleId) -> None:
        if bundle in self._workers:
            self._dirty.add(bundle)
            return
        self._idle.clear()
        self._workers[bundle] = guard(self._work(bundle), name=f"ownership-{bundle}")

    async def _work(self, bundle: BundleId) -> None:
        try:
            while True:
                self._dirty.discard(bundle)
                try:
                    await self._settle(bundle)
                except (UnavailableError, DeadlineError) as e:
                    _log.warning("%s: %s; retrying in %gs", bundle, e, self._retry_s)
                    await self._clock.sleep(self._retry_s)
                    self._dirty.add(bundle)
                if bundle not in self._dirty:
                    return
        finally:
            del self._workers[bundle]
            if not self._workers:
                self._idle.set()

    @property
    def _fenced(self) -> bool:
        return self._link.fenced or self._fence.fenced

    async def _settle(self, bundle: BundleId) -> None:
        value = self._follower.get(bundle)
        me = self._me
        if value is not None:
            if value.state is _S.Assigning and value.dst_broker == me:
                await self._take(bundle, value)
                return
            if value.state is _S.Releasing and value.source_broker == me:
                await self._release(bundle, value)
                return
            if value.state is _S.Splitting and value.source_broker == me:
                await self._finish_split(bundle, value)
                return
        wanted = value is not None and (
            owner_of(value) == me or (value.state is _S.Splitting and value.source_broker == me)
        )
        served = self._link.serves(bundle)
        if wanted and not served and (blocker := self._overlapping_server(bundle)) is not None:
            # A split undone by the leader while its children were being written: the table
            # holds both. The parent is not served while another broker serves part of it.
            probe("own.overlap_blocked")
            _log.warning("%s overlaps %s, served by %s: not taking it", bundle, *blocker)
        elif wanted and not served and not self._fenced:
            if not await self._link.own(bundle):
                _log.warning("broker %s did not take %s, which it owns", me, bundle)
        elif served and not wanted and bundle not in self._splitting_children:
            state = "Init" if value is None else value.state.value
            await self._link.close_bundle(bundle, f"the table says {state}, not owned by {me}")

    async def _propose_next(
        self,
        bundle: BundleId,
        seen: ServiceUnitStateData,
        state: ServiceUnitState,
        *,
        dst: BrokerId | None = None,
        src: BrokerId | None = None,
    ) -> bool:
        """Propose ``state`` on top of ``seen``, unless the bundle moved on meanwhile."""
        if self._follower.get(bundle) != seen:
            return False
        return await self._proposer.propose_and_wait(bundle, state, dst=dst, src=src)

    async def _take(self, bundle: BundleId, value: ServiceUnitStateData) -> None:
        if self._fenced:
            return
        if not await self._link.own(bundle):
            _log.warning("broker %s did not take %s; it stays Assigning", self._me, bundle)
            return
        if value.source_broker is not None and value.timestamp_ms > 0 and not value.force:
            # A transfer: its source wrote this Assigning right after its broker acknowledged
            # the Release; nobody served the bundle from then until this acknowledgement.
            unserved_ms = max(0, self._clock.now_ms() - value.timestamp_ms)
            self._metrics.transfer_unavailable.observe(unserved_ms / 1000)
        won = await self._propose_next(
            bundle, value, _S.Owned, dst=self._me, src=value.source_broker
        )
        _log.debug("%s: Owned by %s%s", bundle, self._me, "" if won else " not accepted")

    async def _release(self, bundle: BundleId, value: ServiceUnitStateData) -> None:
        if self._released.get(bundle) != value.version_id:
            if value.force:
                probe("orphan.self_release")  # the leader announced it away from this broker
            await self._close_overlapping(bundle)
            dst = value.dst_broker
            new_owner = None if dst is None else (self._registry.get(dst) or BrokerInfo(dst))
            started = self._clock.monotonic()
            acked = await self._link.release(bundle, new_owner)
            self._metrics.release_latency.observe(self._clock.monotonic() - started)
            if not acked:
                probe("release.ack_timeout")
                self.release_timeouts += 1
                self._metrics.release_ack_timeouts.inc()
                _log.warning(
                    "%s: release not acknowledged by %s; moving on once its serving lease has "
                    "run out",
                    bundle,
                    self._me,
                )
                await self._link.wait_out_lease()
            self._released[bundle] = value.version_id
        if value.dst_broker is not None:
            await self._propose_next(
                bundle, value, _S.Assigning, dst=value.dst_broker, src=self._me
            )
        else:
            await self._propose_next(bundle, value, _S.Free, src=self._me)

    def _overlapping_server(self, bundle: BundleId) -> tuple[BundleId, BrokerId] | None:
        """Another bundle of the table whose range overlaps ``bundle`` and whose server is
        another broker, if any."""
        for other, value in self._follower.table.overlapping(bundle):
            server = server_of(value)
            if server is not None and server != self._me:
                return other, server
        return None

    def _still_mine(self, child: ServiceUnitStateData | None) -> bool:
        """Whether a split's child is still this broker's to take: no value yet, or Owned by
        or being assigned to this broker (not moving away)."""
        return child is None or (
            child.state in (_S.Owned, _S.Assigning) and child.dst_broker == self._me
        )

    async def _close_overlapping(self, bundle: BundleId) -> None:
        """Stop serving every other bundle whose range overlaps ``bundle`` (the parent of a split
        in progress): the broker would otherwise still serve ``bundle``'s topics through it
        once ``bundle`` has gone elsewhere."""
        whole = parse_bundle_id(bundle)
        for other in sorted(self._link.served()):
            if other != bundle and parse_bundle_id(other).overlaps(whole):
                await self._link.close_bundle(other, f"{bundle}, which it overlaps, is moving")

    async def _finish_split(self, parent: BundleId, value: ServiceUnitStateData) -> None:
        children = dict(value.split_children or {})
        try:
            points = split_points(parent, children)
        except InvalidInputError as e:
            _log.error("cannot finish the split of %s: %s", parent, e)
            return
        if self._fenced:
            return
        self._splitting_children.update(children)
        try:
            await self._split_steps(parent, value, sorted(children), points)
        finally:
            self._splitting_children.difference_update(children)
            # A child the split left behind (undone by the leader, or not finished) is closed
            # unless the table gives it to this broker.
            for child in sorted(children):
                if self._link.serves(child):
                    self._kick(child)

    async def _split_steps(
        self, parent: BundleId, value: ServiceUnitStateData, children: list[BundleId], at: list[int]
    ) -> None:
        # Children are Owned before the namespace layout shows them: a sidecar that reads the
        # new layout then can never find a child unowned and assign it to another broker. A
        # child that has a value naming another broker moved on (the leader handed it over
        # while this split waited): it is never taken back.
        mine = [c for c in children if self._still_mine(self._follower.get(c))]
        owned = await asyncio.gather(*(self._link.own(child) for child in mine))
        if not all(owned):
            _log.warning("%s: the broker did not take every child; split not finished", parent)
            return
        # The children's Owned values are written SPLIT_WRITE_WINDOW at a time, each only
        # while the parent is still the value being finished: a child written just before the
        # parent changed is one the split left behind, as with one write at a time.
        window = asyncio.Semaphore(SPLIT_WRITE_WINDOW)
        moved_on = False

        async def own(child: BundleId) -> None:
            nonlocal moved_on
            async with window:
                if moved_on or owner_of(self._follower.get(child)) == self._me:
                    return
                if self._follower.get(parent) != value:
                    moved_on = True
                    return
                await self._proposer.propose_and_wait(child, _S.Owned, dst=self._me)

        await asyncio.gather(*(own(child) for child in mine))
        if moved_on:
            _log.warning("%s changed while it was being split: split not finished", parent)
            return
        lost = [c for c in children if server_of(self._follower.get(c)) is None]
        if lost:
            _log.error(
                "%s: children %s are not Owned by %s; split not finished", parent, lost, self._me
            )
            return
        whole = parse_bundle_id(parent)
        try:
            await self._namespaces.split(whole.namespace, whole.range, at)
        except LbdError as e:
            if isinstance(e, UnavailableError):
                raise
            _log.error("%s: the namespace layout could not be split: %s", parent, e)
            return
        await self._propose_next(parent, value, _S.Deleted, src=self._me)
        await self._link.close_bundle(parent, f"split into {', '.join(children)}")
        _log.info("%s: split into %s, owned by %s", parent, ", ".join(children), self._me)
