"""The broker-side client against a scripted sidecar over real gRPC: Hello, acks, the serving
lease, load reports, and stopping everything when the lease runs out or the session ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from lbd.broker import BrokerClient, BrokerHandler, NewOwner
from lbd.broker.client import LEASE_RAN_OUT, SESSION_LOST
from lbd.core.ids import BundleId
from lbd.gen.v1 import lbd_pb2
from tests.unit.broker.scripted import WAIT_S, ScriptedSidecar, scripted_sidecar, until

BUNDLE = BundleId("public/default/0x00000000_0x40000000")
OTHER = BundleId("public/default/0x40000000_0x80000000")
LONG_MS = 60_000


class Recorder(BrokerHandler):
    """A broker that notes every call; refuses the bundles in :attr:`refuse` with their reason,
    and holds an Own while :attr:`own_gate` is clear."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.stops: asyncio.Queue[str] = asyncio.Queue()
        self.refuse: dict[str, str] = {}
        self.own_gate = asyncio.Event()
        self.own_gate.set()
        self.own_started = asyncio.Event()
        self.report = lbd_pb2.LoadReport(cpu=lbd_pb2.ResourceUsage(usage=42.0, limit=100.0))

    async def own(self, bundle: BundleId) -> str | None:
        self.own_started.set()
        await self.own_gate.wait()
        self.calls.append(("own", bundle, ""))
        return self.refuse.get(bundle)

    async def release(self, bundle: BundleId, new_owner: NewOwner | None) -> str | None:
        self.calls.append(("release", bundle, new_owner.service_url if new_owner else ""))
        return None

    async def close(self, bundle: BundleId, reason: str) -> str | None:
        self.calls.append(("close", bundle, reason))
        return None

    def stop_all(self, reason: str) -> None:
        self.stops.put_nowait(reason)

    def load_report(self) -> lbd_pb2.LoadReport:
        return self.report

    async def next_stop(self) -> str:
        return await asyncio.wait_for(self.stops.get(), WAIT_S)


def own(command_id: int, bundle: str) -> lbd_pb2.SidecarMessage:
    return lbd_pb2.SidecarMessage(command_id=command_id, own=lbd_pb2.OwnCommand(bundle=bundle))


@pytest.fixture
async def sidecar() -> AsyncIterator[tuple[ScriptedSidecar, str]]:
    async with scripted_sidecar() as served:
        yield served


@pytest.fixture
def handler() -> Recorder:
    return Recorder()


@pytest.fixture
async def client(
    sidecar: tuple[ScriptedSidecar, str], handler: Recorder
) -> AsyncIterator[BrokerClient]:
    _, addr = sidecar
    info = lbd_pb2.BrokerInfo(broker_id="broker-1", service_url="pulsar://broker-1:6650")
    async with BrokerClient(
        addr, info, handler, report_interval_s=0.05, reconnect_min_s=0.05
    ) as running:
        yield running


async def test_hello_comes_first_then_a_lease_request_at_once(
    sidecar: tuple[ScriptedSidecar, str], client: BrokerClient
) -> None:
    servicer, _ = sidecar
    session = await servicer.next_session()
    first = await asyncio.wait_for(session.received.get(), WAIT_S)
    assert first.WhichOneof("kind") == "hello"
    assert first.hello.broker_id == "broker-1"
    request = (await session.next("lease_request")).lease_request
    assert (request.sequence, request.lapses) == (1, 0)


async def test_commands_are_acked_and_a_bundle_is_served_only_owned_and_under_a_lease(
    sidecar: tuple[ScriptedSidecar, str], client: BrokerClient, handler: Recorder
) -> None:
    servicer, _ = sidecar
    session = await servicer.next_session()
    assert (await session.command(own(1, BUNDLE))).ok
    assert client.owned == {BUNDLE}
    assert not client.may_serve(BUNDLE)  # no lease yet
    await session.grant_next(LONG_MS)
    await until(client.lease_valid)
    assert client.may_serve(BUNDLE) and not client.may_serve(OTHER)
    assert client.serving() == {BUNDLE}

    handler.refuse[OTHER] = "no room for it"
    ack = await session.command(own(2, OTHER))
    assert (ack.ok, ack.error) == (False, "no room for it")
    assert not client.may_serve(OTHER)

    bad = await session.command(own(3, "no-such-bundle"))
    assert not bad.ok and "invalid bundle id" in bad.error

    release = lbd_pb2.ReleaseCommand(
        bundle=BUNDLE,
        new_owner_broker_id="broker-2",
        new_owner=lbd_pb2.OwnerUrls(service_url="pulsar://broker-2:6650"),
    )
    assert (await session.command(lbd_pb2.SidecarMessage(command_id=4, release=release))).ok
    assert not client.may_serve(BUNDLE)
    assert client.serving() == frozenset()
    close = lbd_pb2.CloseCommand(bundle=OTHER, reason="split")
    assert (await session.command(lbd_pb2.SidecarMessage(command_id=5, close=close))).ok
    assert handler.calls == [
        ("own", BUNDLE, ""),
        ("own", OTHER, ""),
        ("release", BUNDLE, "pulsar://broker-2:6650"),
        ("close", OTHER, "split"),
    ]


