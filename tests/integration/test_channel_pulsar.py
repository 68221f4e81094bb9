"""The ChannelLog contract on pulsar-lite, and the channel through a crash of the server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pulsar
import pulsar.asyncio
import pytest

from lbd.adapters.pulsar_channel import (
    BATCH_KEY,
    PulsarChannelLog,
    _Cursor,
    _ReReadError,
    decode_batch,
    encode_batch,
)
from lbd.adapters.pulsar_client import PulsarConnection, start_id
from lbd.core.ids import BrokerId, BundleId
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, encode_value
from lbd.core.table import ChannelPosition
from lbd.devcluster import PulsarLiteServer
from lbd.ports.channel import ChannelFormatError, ChannelMessage
from lbd.ports.errors import UnavailableError
from lbd.services.channel.follower import ChannelFollower
from tests.contract.channel_suite import ChannelLogContract, take

pytestmark = [pytest.mark.servers, pytest.mark.timeout(60)]

OPERATION_TIMEOUT_S = 5.0
OWNED = ServiceUnitStateData(state=ServiceUnitState.Owned, version_id=1, dst_broker=BrokerId("a"))

ChannelMaker = Callable[..., PulsarChannelLog]


@pytest.fixture
async def pulsar_channels() -> AsyncIterator[ChannelMaker]:
    """Make channel clients (each with a connection of its own); all closed afterwards."""
    made: list[tuple[PulsarConnection, PulsarChannelLog]] = []

    def make(
        server: PulsarLiteServer,
        topic: str,
        operation_timeout_s: float = OPERATION_TIMEOUT_S,
        send_timeout_s: float | None = None,
    ) -> PulsarChannelLog:
        connection = PulsarConnection(server.service_url, operation_timeout_s=operation_timeout_s)
        channel = PulsarChannelLog(connection, topic, send_timeout_s=send_timeout_s)
        made.append((connection, channel))
        return channel

    yield make
    for connection, channel in made:
        await channel.close()
        await connection.close()


class TestPulsarChannel(ChannelLogContract):
    @pytest.fixture
    def new_channel(
        self, pulsar_server: PulsarLiteServer, pulsar_topic: str, pulsar_channels: ChannelMaker
    ) -> Callable[[], PulsarChannelLog]:
        return lambda: pulsar_channels(pulsar_server, pulsar_topic)


async def test_positions_are_pulsar_message_ids(
    pulsar_server: PulsarLiteServer, pulsar_topic: str, pulsar_channels: ChannelMaker
) -> None:
    channel = pulsar_channels(pulsar_server, pulsar_topic)
    first = await channel.publish("t/ns/a", b"1")
    second = await channel.publish("t/ns/a", b"2")
    # Unbatched: each message is an entry of its own, right after the previous one.
    assert first.batch_index == second.batch_index == -1
    assert (second.ledger_id, second.entry_id) == (first.ledger_id, first.entry_id + 1)


async def test_publish_to_a_dead_server_is_unavailable(
    private_pulsar_server: PulsarLiteServer, pulsar_topic: str, pulsar_channels: ChannelMaker
) -> None:
    channel = pulsar_channels(private_pulsar_server, pulsar_topic)
    await channel.publish("t/ns/a", b"before")
    private_pulsar_server.kill()
    with pytest.raises(UnavailableError, match="Pulsar unavailable while publishing t/ns/a"):
        await channel.publish("t/ns/a", b"during")


async def test_a_write_given_up_while_the_server_is_down_does_not_land_once_it_returns(
    private_pulsar_server: PulsarLiteServer, pulsar_topic: str, pulsar_channels: ChannelMaker
) -> None:
    """The client drops a write at the channel's send timeout, as its caller stops waiting (the
    proposer's ``pulsar.publish_timeout_s``). Kept for the connection's operation timeout, an
    Assigning written at the start of a 20 s outage landed once Pulsar returned, 22 s old: the
    leader judged it stuck and moved the bundle its broker had just begun to serve."""
    server = private_pulsar_server
    channel = pulsar_channels(server, pulsar_topic, send_timeout_s=1.0)
    before = await channel.publish("t/ns/a", b"before")
    server.kill()
    with pytest.raises((UnavailableError, TimeoutError)):
        await asyncio.wait_for(channel.publish("t/ns/a", b"given-up"), 1.5)
    await asyncio.sleep(1.5)
    await asyncio.to_thread(server.restart)
    after = None
    for attempt in range(40):  # until the client is connected again
        with contextlib.suppress(UnavailableError, TimeoutError):
            value = f"after-{attempt}".encode()
            after = ChannelMessage(
                await asyncio.wait_for(channel.publish("t/ns/a", value), 1.5), "t/ns/a", value
            )
            break
    assert after is not None, "the channel took no write after the server returned"

    reader = pulsar_channels(server, pulsar_topic)
    landed: list[ChannelMessage] = []
    async with contextlib.aclosing(reader.follow(None)) as follower:
        async with asyncio.timeout(20):
            async for message in follower:
                if message not in landed:
                    landed.append(message)
                if message.position >= after.position:
                    break
    assert landed[0] == ChannelMessage(before, "t/ns/a", b"before")
    assert landed[-1] == after
    assert b"given-up" not in [m.value for m in landed]


def _count_readers(channel: PulsarChannelLog) -> list[ChannelPosition | None]:
    """Where each reader ``channel`` makes from now on starts (a list that grows)."""
    made: list[ChannelPosition | None] = []
    open_reader = channel._open_reader

    async def counted(after: ChannelPosition | None) -> Any:
        made.append(after)
        return await open_reader(after)

    channel._open_reader = counted  # type: ignore[method-assign]
    return made


async def test_read_barriers_ask_one_kept_reader_for_the_end(
    pulsar_server: PulsarLiteServer, pulsar_topic: str, pulsar_channels: ChannelMaker
) -> None:
    """A read barrier on a quiet channel used to make and close a reader (a subscription on the
    broker) every half channel window on every sidecar; the reader is now kept and asked what is
    new, and it still sees every message, batches and the log's own marker as catch-up does."""
    writer = pulsar_channels(pulsar_server, pulsar_topic)
    barrier = pulsar_channels(pulsar_server, pulsar_topic)
    made = _count_readers(barrier)

    assert await barrier.last_after(None) is None  # the marker that finds an empty log's end
    first = await writer.publish("t/ns/a", b"1")
    assert await barrier.last_after(None) == first
    batch = await writer.publish_batch([("t/ns/b", b"2"), ("t/ns/c", b"3")])
    assert await barrier.last_after(first) == batch[-1]
    for _ in range(20):
        assert await barrier.last_after(batch[-1]) is None
    last = await writer.publish("t/ns/d", b"4")
    assert await barrier.last_after(batch[0]) == last
    assert await barrier.last_after(None) == last
    assert made == [None, None]  # before the marker and after it; then kept

    # Asked about an earlier start than its reader's, it reads from there with a new one.
    late = pulsar_channels(pulsar_server, pulsar_topic)
    made = _count_readers(late)
    assert await late.last_after(last) is None
    assert await late.last_after(first) == last
    assert made == [last, first]


