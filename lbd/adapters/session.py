"""The metadata session (DESIGN §8, PIP-57): one lease, kept alive, replaced when lost.

Shared by the etcd adapter and its in-memory twin, so both behave the same way; each supplies a
:class:`LeaseBackend` (grant, refresh, revoke) and a ``restore`` callback that re-writes what lived
under the lease (the broker registration, the candidacy).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from lbd.ports.clock import Clock
from lbd.ports.errors import SessionExpiredError, UnavailableError
from lbd.ports.metadata import SessionEvent, SessionEventKind
from lbd.tasks import Component, Tasks

log = logging.getLogger(__name__)

SessionExpiredPolicy = Literal["reconnect", "shutdown"]


@dataclass(frozen=True, slots=True)
class SessionPolicy:
    """The lease timing and what to do when it is lost (the ``[etcd]`` settings)."""

    lease_ttl_s: int
    keepalive_interval_s: float
    session_expired_policy: SessionExpiredPolicy = "reconnect"
    reconnect_retries: int = 3
    """With ``shutdown``: grant attempts after a lease loss before giving up (0: give up at once).
    ``reconnect`` tries for as long as it takes."""

    def __post_init__(self) -> None:
        if self.lease_ttl_s < 1:
            raise ValueError(f"lease_ttl_s must be >= 1, got {self.lease_ttl_s}")
        if not self.keepalive_interval_s > 0:
            raise ValueError(f"keepalive_interval_s must be > 0, got {self.keepalive_interval_s}")
        if self.reconnect_retries < 0:
            raise ValueError(f"reconnect_retries must be >= 0, got {self.reconnect_retries}")


class LeaseBackend(Protocol):
    """The three lease operations of a store; each raises UnavailableError when unreachable."""

    async def grant(self, ttl_s: int) -> int:
        """Grant a lease and return its id."""
        ...

    async def refresh(self, lease_id: int) -> bool:
        """Renew the lease; False when it no longer exists (expired or revoked)."""
        ...

    async def revoke(self, lease_id: int) -> None:
        """Revoke the lease (its keys vanish)."""
        ...


class EventHub:
    """Fan-out of session events: each subscription gets every event published after it began."""

    def __init__(self) -> None:
        self._queues: set[asyncio.Queue[SessionEvent | BaseException | None]] = set()
        self._ended: BaseException | None = None
        self._closed = False

    def publish(self, event: SessionEvent) -> None:
        """Deliver ``event`` to every current subscription."""
        log.info("metadata session: %s (lease %x)", event.kind.value, event.lease_id)
        for queue in self._queues:
            queue.put_nowait(event)

    def end(self, error: BaseException | None = None) -> None:
        """End every subscription, raising ``error`` in it after its pending events."""
        if self._closed:
            return
        self._closed = True
        self._ended = error
        for queue in self._queues:
            queue.put_nowait(error)

    def subscribe(self) -> AsyncIterator[SessionEvent]:
        """A subscription that starts now (not at its first ``__anext__``)."""
        queue: asyncio.Queue[SessionEvent | BaseException | None] = asyncio.Queue()
        if self._closed:
            queue.put_nowait(self._ended)
        else:
            self._queues.add(queue)
        return self._drain(queue)

    async def _drain(
        self, queue: asyncio.Queue[SessionEvent | BaseException | None]
    ) -> AsyncIterator[SessionEvent]:
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._queues.discard(queue)


class LeaseSession(Component):
    """Grants the lease, refreshes it every keepalive interval, and reports what happens.

    A failed refresh makes the session UNREACHABLE (once per outage) and it keeps trying; a refresh
    that succeeds again makes it REACHABLE; a refresh that finds the lease gone gives LEASE_LOST,
    then (policy permitting) a new lease, ``restore(new_lease_id)`` and RECONNECTED. When the
    policy gives up, subscriptions raise :class:`SessionExpiredError` and the keepalive task ends
    with it.
    """

    def __init__(
        self,
        backend: LeaseBackend,
        policy: SessionPolicy,
        clock: Clock,
        restore: Callable[[int], Awaitable[None]],
        name: str = "metadata-session",
    ) -> None:
        self._backend = backend
        self._policy = policy
        self._clock = clock
        self._restore = restore
        self._name = name
        self._hub = EventHub()
        self._lease_id: int | None = None
        self._last_renewed = clock.monotonic()
        self._granted = self._last_renewed
        self._reachable = True
        self._tasks = Tasks(name)
        self._closed = False

    @property
    def lease_id(self) -> int:
        """The current lease; raises if the session has not started."""
        if self._lease_id is None:
            raise RuntimeError(f"{self._name} has not started: no lease yet")
        return self._lease_id

    @property
    def last_renewed_monotonic(self) -> float:
        """When the last successful renewal (or grant) was sent, on the session's clock."""
        return self._last_renewed

    @property
    def lease_granted_monotonic(self) -> float:
        """When the grant of the current lease was sent, on the session's clock."""
        return self._granted

    def events(self) -> AsyncIterator[SessionEvent]:
        """Subscribe to session events from now on."""
        return self._hub.subscribe()

    async def start(self) -> None:
        """Grant the first lease (raises UnavailableError) and start the keepalive task."""
        if self._tasks or self._closed:
            return
        sent = self._clock.monotonic()
        self._lease_id = await self._backend.grant(self._policy.lease_ttl_s)
        self._granted = sent
        self._last_renewed = sent
        self._tasks.spawn(self._keepalive(), name=f"{self._name}-keepalive")

    def note_unreachable(self) -> None:
        """A request of the store failed for want of a connection: enter the outage now."""
        if self._reachable and self._lease_id is not None and not self._closed:
            self._reachable = False
            self._emit(SessionEventKind.UNREACHABLE)

    async def close(self) -> None:
        """Stop the keepalive, revoke the lease (best effort), end subscriptions. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._tasks.close()
        if self._lease_id is not None:
            with contextlib.suppress(UnavailableError):
                await self._backend.revoke(self._lease_id)
        self._hub.end()

    def _emit(self, kind: SessionEventKind) -> None:
        self._hub.publish(SessionEvent(kind, self.lease_id, self._clock.monotonic()))

    async def _keepalive(self) -> None:
        try:
            while True:
                await self._clock.sleep(self._policy.keepalive_interval_s)
                sent = self._clock.monotonic()
                try:
                    alive = await self._backend.refresh(self.lease_id)
                except UnavailableError as e:
                    log.warning("lease %x renewal failed: %s", self.lease_id, e)
                    self.note_unreachable()
                    continue
                if alive:
                    self._last_renewed = sent
                    if not self._reachable:
                        self._reachable = True
                        self._emit(SessionEventKind.REACHABLE)
                    continue
                self._emit(SessionEventKind.LEASE_LOST)
                await self._replace_lease()
        except asyncio.CancelledError:
            raise
        except SessionExpiredError as e:
            # The policy's own end, not a crash: subscribers (the sidecar's SessionWatcher, which
            # stops the daemon and says why) learn that the session is over.
            self._hub.end(e)
        except Exception as e:
            self._hub.end(e)
            raise

    async def _replace_lease(self) -> None:
        failures = 0
        while True:
            if (
                self._policy.session_expired_policy == "shutdown"
                and failures >= self._policy.reconnect_retries
            ):
                raise SessionExpiredError(
                    f"lease {self.lease_id:x} lost and not replaced after {failures} attempt(s) "
                    "(etcd.session_expired_policy = shutdown): stopping"
                )
            sent = self._clock.monotonic()
            try:
                lease_id = await self._backend.grant(self._policy.lease_ttl_s)
            except UnavailableError as e:
                failures += 1
                log.warning("granting a new lease failed (attempt %d): %s", failures, e)
                await self._clock.sleep(self._policy.keepalive_interval_s)
                continue
            # Set before restoring, so that anything written meanwhile goes under the new lease.
            self._lease_id = lease_id
            self._granted = sent
            try:
                await self._restore(lease_id)
            except UnavailableError as e:
                failures += 1
                log.warning("re-registering under lease %x failed: %s", lease_id, e)
                with contextlib.suppress(UnavailableError):
                    await self._backend.revoke(lease_id)
                await self._clock.sleep(self._policy.keepalive_interval_s)
                continue
            self._last_renewed = sent
            self._reachable = True
            self._emit(SessionEventKind.RECONNECTED)
            return