async def test_an_own_of_several_bundles_takes_each_and_acks_each_one_not_taken(
    sidecar: tuple[ScriptedSidecar, str], client: BrokerClient, handler: Recorder
) -> None:
    servicer, _ = sidecar
    session = await servicer.next_session()
    first = await asyncio.wait_for(session.received.get(), WAIT_S)
    assert first.hello.takes_own_batches  # the library carries out Own batches
    handler.refuse[OTHER] = "no room for it"
    batch = lbd_pb2.OwnCommand(bundle=BUNDLE, more_bundles=[OTHER, "no-such-bundle"])
    ack = await session.command(lbd_pb2.SidecarMessage(command_id=7, own=batch))
    assert ack.command_id == 7 and not ack.ok
    assert {f.bundle: f.error for f in ack.failed} == {
        OTHER: "no room for it",
        "no-such-bundle": ack.failed[1].error,
    }
    assert "invalid bundle id" in ack.failed[1].error
    assert client.owned == {BUNDLE}
    assert handler.calls == [("own", BUNDLE, ""), ("own", OTHER, "")]
    handler.refuse.clear()
    batch = lbd_pb2.OwnCommand(bundle=OTHER, more_bundles=[BUNDLE])
    ack = await session.command(lbd_pb2.SidecarMessage(command_id=8, own=batch))
    assert ack.ok and not ack.failed
    assert client.owned == {BUNDLE, OTHER}


async def test_the_lease_runs_out_when_renewals_go_unanswered_while_the_stream_stays_open(
    sidecar: tuple[ScriptedSidecar, str], client: BrokerClient, handler: Recorder
) -> None:
    servicer, _ = sidecar
    session = await servicer.next_session()
    await session.command(own(1, BUNDLE))
    first = await session.grant_next(400)
    second = await session.grant_next(400)  # renewals come every quarter of the duration
    assert second.sequence == first.sequence + 1
    await until(client.lease_valid)
    assert client.may_serve(BUNDLE)

    # From now on the sidecar answers nothing, and keeps the stream open.
    assert await handler.next_stop() == LEASE_RAN_OUT
    assert client.connected and servicer.sessions.empty()
    assert not client.may_serve(BUNDLE)
    assert client.owned == frozenset()  # forgotten: served again only after a new Own
    assert client.lapses == 1
    while (request := (await session.next("lease_request")).lease_request).lapses == 0:
        pass
    assert request.lapses == 1

    await session.grant_next(LONG_MS)
    await until(client.lease_valid)
    assert not client.may_serve(BUNDLE)
    assert (await session.command(own(2, BUNDLE))).ok
    assert client.may_serve(BUNDLE)


async def test_an_own_carried_out_while_the_lease_ran_out_is_dropped_again(
    sidecar: tuple[ScriptedSidecar, str], client: BrokerClient, handler: Recorder
) -> None:
    servicer, _ = sidecar
    session = await servicer.next_session()
    await session.grant_next(1000)  # and no renewal: it runs out while the Own is carried out
    await until(client.lease_valid)
    handler.own_gate.clear()
    session.to_send.put_nowait(own(1, BUNDLE))
    await asyncio.wait_for(handler.own_started.wait(), WAIT_S)
    assert await handler.next_stop() == LEASE_RAN_OUT  # while the broker was taking the bundle
    handler.own_gate.set()
    ack = (await session.next("ack")).ack
    assert ack.command_id == 1
    assert client.owned == frozenset()
    assert handler.calls == [("own", BUNDLE, ""), ("close", BUNDLE, LEASE_RAN_OUT)]