async def test_a_read_barrier_finds_the_end_again_after_the_server_restarts(
    private_pulsar_server: PulsarLiteServer, pulsar_topic: str, pulsar_channels: ChannelMaker
) -> None:
    server = private_pulsar_server
    writer = pulsar_channels(server, pulsar_topic)
    barrier = pulsar_channels(server, pulsar_topic, operation_timeout_s=2.0)
    first = await writer.publish("t/ns/a", b"1")
    assert await barrier.last_after(None) == first

    server.kill()
    with pytest.raises(UnavailableError):
        await barrier.last_after(first)
    await asyncio.to_thread(server.restart)
    last = None
    for _ in range(40):  # until the writer's client is connected again
        with contextlib.suppress(UnavailableError):
            last = await writer.publish("t/ns/b", b"2")
            break
    assert last is not None, "the channel took no write after the server returned"
    for _ in range(40):  # until the barrier's client is connected again
        with contextlib.suppress(UnavailableError):
            assert await barrier.last_after(first) == last
            break
    else:
        raise AssertionError("no read barrier completed after the server returned")
    assert await barrier.last_after(last) is None


async def _follow_into(channel: PulsarChannelLog, delivered: list[ChannelMessage]) -> None:
    """Append every message the channel delivers (repeats included), until cancelled."""
    async with contextlib.aclosing(channel.follow(None)) as follower:
        async for message in follower:
            delivered.append(message)


