"""The contract of :class:`lbd.ports.metadata.MetadataStore`, for every adapter.

A concrete test class subclasses :class:`MetadataStoreContract` and provides the ``harness``
fixture: it makes started stores on one shared backend (so two stores are two sidecars), takes a
store's lease away from the outside, and waits for an awaitable while time passes (the real clock
for etcd, a manual clock driven forward for the in-memory twin).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Any, TypeVar

import pytest

from lbd.adapters.session import SessionPolicy
from lbd.core.errors import PreconditionError
from lbd.core.ids import BrokerId
from lbd.ports.errors import CasConflictError, SessionExpiredError
from lbd.ports.metadata import (
    Leader,
    MaintenanceEvent,
    MetadataStore,
    NamespaceEvent,
    RegistryEvent,
    SessionEvent,
    SessionEventKind,
)

T = TypeVar("T")

A = BrokerId("broker-a")
B = BrokerId("broker-b")


class MetadataHarness(abc.ABC):
    """What the suite needs from a backend besides the port itself."""

    @abc.abstractmethod
    async def store(self, policy: SessionPolicy | None = None) -> MetadataStore:
        """A started store on the shared backend; the harness closes it after the test."""

    @abc.abstractmethod
    async def lose_lease(self, store: MetadataStore) -> None:
        """Revoke ``store``'s current lease from outside (an expiry, as far as it can tell)."""

    @abc.abstractmethod
    async def wait(self, awaitable: Awaitable[T], timeout_s: float) -> T:
        """Await ``awaitable`` while up to ``timeout_s`` of the store's clock passes."""

    async def stays_pending(self, awaitable: Awaitable[Any], for_s: float) -> bool:
        """Whether ``awaitable`` is still unfinished after ``for_s`` (it is cancelled then)."""
        try:
            await self.wait(awaitable, for_s)
        except TimeoutError:
            return True
        return False


async def next_event(
    harness: MetadataHarness, events: AsyncIterator[SessionEvent], timeout_s: float = 8.0
) -> SessionEvent:
    """The next session event within ``timeout_s``."""
    return await harness.wait(anext(events), timeout_s)


