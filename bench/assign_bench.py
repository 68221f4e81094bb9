"""New-bundle assignment on a dev cluster: one at a time, and in bulk.

``python -m bench.assign_bench [--bundles N] [--concurrency C]`` starts a 3-broker dev cluster of
its own and creates a namespace of ``N`` bundles, none owned yet. A Lookup of a topic in a bundle
with no owner assigns it: the sidecar chooses a broker and proposes ``Assigning``, the chosen
broker's sidecar has its broker Own it and proposes ``Owned``, and the Lookup answers once the
channel shows it. Measured through one sidecar with the same grpc.aio client:

- one at a time (the first ``sequential`` bundles, after ``WARM_UP`` untimed): latency p50
  and p99;
- in bulk (every other bundle, ``concurrency`` Lookups in flight): assignments per second.

:func:`figures` sets the p99 and the bulk rate against their goals (README "Benchmarks").
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import grpc
from rich.console import Console

from bench.report import Figure, cuts, drain, lookup_owned, measurements_table
from lbd.core.bundles import NamespaceBundles
from lbd.core.names import NamespaceName
from lbd.ctl.client import SidecarClient
from lbd.devcluster.cluster import DevClusterSpec, down, up
from lbd.gen.v1 import lbd_pb2_grpc
from lbd.sim.workload import Workload, WorkloadSpec

NAMESPACE = "bench/assign"
WARM_UP = 10
"""Assignments made one at a time before the timed ones (of the ``sequential``)."""
P99_GOAL_MS = 20.0
BULK_GOAL_PER_S = 2_000.0


def run(*, bundles: int = 4_000, sequential: int = 200, concurrency: int = 64) -> dict[str, float]:
    """Start a dev cluster, assign ``bundles`` fresh bundles, stop it."""
    if not WARM_UP + 2 <= sequential < bundles:
        raise ValueError(f"sequential must be in [{WARM_UP + 2}, {bundles}), got {sequential}")
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
            await lookup_owned(stub, topic)

        # The first few make the client's connection and the sidecars' producers: not timed.
        await drain(one_by_one[:WARM_UP], assign, 1)
        p50_ms, p99_ms = cuts((await drain(one_by_one[WARM_UP:], assign, 1)).latencies_ms)
        in_bulk = await drain(bulk, assign, concurrency)
    return {
        "one at a time: p50 ms": p50_ms,
        "one at a time: p99 ms": p99_ms,
        f"in bulk ({concurrency} in flight): assignments/s": in_bulk.per_s,
        "in bulk: bundles": float(len(bulk)),
    }


def figures(result: dict[str, float]) -> list[Figure]:
    """The p99 one at a time and the rate in bulk, each against its goal."""
    # The bulk rate's name carries its concurrency: "in bulk (64 in flight): assignments/s".
    (rate_name,) = (name for name in result if name.endswith(" in flight): assignments/s"))
    return [
        Figure(
            "new-bundle assignment p99, one at a time",
            result["one at a time: p99 ms"],
            "ms",
            P99_GOAL_MS,
            "goal",
            "<= 1",
        ),
        Figure(
            f"new-bundle assignments {rate_name.removesuffix(': assignments/s')}",
            result[rate_name],
            "per s",
            BULK_GOAL_PER_S,
            "goal",
            ">= 1",
        ),
    ]


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