async def test_the_end_of_the_session_stops_everything_and_the_client_says_hello_again(
    sidecar: tuple[ScriptedSidecar, str], client: BrokerClient, handler: Recorder
) -> None:
    servicer, _ = sidecar
    first = await servicer.next_session()
    await first.command(own(1, BUNDLE))
    await first.grant_next(LONG_MS)
    await until(lambda: client.may_serve(BUNDLE))

    first.end()
    assert await handler.next_stop() == SESSION_LOST
    assert not client.may_serve(BUNDLE)
    second = await servicer.next_session()
    assert (await second.next("hello")).hello.broker_id == "broker-1"
    request = (await second.next("lease_request")).lease_request
    assert (request.sequence, request.lapses) == (1, 0)  # a new session counts afresh
    assert client.sessions == 2
    assert client.owned == frozenset()
    await second.grant_next(LONG_MS)
    await until(client.lease_valid)
    assert not client.may_serve(BUNDLE)


async def test_load_reports_are_what_the_broker_supplies(
    sidecar: tuple[ScriptedSidecar, str], client: BrokerClient, handler: Recorder
) -> None:
    servicer, _ = sidecar
    session = await servicer.next_session()
    assert (await session.next("load")).load == handler.report
    handler.report = lbd_pb2.LoadReport(bundles=[lbd_pb2.BundleStats(bundle=BUNDLE, topics=3)])
    async with asyncio.timeout(WAIT_S):
        while (await session.next("load")).load != handler.report:
            pass


async def test_closing_the_client_stops_everything(
    sidecar: tuple[ScriptedSidecar, str], handler: Recorder
) -> None:
    servicer, addr = sidecar
    client = BrokerClient(addr, lbd_pb2.BrokerInfo(broker_id="broker-1"), handler)
    async with client:
        session = await servicer.next_session()
        await session.command(own(1, BUNDLE))
    assert await handler.next_stop() == SESSION_LOST
    assert not client.connected and client.owned == frozenset()
    await client.close()  # idempotent


async def test_a_leave_is_sent_on_the_open_session_and_refused_without_one(
    sidecar: tuple[ScriptedSidecar, str], handler: Recorder
) -> None:
    servicer, addr = sidecar
    info = lbd_pb2.BrokerInfo(broker_id="broker-1")
    broker = BrokerClient(addr, info, handler, reconnect_min_s=0.05)
    assert not broker.leave("too early")  # no session yet
    async with broker:
        session = await servicer.next_session()
        await until(lambda: broker.connected)
        assert broker.leave("shutting down")
        assert (await session.next("leave")).leave.reason == "shutting down"


async def test_a_release_or_close_stops_a_bundle_when_it_arrives_not_when_its_turn_comes(
    sidecar: tuple[ScriptedSidecar, str], client: BrokerClient, handler: Recorder
) -> None:
    # The sidecar withholds lease grants until it has sent a Release the leader's hand-over
    # counts on; a grant after it must find the bundle stopped, even while the broker is still
    # busy with a command before it.
    servicer, _ = sidecar
    session = await servicer.next_session()
    assert (await session.command(own(1, BUNDLE))).ok
    await session.grant_next(LONG_MS)
    await until(lambda: client.may_serve(BUNDLE))
    handler.own_gate.clear()
    handler.own_started.clear()
    session.to_send.put_nowait(own(2, OTHER))  # the broker is slow to take it
    await asyncio.wait_for(handler.own_started.wait(), WAIT_S)
    release = lbd_pb2.ReleaseCommand(bundle=BUNDLE)
    session.to_send.put_nowait(lbd_pb2.SidecarMessage(command_id=3, release=release))
    close = lbd_pb2.CloseCommand(bundle=OTHER, reason="moved away")
    session.to_send.put_nowait(lbd_pb2.SidecarMessage(command_id=4, close=close))
    await until(lambda: not client.may_serve(BUNDLE))
    assert ("release", BUNDLE, "") not in handler.calls  # its turn has not come yet
    handler.own_gate.set()
    await until(lambda: ("close", OTHER, "moved away") in handler.calls)
    # The Own sent before the Close was carried out, and did not make the bundle servable.
    assert [c[:2] for c in handler.calls[1:]] == [
        ("own", OTHER),
        ("release", BUNDLE),
        ("close", OTHER),
    ]
    assert client.owned == frozenset()
    # A later Own does.
    assert (await session.command(own(5, OTHER))).ok
    assert client.may_serve(OTHER)
