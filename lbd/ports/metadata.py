"""The metadata-store port: broker registry, leader election, maintenance and namespace records,
session events.

The real implementation is etcd (:mod:`lbd.adapters.etcd_store`); keys live under a per-cluster
prefix (DESIGN §3). Every method raises :class:`~lbd.ports.errors.UnavailableError` when the store
cannot be reached within the configured request timeout; no other exception means "unavailable".
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from lbd.core.ids import BrokerId


@dataclass(frozen=True, slots=True)
class Versioned:
    """A stored value with the revisions needed for compare-and-swap."""

    value: bytes
    mod_revision: int
    create_revision: int


@dataclass(frozen=True, slots=True)
class Leader:
    """The elected leader and its term (the winner's create revision: grows with every election)."""

    broker: BrokerId
    term: int


class SessionEventKind(enum.Enum):
    """What happened to this process's session with the store."""

    UNREACHABLE = "unreachable"
    """A keepalive or request failed: the store is unreachable (safe mode, DESIGN §8)."""
    REACHABLE = "reachable"
    """The store answers again and the lease is still alive."""
    LEASE_LOST = "lease_lost"
    """The lease expired or was revoked: registration and candidacy under it are gone."""
    RECONNECTED = "reconnected"
    """A new lease was granted after LEASE_LOST and the registration was written again."""


@dataclass(frozen=True, slots=True)
class SessionEvent:
    """One session event, with the lease it concerns and the store-side revision when known."""

    kind: SessionEventKind
    lease_id: int
    at_monotonic: float


@dataclass(frozen=True, slots=True)
class RegistryEvent:
    """A broker registration appeared, changed (``value`` set) or vanished (``value`` None)."""

    broker: BrokerId
    value: bytes | None
    revision: int


@dataclass(frozen=True, slots=True)
class MaintenanceEvent:
    """A broker's maintenance record was written (``value`` set) or cleared (``value`` None)."""

    broker: BrokerId
    value: bytes | None
    revision: int


@dataclass(frozen=True, slots=True)
class NamespaceEvent:
    """A namespace record was written (``value`` set, its mod revision is ``revision``) or
    deleted (``value`` None)."""

    namespace: str
    value: bytes | None
    revision: int


class MetadataStore(Protocol):
    """Broker registry, election, maintenance and namespace records of one cluster.

    Lifecycle: ``start()`` grants the session lease and starts keeping it alive; ``close()`` revokes
    it (so registrations vanish at once) and is idempotent.
    """

    @property
    def last_renewed_monotonic(self) -> float:
        """Clock-monotonic time at which the last successful lease renewal (or grant) was SENT.

        Self-fencing (DESIGN §8) compares ``now - last_renewed_monotonic`` with
        ``etcd.fence_after_s``: the lease can live at most its TTL after that send.
        """
        ...

    @property
    def lease_granted_monotonic(self) -> float:
        """Clock-monotonic time at which the grant of the current lease was SENT.

        A lease granted after another was lost is a new registration: the leader may have moved
        the old one's bundles meanwhile, so self-fencing counts the lease only once the channel
        was read through after this time.
        """
        ...

    async def start(self) -> None:
        """Connect, grant the session lease and start refreshing it."""
        ...

    async def close(self) -> None:
        """Stop refreshing, revoke the lease (best effort), end every iterator. Idempotent."""
        ...

    # -- registry ---------------------------------------------------------------------------

    async def register_broker(self, broker: BrokerId, info: bytes) -> None:
        """Write ``brokers/<broker>`` under the session lease (overwrites; idempotent).

        The registration is re-written by the adapter under the new lease after a
        ``RECONNECTED`` event, so callers register once.
        """
        ...

    async def deregister_broker(self, broker: BrokerId) -> None:
        """Delete ``brokers/<broker>`` and stop re-writing it after a new lease (idempotent)."""
        ...

    async def list_brokers(self) -> tuple[dict[BrokerId, bytes], int]:
        """Every live registration and the store revision the listing was read at."""
        ...

    def watch_brokers(self, after_revision: int) -> AsyncIterator[RegistryEvent]:
        """Registry changes strictly after ``after_revision``, in order, without gaps.

        The iterator survives store restarts and reconnects by resuming from the last revision it
        delivered; it ends only when the store is closed. If the store compacted the revisions it
        needs, it lists the registry again and emits the differences from what it had delivered
        (one event per changed broker, at the listing's revision).
        """
        ...

    # -- election ---------------------------------------------------------------------------

    async def campaign(self, candidate: BrokerId) -> Leader:
        """Put this candidate under the session lease and wait until it is the leader.

        The leader is the candidate whose key has the lowest create revision under the election
        prefix; the term is that create revision. Returns when this candidate leads. After a
        lease loss the adapter re-writes the candidacy under the new lease (at the back of the
        queue) and a waiting ``campaign`` keeps waiting on it. Raises
        :class:`~lbd.ports.errors.UnavailableError` when the store fails while waiting (call again),
        and :class:`~lbd.core.errors.PreconditionError` if :meth:`resign` ran meanwhile.
        """
        ...

    async def resign(self) -> None:
        """Withdraw the candidacy (delete the candidate key). Idempotent."""
        ...

    async def get_leader(self) -> Leader | None:
        """The current leader, or None while nobody campaigns."""
        ...

    def watch_leader(self) -> AsyncIterator[Leader | None]:
        """The current leader now, then each change of leader (broker or term).

        Survives outages like :meth:`watch_brokers`; ends when the store is closed.
        """
        ...

    # -- namespaces -------------------------------------------------------------------------

    async def get_namespace(self, namespace: str) -> Versioned | None:
        """The record of ``tenant/namespace``, or None when it does not exist."""
        ...

    async def list_namespaces(self) -> tuple[dict[str, Versioned], int]:
        """Every namespace record by ``tenant/namespace``, and the store revision it was read at."""
        ...

    def watch_namespaces(self, after_revision: int) -> AsyncIterator[NamespaceEvent]:
        """Namespace record changes strictly after ``after_revision``, in order, without gaps;
        survives outages and compaction as :meth:`watch_brokers` does; ends when the store is
        closed."""
        ...

    async def put_namespace(self, namespace: str, value: bytes, expected_mod_revision: int) -> int:
        """Compare-and-swap: write only if the record's mod revision is still the expected one.

        ``expected_mod_revision == 0`` means "create: the record must not exist". Returns the new
        mod revision; raises :class:`~lbd.ports.errors.CasConflictError` when the record changed.
        """
        ...

    # -- maintenance --------------------------------------------------------------------------

    async def list_maintenance(self) -> tuple[dict[BrokerId, tuple[bytes, int]], int]:
        """Every broker's maintenance record with its mod revision, and the store revision the
        listing was read at."""
        ...

    async def put_maintenance(
        self, broker: BrokerId, value: bytes, expected_mod_revision: int | None = None
    ) -> int:
        """Write ``maintenance/<broker>``; the store revision of the write (its watch event
        carries the same). Without ``expected_mod_revision`` it overwrites; with it, it writes
        only while the record's mod revision is still that one (0: absent), else raises
        :class:`~lbd.ports.errors.CasConflictError`. Not under the session lease: the record
        outlives this session, the broker's registration and the sidecar that wrote it."""
        ...

    async def delete_maintenance(self, broker: BrokerId) -> int:
        """Delete ``maintenance/<broker>`` (idempotent); the store revision of the delete (its
        watch event carries the same), 0 when there was nothing to delete."""
        ...

    def watch_maintenance(self, after_revision: int) -> AsyncIterator[MaintenanceEvent]:
        """Maintenance changes strictly after ``after_revision``, in order, without gaps; survives
        outages and compaction as :meth:`watch_brokers` does; ends when the store is closed."""
        ...

    # -- session ----------------------------------------------------------------------------

    def session_events(self) -> AsyncIterator[SessionEvent]:
        """Every session event from the moment of this call on (each subscriber gets every event).

        Events of one outage come in this order: ``UNREACHABLE`` (once), then ``REACHABLE`` if the
        lease survived, or ``LEASE_LOST`` then ``RECONNECTED`` (which also ends the outage). The
        iterator ends when the store is closed; it raises
        :class:`~lbd.ports.errors.SessionExpiredError` after the last event when the session ended
        for good (policy ``shutdown``), so a task consuming it dies loudly.
        """
        ...
