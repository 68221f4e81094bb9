"""An in-memory metadata store that behaves like the etcd one, for unit tests and the simulator.

A :class:`MemoryMetadataCluster` plays the etcd server: one revision counter, keys with create and
mod revisions, leases that expire on the injected clock, and a history that watches read. Each
sidecar gets its own :class:`MemoryMetadataStore` on the shared cluster (so a second store is
"another candidate"). Tests inject the outside world's failures through the cluster:
:meth:`MemoryMetadataCluster.set_reachable` (etcd unreachable: every request raises
UnavailableError, watches pause and resume without losing events) and
:meth:`MemoryMetadataCluster.revoke_lease` (a lost lease). Sessions use the same
:class:`~lbd.adapters.session.LeaseSession` as the etcd adapter, so their events match.

Leases expire lazily: whenever any store touches the cluster (every keepalive does), leases whose
deadline has passed on the clock are removed with their keys.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from lbd.adapters.session import LeaseSession, SessionPolicy
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

T = TypeVar("T")

_BROKERS = "brokers/"
_LEADER = "leader/"
_NAMESPACES = "namespaces/"
_MAINTENANCE = "maintenance/"


@dataclass(frozen=True, slots=True)
class _Record:
    value: bytes
    create_revision: int
    mod_revision: int
    lease_id: int


@dataclass(frozen=True, slots=True)
class _Change:
    key: str
    value: bytes | None
    revision: int


class MemoryMetadataCluster:
    """The shared "etcd server" of in-memory stores."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.revision = 0
        self._records: dict[str, _Record] = {}
        self._leases: dict[int, tuple[int, float]] = {}  # id -> (ttl, deadline)
        self._lease_ids = itertools.count(0x1000)
        self.history: list[_Change] = []
        """Every change ever made (watches read it); kept whole: the twin is for bounded runs."""
        self._reachable = True
        self._waiters: list[asyncio.Future[None]] = []

    # -- test controls ----------------------------------------------------------------------

    @property
    def reachable(self) -> bool:
        """Whether requests are answered."""
        return self._reachable

    def set_reachable(self, reachable: bool) -> None:
        """Cut off (False) or restore (True) every store's access."""
        self._reachable = reachable
        self.wake()

    def revoke_lease(self, lease_id: int) -> None:
        """Drop a lease and its keys at once, as an expiry or an operator's revoke would."""
        self._drop_lease(lease_id)

    def expire_leases(self) -> None:
        """Remove every lease whose deadline has passed on the clock (with its keys)."""
        now = self.clock.monotonic()
        for lease_id, (_, deadline) in list(self._leases.items()):
            if deadline <= now:
                self._drop_lease(lease_id)

    def lease_alive(self, lease_id: int) -> bool:
        """Whether the lease exists (after expiring overdue ones)."""
        self.expire_leases()
        return lease_id in self._leases

    # -- the "server" -------------------------------------------------------------------------

    def check(self) -> None:
        """Raise UnavailableError when cut off; expire overdue leases otherwise."""
        if not self._reachable:
            raise UnavailableError("in-memory metadata store: unreachable (simulated)")
        self.expire_leases()

    def grant(self, ttl_s: int) -> int:
        """Grant a lease of ``ttl_s`` seconds on the clock."""
        self.check()
        lease_id = next(self._lease_ids)
        self._leases[lease_id] = (ttl_s, self.clock.monotonic() + ttl_s)
        return lease_id

    def refresh(self, lease_id: int) -> bool:
        """Renew a lease; False when it is gone."""
        self.check()
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        self._leases[lease_id] = (lease[0], self.clock.monotonic() + lease[0])
        return True

    def get(self, key: str) -> _Record | None:
        """One key, or None."""
        self.check()
        return self._records.get(key)

    def list(self, prefix: str) -> tuple[dict[str, _Record], int]:
        """Every key under ``prefix`` (sorted) and the current revision."""
        self.check()
        found = {k: r for k, r in sorted(self._records.items()) if k.startswith(prefix)}
        return found, self.revision

    def put(self, key: str, value: bytes, lease_id: int = 0, expected: int | None = None) -> int:
        """Write ``key``; with ``expected``, only if its mod revision (0: absent) matches."""
        self.check()
        if lease_id and lease_id not in self._leases:
            raise UnavailableError(f"in-memory metadata store: lease {lease_id:x} not found")
        old = self._records.get(key)
        if expected is not None and (0 if old is None else old.mod_revision) != expected:
            raise CasConflictError(key, expected, None if old is None else old.mod_revision)
        self.revision += 1
        created = self.revision if old is None else old.create_revision
        self._records[key] = _Record(value, created, self.revision, lease_id)
        self._record(key, value)
        return self.revision

    def delete(self, key: str) -> None:
        """Delete one key (no-op when absent)."""
        self.check()
        if key in self._records:
            self.revision += 1
            del self._records[key]
            self._record(key, None)

    def wake(self) -> None:
        """Wake every waiter (they re-check what they wait for)."""
        waiters, self._waiters = self._waiters, []
        for future in waiters:
            if not future.done():
                future.set_result(None)

    async def changed(self) -> None:
        """Wait for the next write, lease drop, reachability change or :meth:`wake`."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        await future

    def _record(self, key: str, value: bytes | None) -> None:
        self.history.append(_Change(key, value, self.revision))
        self.wake()

    def _drop_lease(self, lease_id: int) -> None:
        if self._leases.pop(lease_id, None) is None:
            return
        for key in [k for k, r in self._records.items() if r.lease_id == lease_id]:
            self.revision += 1
            del self._records[key]
            self._record(key, None)
        self.wake()


class _MemoryLeases:
    def __init__(self, cluster: MemoryMetadataCluster, cut_off: Callable[[], bool]) -> None:
        self._cluster = cluster
        self._cut_off = cut_off

    def _check(self) -> None:
        if self._cut_off():
            raise UnavailableError("in-memory metadata store: this client is cut off (simulated)")

    async def grant(self, ttl_s: int) -> int:
        self._check()
        return self._cluster.grant(ttl_s)

    async def refresh(self, lease_id: int) -> bool:
        self._check()
        return self._cluster.refresh(lease_id)

    async def revoke(self, lease_id: int) -> None:
        self._check()
        self._cluster.check()
        self._cluster.revoke_lease(lease_id)


class MemoryMetadataStore:
    """:class:`~lbd.ports.metadata.MetadataStore` on a :class:`MemoryMetadataCluster`."""

    def __init__(
        self, cluster: MemoryMetadataCluster, policy: SessionPolicy, clock: Clock | None = None
    ) -> None:
        """``clock``: this client's own (its process's), for its keepalives and the times it
        reports; the cluster's by default."""
        self._cluster = cluster
        self._cut_off = False
        self._session = LeaseSession(
            _MemoryLeases(cluster, lambda: self._cut_off),
            policy,
            clock or cluster.clock,
            self._restore,
            name="memory-session",
        )
        self._registrations: dict[BrokerId, bytes] = {}
        self._candidate: BrokerId | None = None
        self._closed = False

    def set_cut_off(self, cut_off: bool) -> None:
        """Cut this client alone off the store (True), or restore it; the others still reach
        it, so this client's lease may expire and another leader may be elected meanwhile."""
        self._cut_off = cut_off
        self._cluster.wake()

    @property
    def lease_id(self) -> int:
        """The current session lease."""
        return self._session.lease_id

    @property
    def last_renewed_monotonic(self) -> float:
        """When the last successful renewal was sent."""
        return self._session.last_renewed_monotonic

    @property
    def lease_granted_monotonic(self) -> float:
        """When the grant of the current lease was sent."""
        return self._session.lease_granted_monotonic

    async def start(self) -> None:
        """Grant the lease and start the keepalive task."""
        await self._session.start()

    async def close(self) -> None:
        """Stop the session (revoking the lease) and end every iterator. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._session.close()
        self._cluster.wake()

    def session_events(self) -> AsyncIterator[SessionEvent]:
        """Session events from now on."""
        return self._session.events()

    async def register_broker(self, broker: BrokerId, info: bytes) -> None:
        """Write ``brokers/<broker>`` under the lease."""
        self._registrations[broker] = info
        self._call(lambda: self._cluster.put(_BROKERS + broker, info, self._session.lease_id))

    async def deregister_broker(self, broker: BrokerId) -> None:
        """Delete ``brokers/<broker>``; it is no longer restored under a new lease."""
        self._registrations.pop(broker, None)
        self._call(lambda: self._cluster.delete(_BROKERS + broker))

    async def list_brokers(self) -> tuple[dict[BrokerId, bytes], int]:
        """Live registrations and the revision."""
        found, revision = self._call(lambda: self._cluster.list(_BROKERS))
        return {BrokerId(k[len(_BROKERS) :]): r.value for k, r in found.items()}, revision

    async def watch_brokers(self, after_revision: int) -> AsyncIterator[RegistryEvent]:
        """Registry changes after ``after_revision``."""
        async for change in self._follow(_BROKERS, after_revision):
            broker = BrokerId(change.key[len(_BROKERS) :])
            yield RegistryEvent(broker, change.value, change.revision)

    async def campaign(self, candidate: BrokerId) -> Leader:
        """Stand and wait until this candidate leads."""
        self._candidate = candidate
        self._put_candidacy(self._session.lease_id, candidate)
        while True:
            if self._closed:
                raise UnavailableError("campaign: the metadata store is closed")
            if self._candidate != candidate:
                raise PreconditionError(f"campaign of {candidate}: the candidacy was withdrawn")
            found, _ = self._call(lambda: self._cluster.list(_LEADER))
            first = min(found.items(), key=lambda kv: kv[1].create_revision, default=None)
            if first is not None and first[0] == _candidate_key(self._session.lease_id):
                return Leader(candidate, first[1].create_revision)
            await self._cluster.changed()

    async def resign(self) -> None:
        """Withdraw the candidacy."""
        self._candidate = None
        self._call(lambda: self._cluster.delete(_candidate_key(self._session.lease_id)))

    async def get_leader(self) -> Leader | None:
        """The current leader or None."""
        found, _ = self._call(lambda: self._cluster.list(_LEADER))
        return _leader_of(found)

    async def watch_leader(self) -> AsyncIterator[Leader | None]:
        """The leader now, then each change."""
        while True:
            try:
                found, revision = self._call(lambda: self._cluster.list(_LEADER))
                break
            except UnavailableError:
                await self._cluster.changed()
                if self._closed:
                    return
        current = _leader_of(found)
        yield current
        async for _ in self._follow(_LEADER, revision):
            found, _ = self._cluster.list(_LEADER)
            leader = _leader_of(found)
            if leader != current:
                current = leader
                yield current

    async def get_namespace(self, namespace: str) -> Versioned | None:
        """One namespace record."""
        record = self._call(lambda: self._cluster.get(_NAMESPACES + namespace))
        return None if record is None else _versioned(record)

    async def list_namespaces(self) -> tuple[dict[str, Versioned], int]:
        """Every namespace record and the revision."""
        found, revision = self._call(lambda: self._cluster.list(_NAMESPACES))
        return {k[len(_NAMESPACES) :]: _versioned(r) for k, r in found.items()}, revision

    async def watch_namespaces(self, after_revision: int) -> AsyncIterator[NamespaceEvent]:
        """Namespace record changes after ``after_revision``."""
        async for change in self._follow(_NAMESPACES, after_revision):
            yield NamespaceEvent(change.key[len(_NAMESPACES) :], change.value, change.revision)

    async def put_namespace(self, namespace: str, value: bytes, expected_mod_revision: int) -> int:
        """Compare-and-swap on the mod revision (0: create)."""
        try:
            return self._call(
                lambda: self._cluster.put(_NAMESPACES + namespace, value, 0, expected_mod_revision)
            )
        except CasConflictError as e:
            raise CasConflictError(namespace, e.expected, e.actual) from None

    async def list_maintenance(self) -> tuple[dict[BrokerId, tuple[bytes, int]], int]:
        """Every maintenance record with its mod revision, and the revision."""
        found, revision = self._call(lambda: self._cluster.list(_MAINTENANCE))
        return {
            BrokerId(k[len(_MAINTENANCE) :]): (r.value, r.mod_revision) for k, r in found.items()
        }, revision

    async def put_maintenance(
        self, broker: BrokerId, value: bytes, expected_mod_revision: int | None = None
    ) -> int:
        """Write ``maintenance/<broker>`` under no lease (with ``expected_mod_revision``, only
        while the record is at it); the revision of the write."""
        key = _MAINTENANCE + broker
        return self._call(lambda: self._cluster.put(key, value, 0, expected_mod_revision))

    async def delete_maintenance(self, broker: BrokerId) -> int:
        """Delete ``maintenance/<broker>`` (idempotent); the revision of the delete (0: none)."""
        key = _MAINTENANCE + broker
        if self._call(lambda: self._cluster.get(key)) is None:
            return 0
        self._cluster.delete(key)
        return self._cluster.revision

    async def watch_maintenance(self, after_revision: int) -> AsyncIterator[MaintenanceEvent]:
        """Maintenance changes after ``after_revision``."""
        async for change in self._follow(_MAINTENANCE, after_revision):
            broker = BrokerId(change.key[len(_MAINTENANCE) :])
            yield MaintenanceEvent(broker, change.value, change.revision)

    def _call(self, op: Callable[[], T]) -> T:
        try:
            if self._cut_off:
                raise UnavailableError("in-memory metadata store: this client is cut off")
            return op()
        except UnavailableError:
            self._session.note_unreachable()
            raise

    def _put_candidacy(self, lease_id: int, candidate: BrokerId) -> None:
        key = _candidate_key(lease_id)
        self._call(lambda: self._cluster.put(key, candidate.encode(), lease_id))

    async def _follow(self, prefix: str, after_revision: int) -> AsyncIterator[_Change]:
        """Changes under ``prefix`` after ``after_revision``; pauses while unreachable."""
        position = 0
        history = self._cluster.history
        while position < len(history) and history[position].revision <= after_revision:
            position += 1
        while not self._closed:
            if self._cluster.reachable and not self._cut_off and position < len(history):
                change = history[position]
                position += 1
                if change.key.startswith(prefix):
                    yield change
                continue
            await self._cluster.changed()

    async def _restore(self, lease_id: int) -> None:
        for broker, info in list(self._registrations.items()):
            self._cluster.put(_BROKERS + broker, info, lease_id)
        if self._candidate is not None:
            self._put_candidacy(lease_id, self._candidate)


def _candidate_key(lease_id: int) -> str:
    return f"{_LEADER}{lease_id:x}"


def _versioned(record: _Record) -> Versioned:
    return Versioned(record.value, record.mod_revision, record.create_revision)


def _leader_of(found: dict[str, _Record]) -> Leader | None:
    first = min(found.values(), key=lambda r: r.create_revision, default=None)
    return None if first is None else Leader(BrokerId(first.value.decode()), first.create_revision)
