"""The metadata store on etcd: broker registry, leader election, namespace records (DESIGN §3, §8).

Keys under the cluster prefix:

- ``brokers/<broker_id>``: the registration, under the session lease;
- ``leader/<lease id hex>``: one candidacy per session, value = broker id, under the lease. The
  candidate with the lowest create revision leads and its create revision is the term; the others
  each watch the candidacy just before their own (the etcd v3 election recipe: no thundering herd);
- ``namespaces/<tenant>/<ns>``: compare-and-swap on the mod revision, in a transaction;
- ``maintenance/<broker_id>``: a broker's maintenance record, under no lease (a cordon outlives
  the broker's session).

Watches resume from the last revision they delivered after a broken stream or an etcd restart.
When etcd has compacted that revision, the watch lists the prefix again and emits the differences
between what it had delivered and the listing, as if they had happened at the listing's revision:
consumers miss intermediate values, never the final state. Reconnect pauses use the real event
loop clock (network back-off), everything else the injected :class:`~lbd.ports.clock.Clock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from lbd.adapters.clock import SystemClock
from lbd.adapters.etcd import (
    EtcdConnection,
    EtcdKeys,
    EtcdOptions,
    KeyValue,
    RevisionCompactedError,
    WatchEvent,
    WatchStream,
)
from lbd.adapters.etcd_session import EtcdLeaseBackend
from lbd.adapters.session import LeaseSession
from lbd.core.errors import PreconditionError
from lbd.core.ids import BrokerId
from lbd.ports.clock import Clock
from lbd.ports.errors import CasConflictError, UnavailableError
from lbd.ports.metadata import (
    Leader,
    MaintenanceEvent,
    NamespaceEvent,
    RegistryEvent,
    SessionEvent,
    Versioned,
)

log = logging.getLogger(__name__)

_RETRY_FIRST_S = 0.1
_RETRY_MAX_S = 2.0


class EtcdMetadataStore:
    """:class:`~lbd.ports.metadata.MetadataStore` on etcd, over a shared :class:`EtcdConnection`.

    The connection belongs to the caller (the checkpoint store uses it too); :meth:`close` ends
    the session and the watches, not the connection.
    """

    def __init__(
        self, conn: EtcdConnection, options: EtcdOptions, clock: Clock | None = None
    ) -> None:
        self._conn = conn
        self._keys = EtcdKeys(options.prefix)
        self._clock = clock if clock is not None else SystemClock()
        self._session = LeaseSession(
            EtcdLeaseBackend(conn),
            options.session,
            self._clock,
            restore=self._restore,
            name="etcd-session",
        )
        conn.on_unavailable = self._session.note_unreachable
        self._registrations: dict[BrokerId, bytes] = {}
        self._candidate: BrokerId | None = None
        self._streams: set[WatchStream] = set()
        self._campaign_streams: set[WatchStream] = set()
        self._closed = asyncio.Event()

    @property
    def keys(self) -> EtcdKeys:
        """The key layout in use."""
        return self._keys

    @property
    def lease_id(self) -> int:
        """The current session lease."""
        return self._session.lease_id

    @property
    def last_renewed_monotonic(self) -> float:
        """When the last successful lease renewal was sent (for self-fencing)."""
        return self._session.last_renewed_monotonic

    @property
    def lease_granted_monotonic(self) -> float:
        """When the grant of the current lease was sent."""
        return self._session.lease_granted_monotonic

    async def start(self) -> None:
        """Grant the session lease and start the keepalive task."""
        await self._session.start()

    async def close(self) -> None:
        """End the watches and the session (the lease is revoked). Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        for stream in list(self._streams):
            await stream.cancel()
        await self._session.close()

    def session_events(self) -> AsyncIterator[SessionEvent]:
        """Session events from now on."""
        return self._session.events()

    # -- registry ---------------------------------------------------------------------------

    async def register_broker(self, broker: BrokerId, info: bytes) -> None:
        """Write ``brokers/<broker>`` under the lease; re-written after every new lease."""
        self._registrations[broker] = info
        await self._put_registration(broker, info, self._session.lease_id)

    async def _put_registration(self, broker: BrokerId, info: bytes, lease_id: int) -> None:
        await self._conn.put(self._keys.broker(broker), info, lease_id)

    async def deregister_broker(self, broker: BrokerId) -> None:
        """Delete ``brokers/<broker>``; it is no longer re-written under a new lease."""
        self._registrations.pop(broker, None)
        key = self._keys.broker(broker)
        await self._conn.call(lambda c: c.delete(key), f"delete {key.decode()}")

    async def list_brokers(self) -> tuple[dict[BrokerId, bytes], int]:
        """Live registrations and the revision they were read at."""
        kvs, revision = await self._conn.list_prefix(self._keys.brokers)
        return {self._broker_of(kv.key): kv.value for kv in kvs}, revision

    async def watch_brokers(self, after_revision: int) -> AsyncIterator[RegistryEvent]:
        """Registry changes after ``after_revision``; see the module docstring on compaction."""
        known = await self._state_at(self._keys.brokers, after_revision)
        async for event in self._follow(self._keys.brokers, known, after_revision):
            yield RegistryEvent(self._broker_of(event.key), event.value, event.revision)

    def _broker_of(self, key: bytes) -> BrokerId:
        return BrokerId(key[len(self._keys.brokers) :].decode())

    # -- election ---------------------------------------------------------------------------

    async def campaign(self, candidate: BrokerId) -> Leader:
        """Stand as ``candidate`` and wait until it leads."""
        self._candidate = candidate
        await self._put_candidacy(self._session.lease_id, candidate)
        while True:
            if self._closed.is_set():
                raise UnavailableError("campaign: the metadata store is closed")
            if self._candidate != candidate:
                raise PreconditionError(f"campaign of {candidate}: the candidacy was withdrawn")
            kvs, revision = await self._conn.list_prefix(self._keys.leader)
            queue = sorted(kvs, key=lambda kv: kv.create_revision)
            mine = self._keys.candidate(self._session.lease_id)
            position = next((i for i, kv in enumerate(queue) if kv.key == mine), None)
            if position == 0:
                term = queue[0].create_revision
                log.info("%s leads (term %d)", candidate, term)
                return Leader(candidate, term)
            if position is None:
                # Lost with the lease; the session re-writes it under the next one.
                await self._next_event(self._keys.leader, revision, prefix=True)
            else:
                await self._wait_deleted(queue[position - 1].key, revision)

    async def resign(self) -> None:
        """Delete this session's candidacy. Idempotent."""
        self._candidate = None
        key = self._keys.candidate(self._session.lease_id)
        await self._conn.call(lambda c: c.delete(key), "resign")
        # A campaign waiting on another candidate's key learns of the withdrawal now.
        for stream in list(self._campaign_streams):
            await stream.cancel()

    async def get_leader(self) -> Leader | None:
        """The candidate with the lowest create revision, or None."""
        kvs, _ = await self._conn.list_prefix(self._keys.leader)
        return _leader_of({kv.key: kv for kv in kvs})

    async def watch_leader(self) -> AsyncIterator[Leader | None]:
        """The leader now, then each change."""
        while True:
            try:
                kvs, revision = await self._conn.list_prefix(self._keys.leader)
                break
            except UnavailableError:
                if not await self._pause(_RETRY_FIRST_S):
                    return
        known = {kv.key: kv for kv in kvs}
        current = _leader_of(known)
        yield current
        async for _ in self._follow(self._keys.leader, known, revision):
            leader = _leader_of(known)
            if leader != current:
                current = leader
                yield current

    async def _put_candidacy(self, lease_id: int, candidate: BrokerId) -> None:
        # A put on an existing key keeps its create revision: re-campaigning keeps the place.
        await self._conn.put(self._keys.candidate(lease_id), candidate.encode(), lease_id)

    async def _wait_deleted(self, key: bytes, revision: int) -> None:
        """Until ``key`` is deleted after ``revision`` (or the wait is cancelled)."""
        await self._campaign_wait(key, revision, prefix=False, deleted_only=True)

    async def _next_event(self, key: bytes, revision: int, *, prefix: bool) -> None:
        """Until anything changes at ``key`` (or under it) after ``revision``."""
        await self._campaign_wait(key, revision, prefix=prefix, deleted_only=False)

    async def _campaign_wait(
        self, key: bytes, revision: int, *, prefix: bool, deleted_only: bool
    ) -> None:
        stream = await self._conn.watch(key, revision + 1, prefix=prefix)
        self._streams.add(stream)
        self._campaign_streams.add(stream)
        try:
            async for event in stream:
                if event.value is None or not deleted_only:
                    return
        finally:
            self._streams.discard(stream)
            self._campaign_streams.discard(stream)

    # -- namespaces -------------------------------------------------------------------------

    async def get_namespace(self, namespace: str) -> Versioned | None:
        """``namespaces/<tenant>/<ns>`` with its revisions, or None."""
        kv = await self._conn.get(self._keys.namespace(namespace))
        return None if kv is None else _versioned(kv)

    async def list_namespaces(self) -> tuple[dict[str, Versioned], int]:
        """Every namespace record and the revision it was read at."""
        kvs, revision = await self._conn.list_prefix(self._keys.namespaces)
        start = len(self._keys.namespaces)
        return {kv.key[start:].decode(): _versioned(kv) for kv in kvs}, revision

    async def watch_namespaces(self, after_revision: int) -> AsyncIterator[NamespaceEvent]:
        """Namespace record changes after ``after_revision`` (resumed like the registry's)."""
        known = await self._state_at(self._keys.namespaces, after_revision)
        start = len(self._keys.namespaces)
        async for event in self._follow(self._keys.namespaces, known, after_revision):
            yield NamespaceEvent(event.key[start:].decode(), event.value, event.revision)

    async def put_namespace(self, namespace: str, value: bytes, expected_mod_revision: int) -> int:
        """Write if the mod revision is still ``expected_mod_revision`` (0: must not exist)."""
        return await self._swap(
            self._keys.namespace(namespace), value, expected_mod_revision, namespace
        )

    # -- maintenance --------------------------------------------------------------------------

    async def list_maintenance(self) -> tuple[dict[BrokerId, tuple[bytes, int]], int]:
        """Every maintenance record with its mod revision, and the revision it was read at."""
        kvs, revision = await self._conn.list_prefix(self._keys.maintenance)
        return {self._maintained(kv.key): (kv.value, kv.mod_revision) for kv in kvs}, revision

    async def put_maintenance(
        self, broker: BrokerId, value: bytes, expected_mod_revision: int | None = None
    ) -> int:
        """Write ``maintenance/<broker>`` under no lease (with ``expected_mod_revision``, only
        while the record is at it); the revision of the write."""
        key = self._keys.maintenance_of(broker)
        if expected_mod_revision is None:
            return await self._conn.put(key, value)
        return await self._swap(key, value, expected_mod_revision, key.decode())

    async def _swap(self, key: bytes, value: bytes, expected: int, name: str) -> int:
        """Write ``key`` if its mod revision is still ``expected`` (0: absent); the new mod
        revision, or CasConflictError naming ``name``."""
        written, now = await self._conn.swap(key, value, expected)
        if not written or now is None:
            raise CasConflictError(name, expected, None if now is None else now.mod_revision)
        return now.mod_revision

    async def delete_maintenance(self, broker: BrokerId) -> int:
        """Delete ``maintenance/<broker>`` (idempotent); the revision of the delete (0: none)."""
        key = self._keys.maintenance_of(broker)
        deleted = await self._conn.call(lambda c: c.delete(key), f"delete {key.decode()}")
        if deleted is None:  # nothing was there: no revision was made
            return 0
        revision: int = deleted.header.revision
        return revision

    async def watch_maintenance(self, after_revision: int) -> AsyncIterator[MaintenanceEvent]:
        """Maintenance changes after ``after_revision`` (resumed like the registry's watch)."""
        known = await self._state_at(self._keys.maintenance, after_revision)
        async for event in self._follow(self._keys.maintenance, known, after_revision):
            yield MaintenanceEvent(self._maintained(event.key), event.value, event.revision)

    def _maintained(self, key: bytes) -> BrokerId:
        return BrokerId(key[len(self._keys.maintenance) :].decode())

    # -- watches ----------------------------------------------------------------------------

    async def _state_at(self, prefix: bytes, revision: int) -> dict[bytes, KeyValue]:
        """The keys under ``prefix`` at ``revision`` (what a resumed watch diffs against)."""
        if revision <= 0:
            return {}
        while True:
            try:
                kvs = await self._conn.list_prefix_at(prefix, revision)
                return {kv.key: kv for kv in kvs}
            except RevisionCompactedError:
                # The caller's revision is already gone: the first resync reports every live
                # key as a put (deletions before it cannot be known).
                return {}
            except UnavailableError:
                if not await self._pause(_RETRY_FIRST_S):
                    return {}

    async def _follow(
        self, prefix: bytes, known: dict[bytes, KeyValue], revision: int
    ) -> AsyncIterator[WatchEvent]:
        """Changes under ``prefix`` after ``revision``, given the state ``known`` at it.

        Ends only when the store closes. ``known`` is kept up to date with what was delivered.
        """
        delay = _RETRY_FIRST_S
        while not self._closed.is_set():
            try:
                stream = await self._conn.watch(prefix, revision + 1, prefix=True)
            except UnavailableError:
                if not await self._pause(delay):
                    return
                delay = min(delay * 2, _RETRY_MAX_S)
                continue
            except RevisionCompactedError:
                stream = None
            if stream is not None:
                self._streams.add(stream)
                try:
                    async for event in stream:
                        delay = _RETRY_FIRST_S
                        _apply(known, event)
                        revision = event.revision
                        yield event
                    continue
                except UnavailableError as e:
                    log.info("watch of %s broke at revision %d: %s", prefix.decode(), revision, e)
                    if not await self._pause(delay):
                        return
                    continue
                except RevisionCompactedError:
                    pass
                finally:
                    self._streams.discard(stream)
            log.warning(
                "watch of %s: revision %d compacted, listing again", prefix.decode(), revision
            )
            try:
                kvs, revision_now = await self._conn.list_prefix(prefix)
            except UnavailableError:
                if not await self._pause(delay):
                    return
                continue
            for event in _differences(known, {kv.key: kv for kv in kvs}, revision_now):
                _apply(known, event)
                yield event
            revision = revision_now

    async def _pause(self, seconds: float) -> bool:
        """Wait ``seconds`` unless the store closes first; False when it closed."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._closed.wait()
        return not self._closed.is_set()

    async def _restore(self, lease_id: int) -> None:
        """Re-write what lived under the lost lease under ``lease_id``."""
        for broker, info in list(self._registrations.items()):
            await self._put_registration(broker, info, lease_id)
        if self._candidate is not None:
            await self._put_candidacy(lease_id, self._candidate)


def _versioned(kv: KeyValue) -> Versioned:
    return Versioned(kv.value, kv.mod_revision, kv.create_revision)


def _apply(known: dict[bytes, KeyValue], event: WatchEvent) -> None:
    if event.value is None:
        known.pop(event.key, None)
    else:
        known[event.key] = KeyValue(event.key, event.value, event.create_revision, event.revision)


def _differences(
    old: dict[bytes, KeyValue], new: dict[bytes, KeyValue], revision: int
) -> list[WatchEvent]:
    """Events that turn ``old`` into ``new``, dated ``revision``."""
    events = [WatchEvent(key, None, kv.create_revision, revision) for key, kv in old.items()]
    events = [e for e in events if e.key not in new]
    for key, kv in new.items():
        before = old.get(key)
        if before is None or before.mod_revision != kv.mod_revision:
            events.append(WatchEvent(key, kv.value, kv.create_revision, revision))
    return events


def _leader_of(candidates: dict[bytes, KeyValue]) -> Leader | None:
    if not candidates:
        return None
    first = min(candidates.values(), key=lambda kv: kv.create_revision)
    return Leader(BrokerId(first.value.decode()), first.create_revision)