@pytest.mark.parametrize(
    ("send_timeout_s", "outage_s", "batch"),
    [
        # Outages of seconds: the client's reconnect backoff has grown by then, so producers are
        # back before old readers resubscribe (pulsar-lite's reconnected readers skip what was
        # published in between; the channel must not).
        pytest.param(8.0, 2.0, 1, id="sends-outlive-the-outage"),
        pytest.param(1.0, 2.0, 1, id="sends-fail-during-the-outage"),
        # Batches: whole or not at all, and never split by a reader's resume.
        pytest.param(8.0, 2.0, 3, id="batches-outlive-the-outage"),
        pytest.param(1.0, 2.0, 3, id="batches-fail-during-the-outage"),
    ],
)
async def test_followers_deliver_every_acknowledged_publish_once_across_a_crash(
    private_pulsar_server: PulsarLiteServer,
    pulsar_topic: str,
    pulsar_channels: ChannelMaker,
    send_timeout_s: float,
    outage_s: float,
    batch: int,
) -> None:
    server = private_pulsar_server
    publisher = pulsar_channels(server, pulsar_topic, operation_timeout_s=send_timeout_s)
    followers = [pulsar_channels(server, pulsar_topic) for _ in range(2)]
    acknowledged: list[ChannelMessage] = []
    failed = 0
    total = 300
    milestones = {100: asyncio.Event(), 150: asyncio.Event()}

    async def publish(i: int) -> list[ChannelMessage]:
        entries = [(f"t/ns/b{(i + j) % 7}", f"m-{i}-{j}".encode()) for j in range(batch)]
        if batch == 1:
            positions = [await publisher.publish(*entries[0])]
        else:
            positions = await publisher.publish_batch(entries)
        return [ChannelMessage(p, k, v) for p, (k, v) in zip(positions, entries, strict=True)]

    async def publish_stream() -> None:
        nonlocal failed
        for i in range(total):
            try:
                acknowledged.extend(await publish(i))
            except UnavailableError:
                failed += 1
                await asyncio.sleep(0.05)
                continue
            for count, reached in milestones.items():
                if len(acknowledged) >= count * batch:
                    reached.set()
            await asyncio.sleep(0.002)

    # Let followers run ahead of the crash: they are live, not catching up, when it hits.
    live: list[list[ChannelMessage]] = [[], []]
    streams = asyncio.ensure_future(publish_stream())
    await milestones[100].wait()
    following = [
        asyncio.ensure_future(_follow_into(f, d)) for f, d in zip(followers, live, strict=True)
    ]
    await milestones[150].wait()

    server.kill()
    acknowledged_before_crash = len(acknowledged) // batch
    await asyncio.sleep(outage_s)
    await asyncio.to_thread(server.restart)
    await asyncio.wait_for(streams, 50)

    last = acknowledged[-1].position
    deadline = asyncio.get_running_loop().time() + 20
    while any(not d or d[-1].position < last for d in live):
        assert asyncio.get_running_loop().time() < deadline, "followers did not catch up"
        await asyncio.sleep(0.05)
    for task in following:
        task.cancel()
    await asyncio.gather(*following, return_exceptions=True)

    assert acknowledged_before_crash < total - 50, "the crash came after the publish stream"
    assert len(acknowledged) == (total - failed) * batch
    if send_timeout_s < outage_s:
        assert failed > 0, "no publish failed during the outage"
    for delivered in live:
        positions = [m.position for m in delivered]
        assert positions == sorted(set(positions)), "a position was delivered twice or late"
        acked_set = set(acknowledged)
        assert [m for m in delivered if m in acked_set] == acknowledged
    up_to = min(len(live[0]), len(live[1]))
    assert live[0][:up_to] == live[1][:up_to]


