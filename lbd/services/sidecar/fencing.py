"""Self-fencing (DESIGN §8, docs/safety.md): the sidecar vouches for its broker only while it
can be sure nobody else may be given the broker's bundles, and fences once it cannot.

It may vouch (grant the broker's serving lease) while either holds:

- **the metadata lease**: renewed less than ``fence_after_s`` ago, and the channel read through
  once since the current lease was granted and the broker's current registration was written.
  While the lease lives the registration lives (unless this sidecar withdraws it, for a silent
  broker), and the leader moves nothing of a registered broker's without this sidecar's own
  channel writes; what it announced while the broker was not registered, the read shows;
- **the channel read barrier**: a read barrier on the channel (everything the channel held then
  is applied) began less than ``channel_fence_after_s`` ago. Every move of this broker's bundles
  that its sidecar does not make itself is announced on the channel (``Releasing(src=me)``) and
  takes effect only after the leader's hand-over wait, ``channel_fence_after_s`` plus the serving
  lease and its margin, so the sidecar has seen it before the last lease it granted without
  seeing it runs out.

And in either case only while **the broker serves nothing the table moves away**: no bundle it
serves or is being told to serve is given to another, or announced away from it by the leader
(a forced ``Releasing``), without a Release or Close of it sent. The broker stops serving a
bundle the moment such a command arrives, before any lease granted after it, so a grant
withheld until then is all an announcement needs.

So a cluster-wide etcd outage stops nothing (the channel still vouches), a Pulsar outage stops
nothing (the lease still vouches), and a sidecar cut off from both, or paused, stops vouching
within ``fence_after_s`` (``channel_fence_after_s`` for the channel): it tells its broker to
close every bundle, and the broker's lease runs out on its own. When either holds again it
unfences; the ownership reactor then re-owns what the table still says is this broker's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator

from lbd.core.probes import probe
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, server_of
from lbd.metrics import Metrics
from lbd.ports.clock import Clock
from lbd.ports.errors import SessionExpiredError, UnavailableError
from lbd.ports.metadata import MetadataStore, SessionEvent, SessionEventKind
from lbd.services.channel.follower import ChannelFollower
from lbd.services.sidecar.broker_link import BrokerLink
from lbd.services.sidecar.registration import BrokerRegistration
from lbd.tasks import MIN_WAIT_S, Component, Tasks

_log = logging.getLogger(__name__)

AFTER_LAPSE_S = 1e-6
"""How long after the instant a ground would lapse its check looks. A barrier due at that same
instant renews the channel ground (the next one is due there in steady state, half a window
after the last); looking a microsecond later sees what it did, not which of two callbacks of
one instant ran first, and saves the check that found the ground renewed a moment later."""


def _announced_away(value: ServiceUnitStateData) -> bool:
    """Whether ``value`` is the leader's announcement of a move off its server (a forced
    ``Releasing``), which it hands over after its wait whatever the server's sidecar did. A
    ``Releasing`` the sidecar wrote itself is handed over only by the sidecar, once the broker
    acknowledged the Release or its lease ran out."""
    return value.state is ServiceUnitState.Releasing and value.force


class Fence(Component):
    """Keeps the two grounds for vouching up to date and fences or unfences the broker link."""

    def __init__(
        self,
        metadata: MetadataStore,
        link: BrokerLink,
        clock: Clock,
        follower: ChannelFollower,
        registration: BrokerRegistration,
        *,
        fence_after_s: float,
        channel_fence_after_s: float,
        check_interval_s: float,
        metrics: Metrics,
    ) -> None:
        if min(fence_after_s, channel_fence_after_s, check_interval_s) <= 0:
            raise ValueError(
                f"fence_after_s, channel_fence_after_s and check_interval_s must be > 0, got "
                f"{fence_after_s}, {channel_fence_after_s} and {check_interval_s}"
            )
        self._metadata = metadata
        self._link = link
        self._clock = clock
        self._follower = follower
        self._registration = registration
        self._fence_after_s = fence_after_s
        self._channel_fence_after_s = channel_fence_after_s
        self._check_interval_s = check_interval_s
        self._metrics = metrics
        self._fenced = False
        self._tasks = Tasks(f"the fence of {link.me}")
        self._subscribers: set[asyncio.Queue[bool]] = set()
        self._barrier_began: float | None = None
        """When the last completed channel read barrier began (clock-monotonic)."""
        self._barrier_failing = False
        self._readable_since: float | None = None
        self._on_channel_only = False
        self.fencings = 0
        """How many times this sidecar fenced itself."""

    @property
    def readable_since(self) -> float | None:
        """Since when (clock-monotonic) the channel has been read through without a break: a
        failed read barrier, or none completed for ``channel_fence_after_s``, starts a new run. None
        before :meth:`start`."""
        return self._readable_since

    @property
    def fenced(self) -> bool:
        """Whether the sidecar is fenced: its broker serves nothing, lookups never name it."""
        return self._fenced

    async def start(self) -> None:
        """Start the read barriers and the checks, every ``check_interval_s``.

        The sidecar starts after its follower caught up with the channel, which counts as the
        first read barrier.
        """
        if not self._tasks:
            self._barrier_began = self._readable_since = self._clock.monotonic()
            events = self._metadata.session_events()
            self._tasks.spawn(self._run(), name="fence")
            self._tasks.spawn(self._run_barriers(), name="fence-read-barrier")
            self._tasks.spawn(self._follow_session(events), name="fence-session")

    async def close(self) -> None:
        """Stop checking. Idempotent."""
        await self._tasks.close()

    def states(self) -> AsyncGenerator[bool, None]:
        """Each change of :attr:`fenced` from the moment of this call on (True: fenced)."""
        queue: asyncio.Queue[bool] = asyncio.Queue()
        self._subscribers.add(queue)
        return self._drain(queue)

    async def _drain(self, queue: asyncio.Queue[bool]) -> AsyncGenerator[bool, None]:
        try:
            while True:
                yield await queue.get()
        finally:
            self._subscribers.discard(queue)

    def vouches(self) -> bool:
        """Whether the sidecar may vouch for its broker's ownership (grant its serving lease)
        now: not fenced, the metadata lease or the channel read barrier is recent enough, and
        the broker serves nothing the table moves away. An Own sent on a table read before a
        pause (a split's retry, say) must not gain a lease: the reactor closes such a bundle,
        and the lease is granted again once it has (or, failing that, once the broker's lease
        ran out and it forgot everything). Nor may a bundle announced away from it
        (``Releasing(src=me)``) while its Release is not sent yet (it waits behind an Own of
        the same bundle, say): the leader's hand-over wait does not wait for that."""
        # The channel ground first: it is the cheaper look, and it holds in steady state.
        return (
            not self._fenced
            and (self._channel_vouches() or self._lease_vouches())
            and self._serves_only_its_own()
        )

    def _serves_only_its_own(self) -> bool:
        """Whether every bundle the broker may serve (:meth:`BrokerLink.possibly_served`) names
        it server in the table and is not announced away from it (or is a child, with no value
        yet, of a split of its own)."""
        table, me = self._follower.table, self._link.me
        for bundle in self._link.possibly_served():
            value = table.get(bundle)
            if value is None:
                if table.splitting_into(me, bundle):
                    continue
            elif server_of(value) == me and not _announced_away(value):
                continue
            probe("grant.withheld")
            return False
        return True

    def _lease_stale_s(self, now: float | None = None) -> float:
        """How long ago (at ``now``, the clock's time when None) the lease was last renewed."""
        if now is None:
            now = self._clock.monotonic()
        return now - self._metadata.last_renewed_monotonic

    def _lease_vouches(self, now: float | None = None) -> bool:
        """Whether the lease ground holds at ``now`` (the clock's time when None)."""
        # Read from the store itself, not from a session event that may not be delivered yet.
        metadata = self._metadata
        registered = self._registration.registered_since
        if registered is None:
            return False  # the leader may be handing the broker's bundles over
        if now is None:
            now = self._clock.monotonic()
        began = self._barrier_began
        read_since = began is not None and began >= max(
            metadata.lease_granted_monotonic, registered
        )
        fresh = self._lease_stale_s(now) < self._fence_after_s
        if fresh and began is not None and not read_since:
            probe("fence.read_since_lease")  # a lease or registration replaced since it read
        return read_since and fresh

    def _channel_vouches(self, now: float | None = None) -> bool:
        """Whether the channel ground holds at ``now`` (the clock's time when None)."""
        began = self._barrier_began
        if began is None:
            return False
        if now is None:
            now = self._clock.monotonic()
        return now - began < self._channel_fence_after_s

    async def check(self) -> bool:
        """Look at both grounds now, fence or unfence; the new state."""
        await self._check()
        return self._fenced

    async def _check(self) -> tuple[float, bool, bool]:
        """:meth:`check`; the time it looked and the grounds it found then (lease, channel)."""
        now = self._clock.monotonic()
        lease, channel = self._lease_vouches(now), self._channel_vouches(now)
        if not (lease or channel) and not self._fenced:
            probe("fence.enter")
            self._set(True)
            self.fencings += 1
            self._metrics.fence_total.inc()
            reason = (
                f"lease not renewed for {self._lease_stale_s():.1f}s (fence_after_s "
                f"{self._fence_after_s:g}) and no channel read barrier for "
                f"{self._barrier_age_s():.1f}s (channel_fence_after_s "
                f"{self._channel_fence_after_s:g})"
            )
            _log.error("fencing broker %s: %s; closing every bundle", self._link.me, reason)
            await self._link.fence(f"self-fencing: {reason}")
        elif (lease or channel) and self._fenced:
            _log.warning(
                "unfencing broker %s: %s",
                self._link.me,
                "the lease was renewed" if lease else "the channel reads through again",
            )
            probe("fence.exit")
            self._link.unfence()
            self._set(False)
        on_channel_only = channel and not lease and not self._fenced
        if on_channel_only != self._on_channel_only:
            self._on_channel_only = on_channel_only
            if on_channel_only:
                probe("fence.channel_only")
                _log.warning(
                    "broker %s: %s; vouching on the channel read barrier (no move of its "
                    "bundles can take effect unseen)",
                    self._link.me,
                    self._why_not_lease(),
                )
        return now, lease, channel

    def _why_not_lease(self) -> str:
        """Why the lease ground does not hold now."""
        if self._registration.registered_since is None:
            return "its registration is being written"
        stale_s = self._lease_stale_s()
        if stale_s >= self._fence_after_s:
            return f"lease not renewed for {stale_s:.1f}s"
        return "no channel read since its lease or registration began"

    def _barrier_age_s(self) -> float:
        began = self._barrier_began
        return float("inf") if began is None else self._clock.monotonic() - began

    def _set(self, fenced: bool) -> None:
        self._fenced = fenced
        self._metrics.fenced.set(1 if fenced else 0)
        for queue in self._subscribers:
            queue.put_nowait(fenced)

    async def _run(self) -> None:
        while True:
            now, lease, channel = await self._check()
            await self._clock.sleep(self._next_check_s(now, lease, channel))

    def _next_check_s(self, now: float, lease: bool, channel: bool) -> float:
        """How long after a check at ``now`` that found the grounds ``lease`` and ``channel``
        until the next one. While fenced, the check interval. While vouching, until the first of
        the grounds that hold would lapse (:data:`AFTER_LAPSE_S` after): no ground can lapse
        sooner, for lease renewals and barriers only move their ends later, and a new lease (whose
        grant voids the lease ground until a barrier) runs a check of its own
        (:meth:`_follow_session`). The grounds are the
        check's own: a check that fenced (and waited for the link) is fenced, and waits the
        interval."""
        if self._fenced or not channel or self._barrier_began is None:
            # Fenced: look for a ground to unfence. Vouching on the lease alone: a registration
            # rewritten or withdrawn voids the lease ground at once, so keep looking.
            return self._check_interval_s
        end = self._barrier_began + self._channel_fence_after_s
        if lease:
            end = min(end, self._metadata.last_renewed_monotonic + self._fence_after_s)
        return max(MIN_WAIT_S, end - now) + AFTER_LAPSE_S

    async def _run_barriers(self) -> None:
        while True:
            await self._barrier()
            await self._clock.sleep(self._until_next_barrier_s())

    def _until_next_barrier_s(self) -> float:
        """How long until the next read barrier: half the channel window while the lease
        ground holds and will hold for longer than the channel window plus that half (the
        channel ground is then a spare, and a barrier that often keeps it, the watchers' vouch
        and :attr:`readable_since` going); every ``check_interval_s`` otherwise.

        A lease ground that runs out does so no sooner than it looked here: once it could lapse
        within a channel window and a half, barriers come often again, and one of them begins
        within the last channel window before the lapse and completes long before it. One that
        is voided at once (a registration being rewritten; a new lease, whose own barrier
        :meth:`_follow_session` runs) leaves the channel ground, whose last barrier began at
        most half a window and one barrier's time ago: the next one, at most half a window
        later, renews it while a barrier takes under a quarter of the window."""
        relaxed_s = self._channel_fence_after_s / 2
        now = self._clock.monotonic()
        if self._fenced or not self._lease_vouches(now):
            return self._check_interval_s
        lease_left_s = self._fence_after_s - self._lease_stale_s(now)
        if lease_left_s > self._channel_fence_after_s + relaxed_s:
            return relaxed_s
        return self._check_interval_s

    async def _barrier(self) -> None:
        """One channel read barrier; when it completes, the time it began vouches."""
        began = self._clock.monotonic()
        try:
            # No deadline of its own: one that hangs only leaves the last completed barrier to
            # age, and cancelling a reader being made would leak it in the client.
            await self._follower.barrier()
        except UnavailableError as e:
            if not self._barrier_failing:
                _log.warning("channel read barrier failed: %s", e)
            self._barrier_failing = True
        else:
            done = self._clock.monotonic()
            previous = self._barrier_began
            if self._barrier_failing:
                _log.info("channel read barrier completed again")
            stale = previous is None or done - previous > self._channel_fence_after_s
            if self._barrier_failing or stale:
                self._readable_since = done
            self._barrier_failing = False
            self._barrier_began = max(began, self._barrier_began or began)

    async def _follow_session(self, events: AsyncIterator[SessionEvent]) -> None:
        with contextlib.suppress(SessionExpiredError):  # the SessionWatcher handles that
            async for event in events:
                if event.kind is SessionEventKind.RECONNECTED:
                    # A new lease counts only after the next read barrier: run one now, and
                    # look at the grounds again (the lease ground may have ended early).
                    await self.check()
                    await self._barrier()
                    await self.check()
