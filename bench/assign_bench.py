"""New-bundle assignment on a dev cluster: one at a time, and in bulk.

``python -m bench.assign_bench [--bundles N] [--concurrency C]`` starts a 3-broker dev cluster of
its own and creates a namespace of ``N`` bundles, none owned yet. A Lookup of a topic in a bundle
with no owner assigns it: the sidecar chooses a broker and proposes ``Assigning``, the chosen
broker's sidecar has its broker Own it and proposes ``Owned``, and the Lookup answers once the
channel shows it. Measured through one sidecar with the same grpc.aio client:

- one at a time (the first ``sequential`` bundles, after ``WARM_UP`` untimed): latency p50
  and p99;
- in bulk, a third of the other bundles each way: by ``concurrency`` Lookups in flight; by the
  same ``concurrency`` callers each looking up one topic at a time through the broker library's
  :class:`~lbd.broker.LookupBatcher` (which sends what they ask for in one turn as one
  ``LookupMany``, ``calls_in_flight`` calls at a time); and by ``LookupMany`` calls of
  ``per_call`` lookups made by the benchmark itself, ``calls_in_flight`` at a time: assignments
  per second each way.

:func:`figures` sets the p99 and the bulk rates against their goals (docs/performance.md, "The
figures of `make bench`").
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc
from rich.console import Console

from bench.report import (
    Figure,
    cuts,
    drain,
    lookup_many_owned,
    lookup_owned,
    measurements_table,
)
from lbd.api.loadbalancer import MAX_LOOKUPS_PER_CALL
from lbd.broker import LookupBatcher
from lbd.core.bundles import NamespaceBundles
from lbd.core.names import NamespaceName
from lbd.ctl.client import SidecarClient
from lbd.devcluster.cluster import DevClusterSpec, down, up
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from lbd.workload.traffic import Workload, WorkloadSpec

NAMESPACE = "bench/assign"
WARM_UP = 10
"""Assignments made one at a time before the timed ones (of the ``sequential``)."""
P99_GOAL_MS = 20.0
BULK_GOAL_PER_S = 2_000.0


def run(
    *,
    bundles: int = 8_000,
    sequential: int = 200,
    concurrency: int = 64,
    per_call: int = 256,
    calls_in_flight: int = 4,
) -> dict[str, float]:
    """Start a dev cluster, assign ``bundles`` fresh bundles, stop it."""
    if not WARM_UP + 2 <= sequential < bundles:
        raise ValueError(f"sequential must be in [{WARM_UP + 2}, {bundles}), got {sequential}")
    if not 1 <= per_call <= MAX_LOOKUPS_PER_CALL:
        raise ValueError(f"per_call must be in [1, {MAX_LOOKUPS_PER_CALL}], got {per_call}")
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
            third = len(rest) // 3
            many = rest[2 * third :]
            calls = [many[i : i + per_call] for i in range(0, len(many), per_call)]
            bulk = Bulk(rest[:third], rest[third : 2 * third], concurrency, calls, calls_in_flight)
            return asyncio.run(_measure(addr, first, bulk))
        finally:
            down(state_dir)


@dataclass(frozen=True, slots=True)
class Bulk:
    """The bundles assigned in bulk: by single Lookups, by single lookups gathered by the broker
    library, and by LookupMany calls."""

    singly: list[str]
    gathered: list[str]
    concurrency: int
    calls: list[list[str]]
    calls_in_flight: int

    @property
    def per_call(self) -> int:
        return len(self.calls[0])


async def _measure(addr: str, one_by_one: list[str], bulk: Bulk) -> dict[str, float]:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = lbd_pb2_grpc.LoadBalancerStub(channel)

        async def assign(topic: str) -> None:
            await lookup_owned(stub, topic)

        # The first few make the client's connection and the sidecars' producers: not timed.
        await drain(one_by_one[:WARM_UP], assign, 1)
        p50_ms, p99_ms = cuts((await drain(one_by_one[WARM_UP:], assign, 1)).latencies_ms)
        singly = await drain(bulk.singly, assign, bulk.concurrency)
        async with LookupBatcher(
            stub, max_per_call=bulk.per_call, calls_in_flight=bulk.calls_in_flight, timeout_s=60
        ) as batcher:

            async def assign_gathered(topic: str) -> None:
                reply = await batcher.lookup(topic)
                if reply.state != lbd_pb2.BUNDLE_STATE_OWNED:
                    raise RuntimeError(f"{topic}: answered {reply.state}, not Owned")

            gathered = await drain(bulk.gathered, assign_gathered, bulk.concurrency)
        many = await drain(
            bulk.calls, lambda topics: lookup_many_owned(stub, topics), bulk.calls_in_flight
        )
    many_name = f"in bulk (LookupMany of {bulk.per_call}, {bulk.calls_in_flight} in flight)"
    return {
        "one at a time: p50 ms": p50_ms,
        "one at a time: p99 ms": p99_ms,
        f"in bulk ({bulk.concurrency} Lookups in flight): assignments/s": singly.per_s,
        f"in bulk (LookupBatcher, {bulk.concurrency} lookups in flight): assignments/s": (
            gathered.per_s
        ),
        f"{many_name}: assignments/s": sum(len(c) for c in bulk.calls) / many.seconds,
        "in bulk: bundles each way": float(len(bulk.singly)),
    }


def figures(result: dict[str, float]) -> list[Figure]:
    """The p99 one at a time and the rates in bulk, each against its goal."""
    # The bulk rates' names say how they were made: "in bulk (64 Lookups in flight): ...".
    rates = [name for name in result if name.endswith(" in flight): assignments/s")]
    return [
        Figure(
            "new-bundle assignment p99, one at a time",
            result["one at a time: p99 ms"],
            "ms",
            P99_GOAL_MS,
            "goal",
            "<= 1",
        ),
        *(
            Figure(
                f"new-bundle assignments {name.removesuffix(': assignments/s')}",
                result[name],
                "per s",
                BULK_GOAL_PER_S,
                "goal",
                ">= 1",
            )
            for name in rates
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.assign_bench", description=__doc__)
    parser.add_argument("--bundles", type=int, default=8_000)
    parser.add_argument("--sequential", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--per-call", type=int, default=256)
    parser.add_argument("--calls-in-flight", type=int, default=4)
    args = parser.parse_args()
    console = Console()
    with console.status("assignments on a dev cluster..."):
        result = run(
            bundles=args.bundles,
            sequential=args.sequential,
            concurrency=args.concurrency,
            per_call=args.per_call,
            calls_in_flight=args.calls_in_flight,
        )
    console.print(measurements_table("new-bundle assignment on a 3-broker dev cluster", result))


if __name__ == "__main__":
    main()
