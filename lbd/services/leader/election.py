"""The leader elector: campaigns in the metadata store and runs the leader duties while leading.

Exactly one sidecar should run the cluster-wide duties (DESIGN §8; lbd/services/graph.py wires
six: the operation tracker, the unload scheduler, the ownership monitor, checkpoints, the drainer
and the safety auditor). The election is the metadata store's (lowest create revision
wins; the etcd term is that revision). Two terms come out of it:

- the **etcd term** T names the leadership: it is what :attr:`LeaderElector.leader` (so GetLeader)
  and the metrics report, as every sidecar's ``watch_leader`` sees the same;
- the **channel term** fences the leader's forced channel writes (DESIGN §4) and is what the
  duties get: T while the channel's highest term H is below T, else H + T (:func:`channel_term`).
  H >= T means a forged term in the channel (one within the resolver's ``MAX_TERM_JUMP``; larger
  ones are rejected) or an etcd whose revisions were reset; rather than stepping down for good, the
  leader leads above it.

The duties run as guarded tasks, one per duty, and stop:

- when the session becomes unreachable or loses its lease: a leader that cannot reach the store
  cannot know it still leads, so it does nothing that only a leader may do until the store says
  so again (it campaigns again: the same candidacy and term if the lease survived, a new one at
  the back of the queue if not);
- when the channel table shows a leader term above our channel term (Kafka's controller epoch):
  someone was elected after us (or forged a term), so we are deposed whatever our session says; we
  withdraw our candidacy and campaign again after a pause, to lead above that term if we win.

Every sidecar also follows who leads (``watch_leader``) for the API to forward leader-only
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from lbd.core.errors import PreconditionError
from lbd.core.ids import BrokerId
from lbd.core.probes import probe
from lbd.core.state import INT64_MAX
from lbd.metrics import Metrics
from lbd.ports.clock import Clock
from lbd.ports.errors import SessionExpiredError, UnavailableError
from lbd.ports.metadata import Leader, MetadataStore, SessionEvent, SessionEventKind
from lbd.services.channel.follower import ChannelFollower
from lbd.tasks import Component, Tasks

_log = logging.getLogger(__name__)


class LeaderDuty(Protocol):
    """A job only the leader does; runs from election to step-down."""

    @property
    def name(self) -> str:
        """Short name (the task is called ``leader-<name>``)."""
        ...

    async def run_leading(self, term: int) -> None:
        """Do the job for as long as it is not cancelled; ``term`` is the leader's channel term
        (the ``leader_term`` of its forced writes, see :func:`channel_term`).

        Must handle its own per-cycle failures (an unreachable store) and never return; an
        exception escaping it is a bug and stops the daemon.
        """
        ...


class StepDown(enum.Enum):
    """Why a leader stopped its duties (logged, one line)."""

    UNREACHABLE = "the metadata store is unreachable"
    LEASE_LOST = "the session lease was lost"
    HIGHER_TERM = "the channel shows a higher leader term"
    NO_TERM_LEFT = "the channel's highest term leaves no room for a higher one"
    DUTY_DIED = "a leader duty died"


def channel_term(etcd_term: int, highest: int) -> int:
    """The term a leader elected at ``etcd_term`` writes under, the channel's highest term being
    ``highest``: the etcd term when it is above ``highest``, else ``highest + etcd_term``.

    Either way it is above ``highest``, and for the same ``highest`` a later election (a higher
    etcd term) gives a higher channel term, so two leaders elected over the same table never share
    one. It lies at most ``etcd_term`` above ``highest``, within the resolver's ``MAX_TERM_JUMP``.
    """
    return etcd_term if highest < etcd_term else highest + etcd_term


class LeaderElector(Component):
    """Campaigns for ``me``; runs ``duties`` while leading; tells who leads."""

    def __init__(
        self,
        me: BrokerId,
        metadata: MetadataStore,
        follower: ChannelFollower,
        clock: Clock,
        duties: Sequence[LeaderDuty],
        *,
        metrics: Metrics,
        retry_s: float,
        on_death: Callable[[str, BaseException], None] | None = None,
    ) -> None:
        self._me = me
        self._metadata = metadata
        self._follower = follower
        self._clock = clock
        self._duties = tuple(duties)
        self._metrics = metrics
        self._retry_s = retry_s
        self._on_death = on_death
        self._term: int | None = None
        self._channel_term: int | None = None
        self._leader: Leader | None = None
        self._reachable = True
        self._stop: asyncio.Future[StepDown] | None = None
        self._tasks = Tasks(f"the leader election of {me}")
        self._closed = False

    @property
    def is_leader(self) -> bool:
        """Whether this sidecar runs the leader duties now."""
        return self._term is not None

    @property
    def term(self) -> int | None:
        """Our etcd term while we lead, else None."""
        return self._term

    @property
    def channel_term(self) -> int | None:
        """Our channel term (see :func:`channel_term`) while we lead, else None."""
        return self._channel_term

    @property
    def leader(self) -> Leader | None:
        """Who leads, as far as this sidecar knows (None: nobody, or not known yet)."""
        if self._term is not None:
            return Leader(self._me, self._term)
        return self._leader

    async def start(self) -> None:
        """Start campaigning and following the leader; returns at once."""
        if self._tasks or self._closed:
            return
        # Subscribed before campaigning, so no session event of our leadership is missed.
        events = self._metadata.session_events()
        # The watches end quietly with the store; only the campaign is vital.
        self._tasks.spawn(self._watch_session(events), name="leader-session")
        self._tasks.spawn(self._watch_leader(), name="leader-watch")
        self._tasks.spawn(self._campaign_loop(), name="leader-campaign", on_death=self._on_death)

    async def close(self) -> None:
        """Stop the duties and the campaign, withdraw the candidacy (best effort). Idempotent."""
        if self._closed:
            return
        self._closed = True
        started = bool(self._tasks)
        await self._tasks.close()
        if started:
            with contextlib.suppress(UnavailableError):
                await self._metadata.resign()

    # -- campaigning -------------------------------------------------------------------------

    async def _campaign_loop(self) -> None:
        while True:
            try:
                elected = await self._metadata.campaign(self._me)
            except UnavailableError as e:
                _log.info("leader election: campaign failed, retrying: %s", e)
                await self._clock.sleep(self._retry_s)
                continue
            reason = await self._lead(elected.term)
            if reason is StepDown.HIGHER_TERM:
                # Someone leads above our channel term: a newer leader or a forged term. Queue up
                # again; a new candidacy, if it wins, leads above the term now in the channel.
                with contextlib.suppress(UnavailableError, PreconditionError):
                    await self._metadata.resign()
            await self._clock.sleep(self._retry_s)

    async def _lead(self, term: int) -> StepDown:
        """Run the duties until a reason to stop; return that reason. ``term``: the etcd term."""
        if not self._reachable:
            _log.info("leader election: term %d won, but the store is unreachable", term)
            return StepDown.UNREACHABLE
        highest = self._follower.table.highest_term
        ours = channel_term(term, highest)
        if ours > INT64_MAX:
            # Only a forged term within a jump of the maximum gets here: no value can carry ours.
            _log.error(
                "leader election: term %d won, but the channel's highest term %d leaves no room "
                "for a higher one; the leader duties cannot run",
                term,
                highest,
            )
            return StepDown.NO_TERM_LEFT
        if ours != term:
            probe("term.adopt")
            _log.warning(
                "leader election: term %d won, but the channel has term %d: leading with "
                "channel term %d",
                term,
                highest,
                ours,
            )
        stop: asyncio.Future[StepDown] = asyncio.get_running_loop().create_future()
        self._stop = stop
        self._term, self._channel_term = term, ours
        self._observe()
        _log.info("leader election: %s leads with term %d (channel term %d)", self._me, term, ours)
        tasks = Tasks(f"the leadership of {self._me} in term {ours}")
        tasks.spawn(self._watch_terms(ours), name="leader-term-watch")
        for duty in self._duties:
            tasks.spawn(
                duty.run_leading(ours), name=f"leader-{duty.name}", on_death=self._duty_died
            )
        try:
            reason = await stop
            _log.warning(
                "leader election: %s steps down from term %d (channel term %d): %s",
                self._me,
                term,
                ours,
                reason.value,
            )
            return reason
        finally:
            self._stop = None
            # Without a bound: this leader campaigns again only once its duties have ended, so
            # that no duty of this term runs beside those of the next (the elector's close bounds
            # the wait, naming the campaign if a duty does not end).
            await tasks.close(within_s=None)
            self._term = self._channel_term = None
            self._observe()

    def _step_down(self, reason: StepDown) -> None:
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(reason)

    def _duty_died(self, name: str, error: BaseException) -> None:
        self._step_down(StepDown.DUTY_DIED)
        if self._on_death is not None:
            self._on_death(name, error)

    # -- watching ----------------------------------------------------------------------------

    async def _watch_session(self, events: AsyncIterator[SessionEvent]) -> None:
        try:
            async for event in events:
                if event.kind is SessionEventKind.UNREACHABLE:
                    self._reachable = False
                    self._step_down(StepDown.UNREACHABLE)
                elif event.kind is SessionEventKind.LEASE_LOST:
                    self._reachable = False
                    self._step_down(StepDown.LEASE_LOST)
                else:
                    self._reachable = True
        except SessionExpiredError:
            pass  # the sidecar's SessionWatcher stops the daemon
        # The session is over: whatever we led, we no longer know that we lead.
        self._reachable = False
        self._step_down(StepDown.LEASE_LOST)

    async def _watch_terms(self, term: int) -> None:
        """Step down once the channel shows a term above our channel term ``term``."""
        async for _ in self._follower.changes():
            highest = self._follower.table.highest_term
            if highest > term:
                _log.warning(
                    "leader election: channel term %d is above our channel term %d", highest, term
                )
                self._step_down(StepDown.HIGHER_TERM)
                return

    async def _watch_leader(self) -> None:
        async for leader in self._metadata.watch_leader():
            if leader != self._leader:
                _log.info(
                    "leader election: leader is %s",
                    "nobody" if leader is None else f"{leader.broker} (term {leader.term})",
                )
            self._leader = leader
            self._observe()

    def _observe(self) -> None:
        known = self.leader
        self._metrics.observe_leadership(
            leading=self.is_leader, term=None if known is None else known.term
        )