async def test_a_follower_made_while_the_server_is_down_resumes_when_it_returns(
    private_pulsar_server: PulsarLiteServer, pulsar_topic: str, pulsar_channels: ChannelMaker
) -> None:
    server = private_pulsar_server
    writer = pulsar_channels(server, pulsar_topic)
    before = await writer.publish("t/ns/a", b"before")
    server.kill()

    reader = pulsar_channels(server, pulsar_topic)
    async with contextlib.aclosing(reader.follow(None)) as follower:
        pending = asyncio.ensure_future(take(follower, 2, timeout_s=40))
        await asyncio.sleep(1)
        assert not pending.done()
        await asyncio.to_thread(server.restart)
        after = await writer.publish("t/ns/a", b"after")
        got = await pending

    assert got == [
        ChannelMessage(before, "t/ns/a", b"before"),
        ChannelMessage(after, "t/ns/a", b"after"),
    ]


async def test_client_quirk_a_cancelled_read_swallows_the_next_message(
    pulsar_client: pulsar.asyncio.Client, pulsar_topic: str
) -> None:
    # Pins why the channel never times out a read on a reader it keeps using.
    producer = await pulsar_client.create_producer(pulsar_topic, batching_enabled=False)
    reader = await pulsar_client.create_reader(pulsar_topic, pulsar.MessageId.earliest)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read_next(), 0.2)
    await producer.send(b"first")
    await producer.send(b"second")
    message = await asyncio.wait_for(reader.read_next(), OPERATION_TIMEOUT_S)
    assert message.data() == b"second"


@dataclass(frozen=True)
class _FakeId:
    position: ChannelPosition

    def ledger_id(self) -> int:
        return self.position.ledger_id

    def entry_id(self) -> int:
        return self.position.entry_id

    def batch_index(self) -> int:
        return self.position.batch_index


@dataclass(frozen=True)
class _FakeMessage:
    position: ChannelPosition
    key: str = "t/ns/a"
    value: bytes = b"v"

    def message_id(self) -> _FakeId:
        return _FakeId(self.position)

    def partition_key(self) -> str:
        return self.key

    def data(self) -> bytes:
        return self.value


async def test_a_follower_stops_at_a_message_of_a_newer_format_and_its_owner_hears_why(
    pulsar_client: pulsar.asyncio.Client,
    pulsar_server: PulsarLiteServer,
    pulsar_topic: str,
    pulsar_channels: ChannelMaker,
) -> None:
    # A newer writer's message this version cannot read: skipping it would let this sidecar's
    # table diverge, so its follower dies, and the daemon (its on_death) stops saying why.
    channel = pulsar_channels(pulsar_server, pulsar_topic)
    await channel.publish("t/ns/a", encode_value(OWNED))
    producer = await pulsar_client.create_producer(pulsar_topic, batching_enabled=False)
    await producer.send(b"?", partition_key="__lbd_future__")
    await producer.close()
    deaths: list[tuple[str, BaseException]] = []
    follower = ChannelFollower(channel, on_death=lambda name, e: deaths.append((name, e)))
    await follower.start()
    try:
        for _ in range(200):
            if deaths:
                break
            await asyncio.sleep(0.05)
        ((_, error),) = deaths
        assert isinstance(error, ChannelFormatError)
        assert "'__lbd_future__'" in str(error) and "upgrade" in str(error)
        assert follower.get(BundleId("t/ns/a")) == OWNED  # what came before was applied
        assert not follower.is_ready
    finally:
        await follower.close()


def test_a_skipped_entry_is_re_read_once_then_accepted() -> None:
    cursor = _Cursor(ChannelPosition(0, 4))
    assert cursor.admit(_FakeMessage(ChannelPosition(0, 3))) == []
    assert cursor.admit(_FakeMessage(ChannelPosition(0, 4))) == []
    with pytest.raises(_ReReadError, match="skips entries after 0:4:-1"):
        cursor.admit(_FakeMessage(ChannelPosition(0, 6)))
    assert cursor.last == ChannelPosition(0, 4)

    # The fresh reader delivers 6 right after 4 again: the gap is real (a marker entry).
    admitted = cursor.admit(_FakeMessage(ChannelPosition(0, 6)))
    assert admitted == [ChannelMessage(ChannelPosition(0, 6), "t/ns/a", b"v")]
    # A new ledger starts its entries again: no skip.
    assert cursor.admit(_FakeMessage(ChannelPosition(1, 0))) != []
    assert cursor.admit(_FakeMessage(ChannelPosition(1, 1), key="__lbd_bootstrap__")) == []
    assert cursor.last == ChannelPosition(1, 1)


