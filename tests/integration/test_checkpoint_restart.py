"""A sidecar starting from a checkpoint in the real etcd, then the tail of the real channel."""

import asyncio

import pytest
from channel_values import value

from lbd.adapters.etcd import EtcdConnection
from lbd.adapters.etcd_checkpoint import EtcdCheckpointStore
from lbd.adapters.pulsar_channel import PulsarChannelLog
from lbd.adapters.pulsar_client import PulsarConnection
from lbd.core.ids import BundleId
from lbd.core.state import ServiceUnitState
from lbd.core.table import StateTable
from lbd.devcluster.servers import EtcdServer, PulsarLiteServer
from lbd.services.channel import checkpoints
from lbd.services.channel.follower import ChannelFollower

pytestmark = pytest.mark.servers
S = ServiceUnitState


async def test_checkpoint_plus_tail_equals_full_replay_after_tombstones_and_restarts(
    etcd_server: EtcdServer,
    etcd_prefix: bytes,
    private_pulsar_server: PulsarLiteServer,
    pulsar_topic: str,
) -> None:
    bundles = [BundleId(f"tenant/ns/0x{i:08x}_0x{i + 1:08x}") for i in range(50)]
    etcd = EtcdConnection([etcd_server.client_url], request_timeout_s=5)
    store = EtcdCheckpointStore(etcd, etcd_prefix.decode())
    pulsar = PulsarConnection(private_pulsar_server.service_url, operation_timeout_s=5)
    writer = PulsarChannelLog(pulsar, pulsar_topic)
    try:
        for b in bundles:
            await writer.publish(b, value(S.Assigning, 1, "broker-a"))
            last = await writer.publish(b, value(S.Owned, 2, "broker-a"))
        async with ChannelFollower(PulsarChannelLog(pulsar, pulsar_topic)) as leader:
            async with asyncio.timeout(10):
                await leader.wait_applied(last)
            assert await checkpoints.save(store, leader.table, leader_term=3) == last
        # The tail: unloads, tombstones of freed bundles, a transfer, a split's parent deleted.
        for b in bundles[:10]:
            await writer.publish(b, value(S.Releasing, 3, None, "broker-a"))
            await writer.publish(b, value(S.Free, 4, None, "broker-a"))
            await writer.publish(b, b"")
        await writer.publish(bundles[10], value(S.Releasing, 3, "broker-b", "broker-a"))
        await writer.publish(bundles[10], value(S.Assigning, 4, "broker-b", "broker-a"))
        await writer.publish(bundles[11], value(S.Splitting, 3, None, "broker-a"))
        last = await writer.publish(bundles[11], value(S.Deleted, 4, None, "broker-a"))
        await writer.close()

        # Both servers restart: the checkpoint (etcd) and the channel (pulsar-lite) survive.
        private_pulsar_server.kill()
        private_pulsar_server.restart()
        restored = await checkpoints.restore(store)
        assert len(restored) == len(bundles)

        full = StateTable()
        async for m in PulsarChannelLog(pulsar, pulsar_topic).catch_up(None):
            full.apply(m.position, BundleId(m.key), m.value)
        assert full.last_position == last
        async with ChannelFollower(PulsarChannelLog(pulsar, pulsar_topic), restored) as starter:
            async with asyncio.timeout(10):
                await starter.wait_ready()
            assert dict(starter.table.items()) == dict(full.items())
            assert starter.table.last_position == last
            assert starter.stats.accepted == 10 * 3 + 4  # the tail only
        assert all(b not in full for b in bundles[:10])
    finally:
        await writer.close()
        await pulsar.close()
        await etcd.close()
