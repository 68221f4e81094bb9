"""New-bundle assignment on a dev cluster: one at a time, and in bulk.

``python -m bench.assign_bench [--bundles N] [--concurrency C]`` starts a 3-broker dev cluster of
its own and creates a namespace of ``N`` bundles, none owned yet. A Lookup of a topic in a bundle
with no owner assigns it: the sidecar chooses a broker and proposes ``Assigning``, the chosen
broker's sidecar has its broker Own it and proposes ``Owned``, and the Lookup answers once the
channel shows it. Measured through one sidecar with the same grpc.aio client:

- one at a time (the first ``sequential`` bundles): latency p50 and p99;
- in bulk (every other bundle, ``concurrency`` Lookups in flight): assignments per second.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import grpc
from rich.console import Console

from bench.report import measurements_table
from lbd.core.bundles import NamespaceBundles
from lbd.core.names import NamespaceName
from lbd.ctl.client import SidecarClient
from lbd.devcluster.cluster import DevClusterSpec, down, up
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from lbd.sim.workload import Workload, WorkloadSpec

NAMESPACE = "bench/assign"


def run(*, bundles: int = 4_000, sequential: int = 200, concurrency: int = 64) -> dict[str, float]:
    """Start a dev cluster, assign ``bundles`` fresh bundles, stop it."""
    if not 0 < sequential < bundles:
        raise ValueError(f"sequential must be in (0, {bundles}), got {sequential}")
    with tempfile.TemporaryDirectory(prefix="lbd-bench-assign-") as tmp:
        state_dir = Path(tmp) / "dev"
        cluster = up(state_dir, DevClusterSpec(brokers=3))
        try:
            addr = cluster.nodes[0].grpc_addr
            with SidecarClient(addr, timeout_s=30) as client:
                client.create_namespace(NAMESPACE, bundles)
            layout = NamespaceBundles.default(NamespaceName.parse(NAMESPACE), bundles)
            workload = Workload(WorkloadSpec(topics_per_bundle=1))
            topics = [workload.topics(b.id)[0] for b in layout.bundles()]
            first, rest = topics[:sequential], topics[sequential:]
            return asyncio.run(_measure(addr, first, rest, concurrency))
        finally:
            down(state_dir)


async def _measure(
    addr: str, one_by_one: list[str], bulk: list[str], concurrency: int
) -> dict[str, float]:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = lbd_pb2_grpc.LoadBalancerStub(channel)

        async def assign(topic: str) -> None:
            reply = await stub.Lookup(lbd_pb2.LookupRequest(topic=topic), timeout=60)
            if reply.state != lbd_pb2.BUNDLE_STATE_OWNED:
                raise RuntimeError(f"{topic}: answered {reply.state}, not Owned")

        latencies = []
        for topic in one_by_one:
            start = time.perf_counter()
            await assign(topic)
            latencies.append(1000 * (time.perf_counter() - start))
        cuts = statistics.quantiles(latencies, n=100, method="inclusive")
        pending = iter(bulk)

        async def worker() -> None:
            for topic in pending:
                await assign(topic)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        bulk_s = time.perf_counter() - start
    return {
        "one at a time: p50 ms": cuts[49],
        "one at a time: p99 ms": cuts[98],
        f"in bulk ({concurrency} in flight): assignments/s": len(bulk) / bulk_s,
        "in bulk: bundles": float(len(bulk)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.assign_bench", description=__doc__)
    parser.add_argument("--bundles", type=int, default=4_000)
    parser.add_argument("--sequential", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    console = Console()
    with console.status("assignments on a dev cluster..."):
        result = run(bundles=args.bundles, sequential=args.sequential, concurrency=args.concurrency)
    console.print(measurements_table("new-bundle assignment on a 3-broker dev cluster", result))


if __name__ == "__main__":
    main()