def _batch(position: ChannelPosition, entries: list[tuple[str, bytes]]) -> _FakeMessage:
    return _FakeMessage(position, key=BATCH_KEY, value=encode_batch(entries))


def test_a_batch_is_delivered_entry_by_entry_and_only_past_the_last_delivered() -> None:
    entries = [("t/ns/a", b"1"), ("t/ns/b", b""), ("t/ns/a", b"\x00" * 70_000)]
    assert decode_batch(encode_batch(entries)) == entries
    cursor = _Cursor(None)
    got = cursor.admit(_batch(ChannelPosition(3, 0), entries))
    assert got == [
        ChannelMessage(ChannelPosition(3, 0, i), key, value)
        for i, (key, value) in enumerate(entries)
    ]
    assert cursor.last == ChannelPosition(3, 0, 2)
    # A reader started after entry 0 of the batch reads its message again: the rest is new.
    resumed = _Cursor(ChannelPosition(3, 0, 0))
    assert [m.position for m in resumed.admit(_batch(ChannelPosition(3, 0), entries))] == [
        ChannelPosition(3, 0, 1),
        ChannelPosition(3, 0, 2),
    ]
    assert resumed.admit(_batch(ChannelPosition(3, 0), entries)) == []
    assert resumed.admit(_FakeMessage(ChannelPosition(3, 1))) != []


def test_a_reader_after_an_entry_of_a_batch_reads_its_message_again() -> None:
    start, inclusive = start_id(ChannelPosition(3, 7, 2))
    assert (start.ledger_id(), start.entry_id(), start.batch_index(), inclusive) == (3, 7, -1, True)
    start, inclusive = start_id(ChannelPosition(3, 7))
    assert (start.ledger_id(), start.entry_id(), inclusive) == (3, 7, False)


def test_a_malformed_batch_is_skipped_alike_by_every_reader() -> None:
    good = encode_batch([("t/ns/a", b"1")])
    for garbled in (good[:-3], good + b"\x00", b"\x01", b""):
        cursor = _Cursor(None)
        assert cursor.admit(_FakeMessage(ChannelPosition(0, 0), BATCH_KEY, garbled)) == []
        assert cursor.last == ChannelPosition(0, 0)


def test_a_message_this_version_cannot_read_stops_the_reader() -> None:
    with pytest.raises(ChannelFormatError, match=r"'__lbd_future__'.*upgrade"):
        _Cursor(None).admit(_FakeMessage(ChannelPosition(0, 0), key="__lbd_future__"))
    newer = b"\x02" + encode_batch([("t/ns/a", b"1")])[1:]
    with pytest.raises(ChannelFormatError, match=r"layout 2.*upgrade"):
        _Cursor(None).admit(_FakeMessage(ChannelPosition(0, 0), BATCH_KEY, newer))


def test_a_first_message_past_its_ledgers_start_is_re_read_once_then_accepted() -> None:
    # From the start of the log: the first message should be entry 0 of its ledger.
    cursor = _Cursor(None)
    with pytest.raises(_ReReadError, match="skips entries after the start of the log"):
        cursor.admit(_FakeMessage(ChannelPosition(0, 131)))
    assert cursor.last is None
    assert cursor.admit(_FakeMessage(ChannelPosition(0, 131))) != []

    # Into a new ledger: its first entry read should be 0 too.
    with pytest.raises(_ReReadError, match="skips entries after 0:131:-1"):
        cursor.admit(_FakeMessage(ChannelPosition(2, 5)))
    assert cursor.last == ChannelPosition(0, 131)
    assert cursor.admit(_FakeMessage(ChannelPosition(2, 5))) != []
    assert cursor.admit(_FakeMessage(ChannelPosition(3, 0))) != []
