"""A consumer drops storage's repeats and keeps the permits straight, so it never starves."""

from __future__ import annotations

import asyncio

from lbd.core.ids import BundleId
from lbd.front.handles import TOP_UP_INTERVAL_S, ClientConsumer, Handle
from lbd.front.served import Topic
from lbd.front.storage import StorageAddress, StoragePool
from lbd.front.traffic import TopicTraffic, TrafficBook
from lbd.front.wire import Command, Frame, Type
from lbd.gen.pulsar import pulsar_api_pb2 as api

TOPIC = Topic.parse("persistent://t/n/permits")


class Services:
    storage = StoragePool(StorageAddress("127.0.0.1", 1), size=0)

    def __init__(self) -> None:
        self.book = TrafficBook()
        self.repeats = 0

    def accepts(self, handle: Handle) -> bool:
        return True

    def handle_lost(self, handle: Handle, why: str) -> None:
        raise AssertionError(why)

    def unserved(self, handle: Handle) -> None:
        raise AssertionError(f"{handle} not served")

    def traffic(self, topic: Topic) -> TopicTraffic:
        return self.book.of(topic)

    def repeat_dropped(self) -> None:
        self.repeats += 1


class Client:
    tls = False

    def __init__(self) -> None:
        self.entries: list[int] = []

    def write(self, command: Command, payload: bytes | None = None) -> None:
        self.entries.append(command.message.message_id.entryId)

    def forget(self, handle: Handle) -> None:
        pass


def consumer(
    sub_type: int = api.CommandSubscribe.Failover,
) -> tuple[ClientConsumer, Client, list[int]]:
    client = Client()
    subscribe = api.CommandSubscribe(
        topic=TOPIC.name,
        subscription="s",
        subType=sub_type,
        consumer_id=9,
        request_id=1,  # type: ignore[arg-type]
    )
    handle = ClientConsumer(
        client, Services(), subscribe, TOPIC, BundleId("t/n/0x00000000_0xffffffff")
    )
    flows: list[int] = []
    handle.storage.flow = flows.append  # type: ignore[method-assign]
    assert handle.opened()
    return handle, client, flows


def message(entry: int, redelivery_count: int = 0) -> Frame:
    inner = api.CommandMessage(
        consumer_id=1,
        message_id=api.MessageIdData(ledgerId=3, entryId=entry),
        redelivery_count=redelivery_count,
    )
    return Frame(Command(type=Type.MESSAGE, message=inner), b"payload")


async def test_a_repeat_is_dropped_and_its_permit_rides_on_the_next_flow() -> None:
    handle, client, flows = consumer()
    handle.flow(1000)
    for entry in (0, 1, 1, 2):
        handle._delivered(message(entry))
    assert client.entries == [0, 1, 2]
    assert handle.repeats_dropped == 1
    handle.flow(500)
    assert flows == [1000, 501]


async def test_storage_out_of_permits_because_of_repeats_gets_them_back_on_its_own() -> None:
    handle, client, flows = consumer()
    handle.flow(10)
    for entry in (0, 1, 2, 0, 1, 2, 0, 1, 2, 3):  # 4 new, 6 repeats: storage's 10 permits used
        handle._delivered(message(entry))
    assert client.entries == [0, 1, 2, 3]
    assert flows == [10]  # the client waits for 6 more and will send no FLOW before it has 5
    await asyncio.sleep(TOP_UP_INTERVAL_S + 0.05)
    assert flows == [10, 6]


async def test_a_redelivery_the_storage_marks_or_the_client_asked_for_passes() -> None:
    handle, client, _ = consumer()
    handle.flow(100)
    handle._delivered(message(0))
    handle._delivered(message(0, redelivery_count=1))
    handle.redeliver(api.CommandRedeliverUnacknowledgedMessages(consumer_id=9))
    handle._delivered(message(0))
    assert client.entries == [0, 0, 0]
    assert handle.repeats_dropped == 0


async def test_a_shared_subscription_delivers_everything_storage_sends() -> None:
    handle, client, _ = consumer(api.CommandSubscribe.Shared)
    handle.flow(100)
    for entry in (0, 1, 0):
        handle._delivered(message(entry))
    assert client.entries == [0, 1, 0]
