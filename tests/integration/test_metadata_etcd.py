"""The metadata contract against a real etcd, plus what only a real server can show.

The contract runs on the shared server under a test-private prefix. The outage tests take a
private server to freeze, kill and restart, as an operator would meet those failures.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Any, TypeVar

import pytest

from lbd.adapters.clock import ManualClock
from lbd.adapters.etcd import EtcdConnection, EtcdOptions
from lbd.adapters.etcd_store import EtcdMetadataStore
from lbd.adapters.session import SessionPolicy
from lbd.core.ids import BrokerId
from lbd.devcluster import EtcdServer
from lbd.devcluster.ports import free_port
from lbd.ports.clock import Clock
from lbd.ports.errors import CasConflictError, UnavailableError
from lbd.ports.metadata import MetadataStore, RegistryEvent, SessionEventKind
from tests.conftest import EtcdClientFactory
from tests.contract.metadata_suite import MetadataHarness, MetadataStoreContract, next_event

pytestmark = pytest.mark.servers

T = TypeVar("T")

POLICY = SessionPolicy(lease_ttl_s=2, keepalive_interval_s=0.3)
REQUEST_TIMEOUT_S = 1.0


class EtcdHarness(MetadataHarness):
    """Stores of one etcd under one prefix, each with a connection of its own (one per sidecar)."""

    def __init__(self, server: EtcdServer, prefix: bytes, clients: EtcdClientFactory) -> None:
        self.server = server
        self.prefix = prefix.decode()
        self.admin = clients(server)
        self.stores: list[tuple[EtcdMetadataStore, EtcdConnection]] = []

    async def store(
        self, policy: SessionPolicy | None = None, clock: Clock | None = None
    ) -> EtcdMetadataStore:
        options = EtcdOptions(
            endpoints=(self.server.client_url,),
            prefix=self.prefix,
            session=policy or POLICY,
            request_timeout_s=REQUEST_TIMEOUT_S,
        )
        conn = EtcdConnection.from_options(options)
        store = EtcdMetadataStore(conn, options, clock)
        self.stores.append((store, conn))
        await store.start()
        return store

    async def lose_lease(self, store: MetadataStore) -> None:
        assert isinstance(store, EtcdMetadataStore)
        await self.admin.revoke_lease(store.lease_id)

    async def wait(self, awaitable: Awaitable[T], timeout_s: float) -> T:
        return await asyncio.wait_for(awaitable, timeout_s)

    async def close(self) -> None:
        for store, conn in self.stores:
            await store.close()
            await conn.close()


@pytest.fixture
async def shared_harness(
    etcd_server: EtcdServer, etcd_prefix: bytes, etcd_clients: EtcdClientFactory
) -> AsyncIterator[EtcdHarness]:
    harness = EtcdHarness(etcd_server, etcd_prefix, etcd_clients)
    yield harness
    await harness.close()
    await harness.admin.delete_prefix(etcd_prefix)


@pytest.fixture
async def private_harness(
    private_etcd_server: EtcdServer, etcd_prefix: bytes, etcd_clients: EtcdClientFactory
) -> AsyncIterator[EtcdHarness]:
    harness = EtcdHarness(private_etcd_server, etcd_prefix, etcd_clients)
    yield harness
    if private_etcd_server.is_frozen:
        private_etcd_server.thaw()
    await harness.close()


class TestEtcdMetadataStore(MetadataStoreContract):
    @pytest.fixture
    def harness(self, shared_harness: EtcdHarness) -> MetadataHarness:
        return shared_harness


# -- etcd only: what the real server does -----------------------------------------------------

FAST = SessionPolicy(lease_ttl_s=1, keepalive_interval_s=0.2)


async def test_lease_expiry_removes_the_registration_then_it_comes_back(
    shared_harness: EtcdHarness,
) -> None:
    """Expiry, not revocation: the keepalive stalls (its clock stops, as in a long pause)."""
    stalled = ManualClock()
    store = await shared_harness.store(FAST, clock=stalled)
    observer = await shared_harness.store()
    await store.register_broker(BrokerId("a"), b"a")
    _, revision = await observer.list_brokers()
    async with (
        aclosing(observer.watch_brokers(revision)) as changes,
        aclosing(store.session_events()) as events,
    ):
        gone: RegistryEvent = await asyncio.wait_for(anext(changes), 5)
        assert (gone.broker, gone.value) == (BrokerId("a"), None)
        stalled.advance(FAST.keepalive_interval_s)  # the keepalive runs again, too late
        assert (await next_event(shared_harness, events)).kind is SessionEventKind.LEASE_LOST
        assert (await next_event(shared_harness, events)).kind is SessionEventKind.RECONNECTED
        back: RegistryEvent = await asyncio.wait_for(anext(changes), 5)
        assert (back.broker, back.value) == (BrokerId("a"), b"a")


async def test_second_candidate_wins_when_the_leaders_lease_expires(
    shared_harness: EtcdHarness,
) -> None:
    a = await shared_harness.store(FAST, clock=ManualClock())  # its keepalive never runs
    b = await shared_harness.store()
    first = await asyncio.wait_for(a.campaign(BrokerId("a")), 5)
    second = await asyncio.wait_for(b.campaign(BrokerId("b")), 5)
    assert second.broker == BrokerId("b")
    assert second.term > first.term
    assert await b.get_leader() == second


async def test_compare_and_swap_conflict_between_two_sidecars(shared_harness: EtcdHarness) -> None:
    a = await shared_harness.store()
    b = await shared_harness.store()
    created = await a.put_namespace("t/ns", b"v1", 0)
    await b.put_namespace("t/ns", b"from b", created)
    with pytest.raises(CasConflictError) as lost:
        await a.put_namespace("t/ns", b"from a", created)
    assert lost.value.key == "t/ns"
    assert lost.value.actual is not None and lost.value.actual > created


async def test_freeze_makes_the_session_unreachable_and_thaw_reachable(
    private_harness: EtcdHarness,
) -> None:
    store = await private_harness.store(SessionPolicy(lease_ttl_s=5, keepalive_interval_s=0.2))
    await store.register_broker(BrokerId("a"), b"a")
    async with aclosing(store.session_events()) as events:
        private_harness.server.freeze()
        started = asyncio.get_running_loop().time()
        with pytest.raises(UnavailableError):
            await store.list_brokers()
        assert asyncio.get_running_loop().time() - started < REQUEST_TIMEOUT_S + 0.5
        assert (await next_event(private_harness, events, 3)).kind is SessionEventKind.UNREACHABLE
        frozen_renewal = store.last_renewed_monotonic
        await asyncio.sleep(2 * POLICY.keepalive_interval_s)
        assert store.last_renewed_monotonic == frozen_renewal
        private_harness.server.thaw()
        assert (await next_event(private_harness, events, 5)).kind is SessionEventKind.REACHABLE
    assert store.last_renewed_monotonic > frozen_renewal
    assert (await store.list_brokers())[0] == {BrokerId("a"): b"a"}


async def test_requests_to_a_dead_server_are_unavailable(private_harness: EtcdHarness) -> None:
    store = await private_harness.store()
    private_harness.server.kill()
    with pytest.raises(UnavailableError):
        await store.list_namespaces()
    private_harness.server.start()
    listed, _ = await _eventually(store.list_namespaces)
    assert listed == {}


async def test_requests_fail_over_to_the_next_endpoint(etcd_server: EtcdServer) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    conn = EtcdConnection([nobody, etcd_server.client_url], request_timeout_s=REQUEST_TIMEOUT_S)
    try:
        with pytest.raises(UnavailableError, match=nobody.removeprefix("http://")):
            await conn.get(b"/lbd-test/none")
        assert conn.endpoint == f"127.0.0.1:{etcd_server.port}"
        assert await conn.get(b"/lbd-test/none") is None
    finally:
        await conn.close()


async def test_watch_resumes_after_a_restart_without_missing_events(
    private_harness: EtcdHarness,
) -> None:
    writer = await private_harness.store()
    reader = await private_harness.store()
    _, revision = await reader.list_brokers()
    async with aclosing(reader.watch_brokers(revision)) as changes:
        await writer.register_broker(BrokerId("a"), b"1")
        first: RegistryEvent = await asyncio.wait_for(anext(changes), 5)
        # The loop is blocked from here to the gateway writes: the watch cannot resume before
        # they are in, so they fall between its last delivery and its reconnect.
        private_harness.server.restart()
        gateway = _Gateway(private_harness.server)
        gateway.put(private_harness.prefix + "brokers/b", b"2")
        gateway.delete(private_harness.prefix + "brokers/b")
        await _eventually(lambda: writer.register_broker(BrokerId("c"), b"3"))
        seen = [await asyncio.wait_for(anext(changes), 10) for _ in range(3)]
    assert (first.broker, first.value) == (BrokerId("a"), b"1")
    assert [(e.broker, e.value) for e in seen] == [
        (BrokerId("b"), b"2"),
        (BrokerId("b"), None),
        (BrokerId("c"), b"3"),
    ]
    assert [e.revision for e in seen] == sorted({e.revision for e in seen})


async def test_watch_resyncs_when_its_revision_was_compacted(
    private_harness: EtcdHarness,
) -> None:
    writer = await private_harness.store()
    reader = await private_harness.store()
    _, revision = await reader.list_brokers()
    async with aclosing(reader.watch_brokers(revision)) as changes:
        await writer.register_broker(BrokerId("a"), b"1")
        await asyncio.wait_for(anext(changes), 5)
        private_harness.server.restart()
        gateway = _Gateway(private_harness.server)
        gateway.put(private_harness.prefix + "brokers/b", b"2")
        gateway.put(private_harness.prefix + "brokers/b", b"2b")
        gateway.put(private_harness.prefix + "brokers/c", b"3")
        gateway.delete(private_harness.prefix + "brokers/a")
        gateway.compact(gateway.put(private_harness.prefix + "unrelated", b"x"))
        seen = [await asyncio.wait_for(anext(changes), 10) for _ in range(3)]
    # Intermediate values are gone with the compaction; the end state is reported.
    assert sorted((e.broker, e.value) for e in seen) == [
        (BrokerId("a"), None),
        (BrokerId("b"), b"2b"),
        (BrokerId("c"), b"3"),
    ]


async def _eventually(call: Any, timeout_s: float = 5.0) -> Any:
    """``await call()`` until it stops raising UnavailableError (a server coming back)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            return await call()
        except UnavailableError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


class _Gateway:
    """Blocking writes through etcd's JSON gateway: they run while the event loop cannot."""

    def __init__(self, server: EtcdServer) -> None:
        self._server = server

    def put(self, key: str, value: bytes) -> int:
        reply = self._post("/v3/kv/put", {"key": _b64(key.encode()), "value": _b64(value)})
        return int(reply["header"]["revision"])

    def delete(self, key: str) -> None:
        self._post("/v3/kv/deleterange", {"key": _b64(key.encode())})

    def compact(self, revision: int) -> None:
        self._post("/v3/kv/compaction", {"revision": str(revision), "physical": True})

    def _post(self, path: str, body: dict[str, object]) -> dict[str, Any]:
        conn = http.client.HTTPConnection(self._server.host, self._server.port, timeout=5)
        try:
            conn.request("POST", path, json.dumps(body))
            response = conn.getresponse()
            payload = response.read()
        finally:
            conn.close()
        assert response.status == 200, payload
        reply: dict[str, Any] = json.loads(payload)
        return reply


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()
