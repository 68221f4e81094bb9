"""BrokerRegistry and NamespaceService over the in-memory metadata store."""

import asyncio

import pytest

from lbd.adapters.clock import ManualClock
from lbd.adapters.memory.metadata import MemoryMetadataCluster, MemoryMetadataStore
from lbd.adapters.session import SessionPolicy
from lbd.core.broker_info import BrokerInfo
from lbd.core.bundles import BundleRange
from lbd.core.errors import InvalidInputError, NotFoundError, PreconditionError
from lbd.core.ids import BrokerId
from lbd.core.names import NamespaceName
from lbd.core.namespace import NamespacePolicies
from lbd.ports.errors import UnavailableError
from lbd.services.cluster.namespaces import NamespaceService
from lbd.services.cluster.registry import BrokerRegistry

POLICY = SessionPolicy(lease_ttl_s=10, keepalive_interval_s=2)
NS = NamespaceName("public", "default")


@pytest.fixture
async def stores():
    clock = ManualClock()
    cluster = MemoryMetadataCluster(clock)
    made: list[MemoryMetadataStore] = []

    async def make() -> MemoryMetadataStore:
        store = MemoryMetadataStore(cluster, POLICY)
        await store.start()
        made.append(store)
        return store

    yield clock, cluster, make
    for store in made:
        await store.close()


async def next_change(changes):
    async with asyncio.timeout(2):
        return await anext(changes)


async def test_the_registry_lists_then_follows_registrations(stores) -> None:
    clock, _cluster, make = stores
    first, second = await make(), await make()
    one = BrokerInfo(BrokerId("one"), service_url="pulsar://one:6650")
    await first.register_broker(one.broker_id, one.to_json())
    await first.register_broker(BrokerId("garbled"), b"not json")
    async with BrokerRegistry(second, clock) as registry:
        assert registry.brokers() == {"one": one}  # the unreadable one is left out
        changes = registry.changes()
        two = BrokerInfo(BrokerId("two"))
        await BrokerRegistry(first, clock).register(two)
        assert (await next_change(changes)).broker == "two"
        assert registry.get(BrokerId("two")) == two
        clock.advance(3)
        await BrokerRegistry(first, clock).deregister(BrokerId("two"))
        event = await next_change(changes)
        assert (event.broker, event.value) == ("two", None)
        assert registry.get(BrokerId("two")) is None
        assert registry.absent_since(BrokerId("two")) == clock.monotonic()
        assert registry.absent_since(BrokerId("one")) is None
        await BrokerRegistry(first, clock).register(two)
        await next_change(changes)
        assert registry.absent_since(BrokerId("two")) is None


async def test_the_registry_is_in_safe_mode_while_the_store_is_unreachable(stores) -> None:
    clock, cluster, make = stores
    store = await make()
    async with BrokerRegistry(store, clock) as registry:
        assert registry.reachable
        cluster.set_reachable(False)
        await clock.run_for(2.5, step=0.5)
        assert not registry.reachable
        with pytest.raises(UnavailableError):
            await registry.register(BrokerInfo(BrokerId("x")))
        cluster.set_reachable(True)
        await clock.run_for(2.5, step=0.5)
        assert registry.reachable


async def test_namespaces_are_created_once_cached_and_refreshed(stores) -> None:
    _clock, _cluster, make = stores
    mine, theirs = NamespaceService(await make()), NamespaceService(await make(), 8)
    with pytest.raises(NotFoundError, match="namespace public/default does not exist"):
        await mine.get(NS)
    created = await mine.ensure(NS, 4)
    assert len(created.bundles()) == 4
    assert await theirs.ensure(NS) == created  # exists: not created again
    with pytest.raises(PreconditionError, match="already exists"):
        await theirs.create(NS, 2)
    other = NamespaceName("t", "n")
    assert len((await theirs.create(other)).bundles()) == 8  # the service's default
    # A change by one service is seen by the other after a refresh, not before.
    await theirs.split(NS, BundleRange(0, 0x40000000), [0x20000000])
    assert len((await mine.get(NS)).bundles()) == 4
    assert len((await mine.refresh(NS)).bundles()) == 5
    assert [r.name for r in await mine.list()] == [NS, other]


async def test_a_split_is_compare_and_swap_and_idempotent(stores) -> None:
    _clock, _cluster, make = stores
    a, b = NamespaceService(await make()), NamespaceService(await make())
    await a.ensure(NS, 4)
    await b.get(NS)  # b caches revision 1
    await a.set_policies(NS, NamespacePolicies(anti_affinity_group="g"))
    # b's write builds on the newer record: the policies survive the split.
    split = await b.split(NS, BundleRange(0x40000000, 0x80000000), [0x60000000])
    assert split.policies.anti_affinity_group == "g"
    again = await a.split(NS, BundleRange(0x40000000, 0x80000000), [0x60000000])
    assert again == split
    with pytest.raises(NotFoundError, match="not in the layout"):
        await a.split(NS, BundleRange(0x40000000, 0x80000000), [0x50000000])
    with pytest.raises(InvalidInputError, match="not strictly inside"):
        await a.split(NS, BundleRange(0, 0x40000000), [0x40000000])
    with pytest.raises(InvalidInputError, match="max_bundles 2 is below its current 5"):
        await a.set_policies(NS, NamespacePolicies(max_bundles=2))
    assert (await a.refresh(NS)).boundaries == split.boundaries


async def test_a_started_service_follows_the_watch_and_lists_without_asking_the_store(
    stores,
) -> None:
    _clock, _cluster, make = stores
    store = await make()
    watching, writer = NamespaceService(store), NamespaceService(await make())
    await writer.ensure(NS, 4)
    await watching.start()
    try:
        assert watching.cached(NS) == await writer.get(NS)  # listed at the start
        other = NamespaceName("t", "n")
        created = await writer.create(other, 2)
        split = await writer.split(NS, BundleRange(0, 0x40000000), [0x20000000])

        for _ in range(100):  # the watch delivers another writer's changes, without a refresh
            if watching.cached(other) == created and watching.cached(NS) == split:
                break
            await asyncio.sleep(0)
        assert (watching.cached(other), watching.cached(NS)) == (created, split)
        store.set_cut_off(True)
        # From the watched cache: no request to the store, which would fail now.
        assert [r.boundaries for r in await watching.list()] == [
            split.boundaries,
            created.boundaries,
        ]
        with pytest.raises(UnavailableError):
            await watching.list(fresh=True)
        store.set_cut_off(False)
    finally:
        await watching.close()
    await writer.split(NS, BundleRange(0x40000000, 0x80000000), [0x60000000])
    # Closed: reads go to the store again.
    assert len((await watching.list())[0].bundles()) == 6


async def test_a_watched_cache_never_goes_back_to_an_older_record(stores) -> None:
    _clock, _cluster, make = stores
    service = NamespaceService(await make())
    await service.start()
    try:
        await service.ensure(NS, 4)
        newer = await service.split(NS, BundleRange(0, 0x40000000), [0x20000000])
        for _ in range(10):  # the watch delivers the create, then the split
            await asyncio.sleep(0)
        assert service.cached(NS) == newer
        assert [r.boundaries for r in await service.list()] == [newer.boundaries]
    finally:
        await service.close()
