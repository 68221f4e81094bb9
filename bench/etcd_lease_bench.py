"""etcd's lease under load: what lbd's 3 s lease with a keepalive every 0.8 s rests on.

``python -m bench.etcd_lease_bench [--samples N] [--writers N]`` starts an etcd of its own (a
single member with etcd's own raft timing: 100 ms heartbeat, 1 s election timeout) and measures,
idle and while ``writers`` clients put 1 KB values as fast as etcd takes them:

- the keepalive round trip (``LeaseKeepAlive``, as a sidecar renews its lease): p50, p99, max;
- the expiry: a 3 s lease renewed once and then left alone, with a key under it and a watch on
  the key, until the watch sees the key deleted, counted from the renewal's answer. etcd checks
  for expired leases every 500 ms, so this is 3 to 3.5 s when etcd keeps up; a sidecar's
  detection term *v* in docs/safety.md.

A keepalive round trip must stay far below the 1 s request timeout, and the expiry near the TTL,
for the default timings to hold: the keepalive interval (0.8 s) plus two request timeouts fits in
the 3 s TTL, so a renewal can hang to its deadline and another still be sent in time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time

import aetcd
from rich.console import Console

from bench.report import cuts, measurements_table
from lbd.devcluster import EtcdServer

TTL_S = 3
VALUE = os.urandom(1024)
EXPIRIES = 3


def run(*, samples: int = 200, writers: int = 8) -> dict[str, float]:
    """Start an etcd, measure idle then under ``writers`` writers, stop it."""
    with EtcdServer(heartbeat_interval_ms=100, election_timeout_ms=1000) as etcd:
        return asyncio.run(_measure(etcd.host, etcd.port, samples, writers))


async def _measure(host: str, port: int, samples: int, writers: int) -> dict[str, float]:
    result: dict[str, float] = {}
    async with aetcd.Client(host=host, port=port) as client:
        for label, load in (("idle", 0), (f"{writers} writers", writers)):
            stop = asyncio.Event()
            puts = [0]
            tasks = [asyncio.create_task(_write(host, port, i, stop, puts)) for i in range(load)]
            started = time.monotonic()
            try:
                await asyncio.sleep(0.5 if load else 0)  # the load under way
                rtts = await _keepalives(client, samples)
                expiries = [await _expiry(client) for _ in range(EXPIRIES)]
            finally:
                stop.set()
                await asyncio.gather(*tasks, return_exceptions=True)
            elapsed = time.monotonic() - started
            p50, p99 = cuts([r * 1000 for r in rtts])
            result[f"{label}: keepalive p50 (ms)"] = p50
            result[f"{label}: keepalive p99 (ms)"] = p99
            result[f"{label}: keepalive max (ms)"] = max(rtts) * 1000
            result[f"{label}: expiry after last renewal, min (s)"] = min(expiries)
            result[f"{label}: expiry after last renewal, max (s)"] = max(expiries)
            if load:
                result[f"{label}: puts per second"] = puts[0] / elapsed
    return result


async def _keepalives(client: aetcd.Client, samples: int) -> list[float]:
    lease = await client.lease(TTL_S)
    rtts = []
    try:
        for _ in range(samples):
            began = time.monotonic()
            await client.refresh_lease(lease.id)
            rtts.append(time.monotonic() - began)
            await asyncio.sleep(0.01)
    finally:
        await client.revoke_lease(lease.id)
    return rtts


async def _expiry(client: aetcd.Client) -> float:
    """Seconds from a renewal's answer to the watch's delete of a key under the lease."""
    key = f"/bench/lease/{time.monotonic_ns()}".encode()
    lease = await client.lease(TTL_S)
    await client.put(key, b"x", lease=lease)
    deleted = asyncio.Event()

    async def watch() -> None:
        async for event in await client.watch(key):
            if event.kind == aetcd.EventKind.DELETE:
                deleted.set()
                return

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.sleep(0.2)  # the watch in place
        await client.refresh_lease(lease.id)
        renewed = time.monotonic()
        await asyncio.wait_for(deleted.wait(), TTL_S * 5)
        return time.monotonic() - renewed
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _write(host: str, port: int, i: int, stop: asyncio.Event, puts: list[int]) -> None:
    async with aetcd.Client(host=host, port=port) as client:
        n = 0
        while not stop.is_set():
            await client.put(f"/bench/load/{i}/{n % 1000}".encode(), VALUE)
            n += 1
            puts[0] += 1


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.etcd_lease_bench", description=__doc__)
    parser.add_argument("--samples", type=int, default=200, help="keepalives timed per phase")
    parser.add_argument("--writers", type=int, default=8, help="clients putting during the load")
    args = parser.parse_args()
    if args.samples < 2 or args.writers < 1:
        parser.error("--samples must be >= 2 and --writers >= 1")
    result = run(samples=args.samples, writers=args.writers)
    Console().print(measurements_table("etcd lease: keepalive and expiry, idle and loaded", result))


if __name__ == "__main__":
    main()
