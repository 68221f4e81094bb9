"""Benchmark of a sidecar's start: newest checkpoint + tail vs a full replay of the channel.

``python -m bench.startup_bench [--bundles N] [--tail M]`` starts its own etcd and pulsar-lite,
fills the channel with N owned bundles, checkpoints them, appends M more messages, then times a
follower that replays the whole channel against one that restores the checkpoint and replays only
the tail. It also measures the table's memory per 100k bundles (tracemalloc).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import tracemalloc
import uuid

from rich.console import Console

from bench.report import measurements_table
from lbd.adapters.etcd import EtcdConnection
from lbd.adapters.etcd_checkpoint import EtcdCheckpointStore
from lbd.adapters.pulsar_channel import PulsarChannelLog
from lbd.adapters.pulsar_client import PulsarConnection
from lbd.core.ids import BrokerId, BundleId
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, encode_value
from lbd.core.table import ChannelPosition, StateTable
from lbd.devcluster import EtcdServer, PulsarLiteServer
from lbd.services.channel import checkpoints
from lbd.services.channel.follower import ChannelFollower


def _bundle(i: int) -> BundleId:
    return BundleId(f"bench/ns-{i // 1000}/0x{i:08x}_0x{i + 1:08x}")


def _owned(version: int, broker: int) -> bytes:
    value = ServiceUnitStateData(
        state=ServiceUnitState.Owned, version_id=version, dst_broker=BrokerId(f"broker-{broker}")
    )
    return encode_value(value)


def run(*, bundles: int = 100_000, tail: int = 1_000, concurrency: int = 64) -> dict[str, float]:
    """Measure; times in seconds, memory in MiB."""
    with EtcdServer() as etcd, PulsarLiteServer(log_level="warn") as pulsar:
        result = asyncio.run(
            _measure(etcd.client_url, pulsar.service_url, bundles, tail, concurrency)
        )
    result.update(table_memory(bundles))
    return result


async def _publish_all(log: PulsarChannelLog, items: list[tuple[BundleId, bytes]], n: int) -> None:
    it = iter(items)

    async def publisher() -> None:
        for key, value in it:
            await log.publish(key, value)

    await asyncio.gather(*(publisher() for _ in range(n)))


async def _start_follower(connection: PulsarConnection, topic: str, table: StateTable) -> float:
    start = time.perf_counter()
    follower = ChannelFollower(PulsarChannelLog(connection, topic), table)
    async with follower:
        await follower.wait_ready()
    return time.perf_counter() - start


async def _measure(
    etcd_url: str, pulsar_url: str, bundles: int, tail: int, concurrency: int
) -> dict[str, float]:
    topic = f"persistent://public/default/lbd-startup-{uuid.uuid4().hex}"
    pulsar = PulsarConnection(pulsar_url, operation_timeout_s=30)
    etcd = EtcdConnection([etcd_url], request_timeout_s=30)
    store = EtcdCheckpointStore(etcd, "/lbd/bench")
    log = PulsarChannelLog(pulsar, topic)
    try:
        await _publish_all(
            log, [(_bundle(i), _owned(1, i % 10)) for i in range(bundles)], concurrency
        )
        leader = ChannelFollower(PulsarChannelLog(pulsar, topic))
        async with leader:
            await leader.wait_ready()
            start = time.perf_counter()
            await checkpoints.save(store, leader.table, leader_term=1)
            save_s = time.perf_counter() - start
        tail_items = [(_bundle(i % bundles), _owned(2, (i + 1) % 10)) for i in range(tail)]
        await _publish_all(log, tail_items, concurrency)

        full_s = await _start_follower(pulsar, topic, StateTable())
        start = time.perf_counter()
        restored = await checkpoints.restore(store)
        restore_s = time.perf_counter() - start
        tail_s = await _start_follower(pulsar, topic, restored)
    finally:
        await log.close()
        await pulsar.close()
        await etcd.close()
    return {
        "bundles": float(bundles),
        "tail_messages": float(tail),
        "full_replay_start_s": full_s,
        "checkpoint_save_s": save_s,
        "checkpoint_start_s": restore_s + tail_s,
        "of_which_restore_s": restore_s,
        "speedup_x": full_s / (restore_s + tail_s),
    }


def table_memory(bundles: int) -> dict[str, float]:
    """Memory held by a table of ``bundles`` owned bundles, scaled to 100k bundles."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        table = StateTable()
        for i in range(bundles):
            table.apply(ChannelPosition(0, i), _bundle(i), _owned(1, i % 10))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(table) == bundles
    return {"table_mib_per_100k_bundles": used / bundles * 100_000 / 2**20}


def main() -> None:
    """Run :func:`run` with the command-line arguments and print a table."""
    parser = argparse.ArgumentParser(prog="python -m bench.startup_bench", description=__doc__)
    parser.add_argument("--bundles", type=int, default=100_000)
    parser.add_argument("--tail", type=int, default=1_000)
    args = parser.parse_args()
    console = Console()
    with console.status("benchmarking start-up..."):
        result = run(bundles=args.bundles, tail=args.tail)
    console.print(measurements_table("sidecar start: checkpoint + tail vs full replay", result))


if __name__ == "__main__":
    main()