class MetadataStoreContract:
    """Behaviour every :class:`MetadataStore` adapter must show."""

    @pytest.fixture
    def harness(self) -> MetadataHarness:
        raise NotImplementedError("a concrete contract test provides the harness fixture")

    # -- registry -----------------------------------------------------------------------------

    async def test_registration_is_listed_and_vanishes_when_its_store_closes(
        self, harness: MetadataHarness
    ) -> None:
        a = await harness.store()
        observer = await harness.store()
        await a.register_broker(A, b'{"url": "a"}')
        brokers, revision = await observer.list_brokers()
        assert brokers == {A: b'{"url": "a"}'}
        assert revision > 0
        await a.close()
        assert (await observer.list_brokers())[0] == {}

    async def test_register_overwrites_the_registration(self, harness: MetadataHarness) -> None:
        a = await harness.store()
        await a.register_broker(A, b"v1")
        await a.register_broker(A, b"v2")
        assert (await a.list_brokers())[0] == {A: b"v2"}

    async def test_watch_brokers_reports_changes_after_the_revision_in_order(
        self, harness: MetadataHarness
    ) -> None:
        a = await harness.store()
        b = await harness.store()
        await a.register_broker(A, b"a")
        _, revision = await a.list_brokers()
        async with aclosing(a.watch_brokers(revision)) as events:
            await b.register_broker(B, b"b")
            await b.close()
            first: RegistryEvent = await harness.wait(anext(events), 5)
            second: RegistryEvent = await harness.wait(anext(events), 5)
        assert (first.broker, first.value) == (B, b"b")
        assert (second.broker, second.value) == (B, None)
        assert revision < first.revision < second.revision

    # -- maintenance --------------------------------------------------------------------------

    async def test_maintenance_records_outlive_the_session_that_wrote_them(
        self, harness: MetadataHarness
    ) -> None:
        a = await harness.store()
        observer = await harness.store()
        assert (await observer.list_maintenance())[0] == {}
        first = await a.put_maintenance(A, b'{"mode": "cordoned"}')
        second = await a.put_maintenance(A, b'{"mode": "draining"}')  # overwrites
        third = await a.put_maintenance(B, b'{"mode": "cordoned"}')
        assert 0 < first < second < third
        await a.close()  # its lease goes; the records do not
        records, revision = await observer.list_maintenance()
        assert records == {
            A: (b'{"mode": "draining"}', second),
            B: (b'{"mode": "cordoned"}', third),
        }
        assert revision > second
        assert await observer.delete_maintenance(A) > revision
        assert await observer.delete_maintenance(A) == 0  # idempotent: nothing to delete
        assert (await observer.list_maintenance())[0] == {B: (b'{"mode": "cordoned"}', third)}
        assert (await observer.list_brokers())[0] == {}  # kept apart from the registry

    async def test_a_maintenance_write_over_a_revision_loses_to_any_change_since(
        self, harness: MetadataHarness
    ) -> None:
        a = await harness.store()
        b = await harness.store()
        draining = await a.put_maintenance(A, b"draining")
        cordoned = await a.put_maintenance(A, b"cordoned", draining)  # still at draining's
        assert cordoned > draining
        with pytest.raises(CasConflictError):
            await a.put_maintenance(A, b"again", draining)  # rewritten since
        await b.delete_maintenance(A)  # an operator's uncordon, on another sidecar
        with pytest.raises(CasConflictError):
            await a.put_maintenance(A, b"cordoned", cordoned)  # cleared since
        assert (await b.list_maintenance())[0] == {}
        created = await a.put_maintenance(B, b"cordoned", 0)  # 0: only while absent
        with pytest.raises(CasConflictError):
            await b.put_maintenance(B, b"cordoned", 0)
        assert (await b.list_maintenance())[0] == {B: (b"cordoned", created)}

    async def test_watch_maintenance_reports_changes_after_the_revision_in_order(
        self, harness: MetadataHarness
    ) -> None:
        a = await harness.store()
        b = await harness.store()
        await a.put_maintenance(A, b"before")
        _, revision = await a.list_maintenance()
        async with aclosing(a.watch_maintenance(revision)) as events:
            await b.register_broker(B, b"b")  # another prefix: not reported
            written = await b.put_maintenance(B, b"cordoned")
            deleted = await b.delete_maintenance(A)
            first: MaintenanceEvent = await harness.wait(anext(events), 5)
            second: MaintenanceEvent = await harness.wait(anext(events), 5)
        assert (first.broker, first.value, first.revision) == (B, b"cordoned", written)
        assert (second.broker, second.value, second.revision) == (A, None, deleted)
        assert revision < first.revision < second.revision

    # -- namespaces ---------------------------------------------------------------------------

    async def test_namespace_compare_and_swap(self, harness: MetadataHarness) -> None:
        s = await harness.store()
        assert await s.get_namespace("t/ns") is None
        created = await s.put_namespace("t/ns", b"v1", 0)
        with pytest.raises(CasConflictError) as conflict:
            await s.put_namespace("t/ns", b"again", 0)
        assert conflict.value.actual == created
        updated = await s.put_namespace("t/ns", b"v2", created)
        assert updated > created
        with pytest.raises(CasConflictError) as stale:
            await s.put_namespace("t/ns", b"stale", created)
        assert (stale.value.expected, stale.value.actual) == (created, updated)
        record = await s.get_namespace("t/ns")
        assert record is not None
        assert (record.value, record.mod_revision, record.create_revision) == (
            b"v2",
            updated,
            created,
        )
        with pytest.raises(CasConflictError) as missing:
            await s.put_namespace("t/other", b"x", updated)
        assert missing.value.actual is None
        await s.put_namespace("t/other", b"o", 0)
        listed, revision = await s.list_namespaces()
        assert {k: v.value for k, v in listed.items()} == {"t/ns": b"v2", "t/other": b"o"}
        assert revision >= max(v.mod_revision for v in listed.values())

    async def test_watch_namespaces_reports_changes_after_the_revision_in_order(
        self, harness: MetadataHarness
    ) -> None:
        a = await harness.store()
        b = await harness.store()
        first_write = await a.put_namespace("t/ns", b"v1", 0)
        _, revision = await a.list_namespaces()
        async with aclosing(a.watch_namespaces(revision)) as events:
            await b.put_maintenance(B, b"cordoned")  # another prefix: not reported
            created = await b.put_namespace("t/new", b"n1", 0)
            updated = await b.put_namespace("t/ns", b"v2", first_write)
            one: NamespaceEvent = await harness.wait(anext(events), 5)
            two: NamespaceEvent = await harness.wait(anext(events), 5)
        assert (one.namespace, one.value, one.revision) == ("t/new", b"n1", created)
        assert (two.namespace, two.value, two.revision) == ("t/ns", b"v2", updated)
        assert revision < one.revision < two.revision

    # -- election -----------------------------------------------------------------------------

    async def test_first_candidate_leads_with_its_create_revision_as_term(
        self, harness: MetadataHarness
    ) -> None:
        a = await harness.store()
        assert await a.get_leader() is None
        leader = await harness.wait(a.campaign(A), 5)
        assert leader.broker == A
        assert leader.term > 0
        assert await a.get_leader() == leader

    async def test_second_candidate_waits_until_the_leader_resigns(
        self, harness: MetadataHarness
    ) -> None:
        a = await harness.store()
        b = await harness.store()
        first = await harness.wait(a.campaign(A), 5)
        waiting = await _waiting_campaign(harness, b, B)
        await a.resign()
        second = await harness.wait(waiting, 5)
        assert second.broker == B
        assert second.term > first.term
        assert await a.get_leader() == second

    async def test_second_candidate_wins_when_the_leader_loses_its_lease(
        self, harness: MetadataHarness
    ) -> None:
        a = await harness.store()
        b = await harness.store()
        first = await harness.wait(a.campaign(A), 5)
        async with aclosing(a.session_events()) as events:
            waiting = await _waiting_campaign(harness, b, B)
            await harness.lose_lease(a)
            second = await harness.wait(waiting, 10)
            assert second.broker == B
            assert second.term > first.term
            assert (await next_event(harness, events)).kind is SessionEventKind.LEASE_LOST
            assert (await next_event(harness, events)).kind is SessionEventKind.RECONNECTED
        # A's candidacy came back under its new lease, behind B's.
        again = await _waiting_campaign(harness, a, A)
        await b.resign()
        third = await harness.wait(again, 5)
        assert third.broker == A
        assert third.term > second.term

    async def test_resign_ends_a_waiting_campaign(self, harness: MetadataHarness) -> None:
        a = await harness.store()
        b = await harness.store()
        await harness.wait(a.campaign(A), 5)
        waiting = await _waiting_campaign(harness, b, B)
        await b.resign()
        with pytest.raises(PreconditionError):
            await harness.wait(waiting, 5)
        assert await b.get_leader() == await a.get_leader()

    async def test_watch_leader_reports_each_change(self, harness: MetadataHarness) -> None:
        a = await harness.store()
        b = await harness.store()
        async with aclosing(a.watch_leader()) as leaders:
            assert await harness.wait(anext(leaders), 5) is None
            term_a = (await harness.wait(a.campaign(A), 5)).term
            assert await harness.wait(anext(leaders), 5) == Leader(A, term_a)
            waiting = await _waiting_campaign(harness, b, B)
            await a.resign()
            term_b = (await harness.wait(waiting, 5)).term
            assert await harness.wait(anext(leaders), 5) == Leader(B, term_b)

    # -- session ------------------------------------------------------------------------------

    async def test_keepalive_holds_the_lease_beyond_its_ttl(self, harness: MetadataHarness) -> None:
        s = await harness.store(SessionPolicy(lease_ttl_s=1, keepalive_interval_s=0.2))
        await s.register_broker(A, b"a")
        renewed, granted = s.last_renewed_monotonic, s.lease_granted_monotonic
        assert granted <= renewed
        assert await harness.stays_pending(_never(), 2.5)
        assert (await s.list_brokers())[0] == {A: b"a"}
        assert s.last_renewed_monotonic > renewed
        assert s.lease_granted_monotonic == granted  # renewals do not make a new lease

    async def test_lost_lease_is_replaced_and_the_registration_rewritten(
        self, harness: MetadataHarness
    ) -> None:
        s = await harness.store()
        observer = await harness.store()
        await s.register_broker(A, b"a")
        granted = s.lease_granted_monotonic
        async with aclosing(s.session_events()) as events:
            await harness.lose_lease(s)
            lost = await next_event(harness, events)
            back = await next_event(harness, events)
        assert lost.kind is SessionEventKind.LEASE_LOST
        assert back.kind is SessionEventKind.RECONNECTED
        assert back.lease_id != lost.lease_id
        # The new lease's grant time is known by the time its event is.
        assert granted < s.lease_granted_monotonic <= back.at_monotonic
        assert (await observer.list_brokers())[0] == {A: b"a"}

    async def test_a_deregistered_broker_stays_away_after_a_new_lease(
        self, harness: MetadataHarness
    ) -> None:
        s = await harness.store()
        observer = await harness.store()
        await s.register_broker(A, b"a")
        await s.register_broker(B, b"b")
        await s.deregister_broker(A)
        await s.deregister_broker(A)  # idempotent
        assert (await observer.list_brokers())[0] == {B: b"b"}
        async with aclosing(s.session_events()) as events:
            await harness.lose_lease(s)
            assert (await next_event(harness, events)).kind is SessionEventKind.LEASE_LOST
            assert (await next_event(harness, events)).kind is SessionEventKind.RECONNECTED
        assert (await observer.list_brokers())[0] == {B: b"b"}

    async def test_shutdown_policy_ends_the_session_loudly(self, harness: MetadataHarness) -> None:
        s = await harness.store(
            SessionPolicy(
                lease_ttl_s=2,
                keepalive_interval_s=0.2,
                session_expired_policy="shutdown",
                reconnect_retries=0,
            )
        )
        async with aclosing(s.session_events()) as events:
            await harness.lose_lease(s)
            assert (await next_event(harness, events)).kind is SessionEventKind.LEASE_LOST
            with pytest.raises(SessionExpiredError):
                await next_event(harness, events)

    async def test_session_events_end_when_the_store_closes(self, harness: MetadataHarness) -> None:
        s = await harness.store()
        events = s.session_events()
        await s.close()
        with pytest.raises(StopAsyncIteration):
            await harness.wait(anext(events), 2)


async def _waiting_campaign(
    harness: MetadataHarness, store: MetadataStore, candidate: BrokerId
) -> asyncio.Future[Leader]:
    """Start ``store.campaign(candidate)`` and check that it waits (someone else leads)."""
    campaign = asyncio.ensure_future(store.campaign(candidate))
    assert await harness.stays_pending(asyncio.shield(campaign), 0.5), "it should wait"
    return campaign


async def _never() -> None:
    await asyncio.Event().wait()
