"""The simulated broker against a scripted sidecar: Hello, acks, load reports, session loss."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from lbd.broker.events import EventLog
from lbd.devcluster.sim_broker import SimBroker, SimBrokerConfig
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from lbd.workload.traffic import Workload, WorkloadSpec

BUNDLE = "public/default/0x00000000_0x40000000"
OTHER = "public/default/0x40000000_0x80000000"
WAIT_S = 5.0


@dataclass
class Session:
    """One BrokerSession as the scripted sidecar sees it."""

    received: asyncio.Queue[lbd_pb2.BrokerMessage] = field(default_factory=asyncio.Queue)
    to_send: asyncio.Queue[lbd_pb2.SidecarMessage | None] = field(default_factory=asyncio.Queue)

    async def next(self, kind: str) -> lbd_pb2.BrokerMessage:
        """The next message of ``kind`` (hello, load, ack), skipping the others."""
        async with asyncio.timeout(WAIT_S):
            while True:
                message = await self.received.get()
                if message.WhichOneof("kind") == kind:
                    return message

    async def command(self, message: lbd_pb2.SidecarMessage) -> lbd_pb2.CommandAck:
        """Send a command and wait for its ack."""
        self.to_send.put_nowait(message)
        while True:
            ack = (await self.next("ack")).ack
            if ack.command_id == message.command_id:
                return ack


class ScriptedSidecar(lbd_pb2_grpc.LoadBalancerServicer):
    """Hands every BrokerSession to the test, which decides what the sidecar says."""

    def __init__(self) -> None:
        self.sessions: asyncio.Queue[Session] = asyncio.Queue()

    async def BrokerSession(
        self, request_iterator: AsyncIterator[lbd_pb2.BrokerMessage], context: object
    ) -> AsyncIterator[lbd_pb2.SidecarMessage]:
        session = Session()
        self.sessions.put_nowait(session)

        async def pump() -> None:
            async for message in request_iterator:
                session.received.put_nowait(message)

        reader = asyncio.create_task(pump())
        try:
            while (message := await session.to_send.get()) is not None:
                yield message
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


@pytest.fixture
async def sidecar() -> AsyncIterator[tuple[ScriptedSidecar, str]]:
    server = grpc.aio.server()
    servicer = ScriptedSidecar()
    lbd_pb2_grpc.add_LoadBalancerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(0)


@pytest.fixture
async def broker(
    sidecar: tuple[ScriptedSidecar, str], tmp_path: Path
) -> AsyncIterator[tuple[SimBroker, Path]]:
    _, addr = sidecar
    events_path = tmp_path / "events.jsonl"
    events = EventLog(events_path, "broker-1")
    config = SimBrokerConfig(
        sidecar=addr, broker_id="broker-1", report_interval_s=0.05, reconnect_min_s=0.05
    )
    sim = SimBroker(config, Workload(WorkloadSpec(topics_per_bundle=4)), events)
    task = asyncio.create_task(sim.run())
    yield sim, events_path
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    events.close()


def read_events(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def own(command_id: int, bundle: str) -> lbd_pb2.SidecarMessage:
    return lbd_pb2.SidecarMessage(command_id=command_id, own=lbd_pb2.OwnCommand(bundle=bundle))


async def test_hello_names_the_broker_and_its_sidecar(
    sidecar: tuple[ScriptedSidecar, str], broker: tuple[SimBroker, Path]
) -> None:
    servicer, addr = sidecar
    session = await asyncio.wait_for(servicer.sessions.get(), WAIT_S)
    hello = (await session.next("hello")).hello
    assert hello.broker_id == "broker-1"
    assert hello.sidecar_grpc_addr == addr
    assert hello.service_url.startswith("pulsar://broker-1.")
    assert hello.start_time_ms > 0


async def test_own_release_and_close_are_acked_served_and_logged_in_order(
    sidecar: tuple[ScriptedSidecar, str], broker: tuple[SimBroker, Path]
) -> None:
    servicer, _ = sidecar
    sim, events_path = broker
    session = await asyncio.wait_for(servicer.sessions.get(), WAIT_S)
    assert (await session.command(own(1, BUNDLE))).ok
    assert (await session.command(own(2, OTHER))).ok
    assert sim.served == {BUNDLE, OTHER}

    release = lbd_pb2.ReleaseCommand(bundle=BUNDLE, new_owner_broker_id="broker-2")
    ack = await session.command(lbd_pb2.SidecarMessage(command_id=3, release=release))
    assert ack.ok
    close = lbd_pb2.CloseCommand(bundle=OTHER, reason="split")
    assert (await session.command(lbd_pb2.SidecarMessage(command_id=4, close=close))).ok
    assert sim.served == frozenset()

    events = read_events(events_path)
    assert [(e["event"], e["bundle"]) for e in events] == [
        ("session", None),
        ("own", BUNDLE),
        ("own", OTHER),
        ("revoked", BUNDLE),  # on arrival, then carried out
        ("release", BUNDLE),
        ("revoked", OTHER),
        ("close", OTHER),
    ]
    assert [events[3]["command"], events[5]["command"]] == ["release", "close"]
    assert events[4]["new_owner"] == "broker-2"
    assert events[6]["reason"] == "split"
    stamps = [e["t_ns"] for e in events]
    assert stamps == sorted(stamps)


async def test_a_command_for_a_malformed_bundle_is_nacked_with_the_reason(
    sidecar: tuple[ScriptedSidecar, str], broker: tuple[SimBroker, Path]
) -> None:
    servicer, _ = sidecar
    sim, _ = broker
    session = await asyncio.wait_for(servicer.sessions.get(), WAIT_S)
    ack = await session.command(own(7, "no-such-bundle"))
    assert not ack.ok
    assert "invalid bundle id" in ack.error
    assert sim.served == frozenset()


async def test_load_reports_cover_exactly_the_bundles_served(
    sidecar: tuple[ScriptedSidecar, str], broker: tuple[SimBroker, Path]
) -> None:
    servicer, _ = sidecar
    session = await asyncio.wait_for(servicer.sessions.get(), WAIT_S)
    await session.command(own(1, BUNDLE))
    async with asyncio.timeout(WAIT_S):
        while True:
            report = (await session.next("load")).load
            if report.bundles:
                break
    (stats,) = report.bundles
    assert stats.bundle == BUNDLE
    assert stats.topics == 4
    assert stats.msg_rate_in > 0 and stats.msg_throughput_in > 0
    assert [t.msg_rate for t in stats.topic_stats] == sorted(
        (t.msg_rate for t in stats.topic_stats), reverse=True
    )
    assert report.cpu.limit == 100 and 0 < report.cpu.usage < 100


async def test_a_lost_session_stops_serving_everything_and_the_broker_reconnects(
    sidecar: tuple[ScriptedSidecar, str], broker: tuple[SimBroker, Path]
) -> None:
    servicer, _ = sidecar
    sim, events_path = broker
    first = await asyncio.wait_for(servicer.sessions.get(), WAIT_S)
    await first.command(own(1, BUNDLE))
    first.to_send.put_nowait(None)  # the sidecar ends the stream

    second = await asyncio.wait_for(servicer.sessions.get(), WAIT_S)
    assert (await second.next("hello")).hello.broker_id == "broker-1"
    assert sim.served == frozenset()
    assert sim.sessions == 2
    events = [(e["event"], e["bundle"], e.get("reason")) for e in read_events(events_path)]
    assert events[:4] == [
        ("session", None, None),
        ("own", BUNDLE, None),
        ("session", None, None),
        ("close", BUNDLE, "session lost"),
    ]
    assert (await second.command(own(2, BUNDLE))).ok
    assert sim.served == {BUNDLE}
