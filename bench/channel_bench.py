"""Benchmark of the state channel on pulsar-lite: publish rates, follower catch-up and read
barriers.

``python -m bench.channel_bench [--messages N] [--concurrency C] [--barriers B]`` starts a
pulsar-lite of its own (or uses ``--service-url``) and prints one table. A read barrier on the
quiet channel is timed two ways in the same run: as the sidecar asks it
(``PulsarChannelLog.last_after``, a reader kept from barrier to barrier), and with a reader made
and closed for each (a catch-up from the same position, as a barrier used to).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator

from rich.console import Console

from bench.report import measurements_table
from lbd.adapters.pulsar_channel import PulsarChannelLog
from lbd.adapters.pulsar_client import PulsarConnection
from lbd.devcluster import PulsarLiteServer

_VALUE = (
    b'{"state": "Owned", "dst_broker": "broker-1", "source_broker": null, '
    b'"split_children": null, "force": false, "timestamp_ms": 1700000000000, '
    b'"version_id": 2, "leader_term": null}'
)


def run(
    *,
    service_url: str | None = None,
    sequential: int = 2_000,
    messages: int = 100_000,
    concurrency: int = 64,
    barriers: int = 300,
) -> dict[str, float]:
    """Measure the channel; rates in messages per second.

    ``sequential`` publishes awaited one by one; ``messages`` published by ``concurrency``
    concurrent publishers on one producer; then a new follower reads all ``messages`` from the
    start, and a catch-up reads them to the end of the log; then ``barriers`` read barriers each
    way (see the module docstring), in milliseconds.
    """
    with _server(service_url) as url:
        return asyncio.run(_measure(url, sequential, messages, concurrency, barriers))


@contextlib.contextmanager
def _server(service_url: str | None) -> Iterator[str]:
    if service_url is not None:
        yield service_url
        return
    with PulsarLiteServer(log_level="warn") as server:
        yield server.service_url


async def _measure(
    url: str, sequential: int, messages: int, concurrency: int, barriers: int
) -> dict[str, float]:
    topic = f"persistent://public/default/lbd-bench-{uuid.uuid4().hex}"
    connection = PulsarConnection(url, operation_timeout_s=30)
    channel = PulsarChannelLog(connection, topic)
    try:
        start = time.perf_counter()
        for i in range(sequential):
            await channel.publish(f"bench/ns/0x{i % 256:08x}_0x{i % 256 + 1:08x}", _VALUE)
        sequential_s = time.perf_counter() - start

        counter = iter(range(messages))

        async def publisher() -> None:
            for i in counter:
                await channel.publish(f"bench/ns/0x{i % 256:08x}_0x{i % 256 + 1:08x}", _VALUE)

        start = time.perf_counter()
        await asyncio.gather(*(publisher() for _ in range(concurrency)))
        concurrent_s = time.perf_counter() - start

        total = sequential + messages
        reader = PulsarChannelLog(connection, topic)
        try:
            start = time.perf_counter()
            seen = 0
            async with contextlib.aclosing(reader.follow(None)) as follower:
                async for _ in follower:
                    seen += 1
                    if seen == total:
                        break
            follow_s = time.perf_counter() - start

            start = time.perf_counter()
            async with contextlib.aclosing(reader.catch_up(None)) as messages_now:
                caught_up = sum([1 async for _ in messages_now])
            catch_up_s = time.perf_counter() - start

            end = await reader.last_after(None)
            start = time.perf_counter()
            for _ in range(barriers):
                assert await reader.last_after(end) is None
            kept_s = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(barriers):
                async with contextlib.aclosing(reader.catch_up(end)) as nothing:
                    assert [m async for m in nothing] == []
            fresh_s = time.perf_counter() - start
        finally:
            await reader.close()
    finally:
        await channel.close()
        await connection.close()
    return {
        "publish_sequential_per_s": sequential / sequential_s,
        "publish_sequential_latency_ms": 1000 * sequential_s / sequential,
        "publish_concurrent_per_s": messages / concurrent_s,
        "concurrency": float(concurrency),
        "follow_catch_up_per_s": total / follow_s,
        "follow_messages": float(total),
        "catch_up_per_s": caught_up / catch_up_s,
        "catch_up_messages": float(caught_up),
        "read_barrier_kept_reader_ms": 1000 * kept_s / barriers,
        "read_barrier_new_reader_ms": 1000 * fresh_s / barriers,
    }


def main() -> None:
    """Run :func:`run` with the command-line arguments and print a table."""
    parser = argparse.ArgumentParser(prog="python -m bench.channel_bench", description=__doc__)
    parser.add_argument("--service-url", help="an existing Pulsar (default: start pulsar-lite)")
    parser.add_argument("--sequential", type=int, default=2_000)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--barriers", type=int, default=300)
    args = parser.parse_args()
    console = Console()
    with console.status("benchmarking the channel..."):
        result = run(
            service_url=args.service_url,
            sequential=args.sequential,
            messages=args.messages,
            concurrency=args.concurrency,
            barriers=args.barriers,
        )
    console.print(measurements_table("state channel on Pulsar", result))


if __name__ == "__main__":
    main()
