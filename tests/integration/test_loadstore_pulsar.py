"""The LoadStore contract on pulsar-lite's non-persistent topics, and a store across a crash."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from lbd.adapters.clock import ManualClock
from lbd.adapters.pulsar_client import PulsarConnection
from lbd.adapters.pulsar_load import PulsarLoadStore
from lbd.devcluster import PulsarLiteServer
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from tests.contract.loadstore_suite import LoadStoreContract, StoreFactory, wait_until_latest

pytestmark = [pytest.mark.servers, pytest.mark.timeout(60)]

OPERATION_TIMEOUT_S = 5.0

StoreMaker = Callable[[PulsarLiteServer, str, Clock], PulsarLoadStore]


@pytest.fixture
def load_topic() -> str:
    """A non-persistent topic no other test uses."""
    return f"non-persistent://public/default/lbd-load-{uuid.uuid4().hex}"


@pytest.fixture
async def pulsar_stores() -> AsyncIterator[StoreMaker]:
    """Make load stores (each with a connection of its own); all closed afterwards."""
    made: list[tuple[PulsarConnection, PulsarLoadStore]] = []

    def make(server: PulsarLiteServer, topic: str, clock: Clock) -> PulsarLoadStore:
        connection = PulsarConnection(server.service_url, operation_timeout_s=OPERATION_TIMEOUT_S)
        store = PulsarLoadStore(connection, topic, clock)
        made.append((connection, store))
        return store

    yield make
    for connection, store in made:
        await store.close()
        await connection.close()


class TestPulsarLoadStore(LoadStoreContract):
    @pytest.fixture
    def new_store(
        self, pulsar_server: PulsarLiteServer, load_topic: str, pulsar_stores: StoreMaker
    ) -> StoreFactory:
        return lambda clock: pulsar_stores(pulsar_server, load_topic, clock)


async def test_start_against_a_dead_server_is_unavailable_and_leaves_nothing_running(
    private_pulsar_server: PulsarLiteServer, load_topic: str, pulsar_stores: StoreMaker
) -> None:
    private_pulsar_server.kill()
    store = pulsar_stores(private_pulsar_server, load_topic, ManualClock())
    with pytest.raises(UnavailableError, match="creating a reader"):
        await store.start()
    with pytest.raises(UnavailableError, match="creating a producer"):
        await store.publish("broker-1", b"v")


async def test_a_started_store_receives_again_after_the_server_restarts(
    private_pulsar_server: PulsarLiteServer, load_topic: str, pulsar_stores: StoreMaker
) -> None:
    clock = ManualClock()
    publisher = pulsar_stores(private_pulsar_server, load_topic, clock)
    reader = pulsar_stores(private_pulsar_server, load_topic, clock)
    await reader.start()
    await publisher.publish("broker-1", b"before")
    await wait_until_latest(reader, clock, {"broker-1": b"before"})

    private_pulsar_server.kill()
    private_pulsar_server.restart()

    # Non-persistent: what was published while the reader was away is gone, later values arrive.
    for attempt in range(100):
        try:
            await publisher.publish("broker-2", b"after-%d" % attempt)
        except UnavailableError:
            continue
        if "broker-2" in reader.latest(clock.now_ms(), 60_000):
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("the store did not receive after the restart")
    assert reader.latest(clock.now_ms(), 60_000)["broker-1"] == b"before"
