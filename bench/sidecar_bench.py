"""Benchmark of the sidecar on a dev cluster: lookups, assignments, failover after kill -9.

``python -m bench.sidecar_bench [--brokers N] [--bundles N] [--lookups N]`` starts a dev cluster
of its own (``lbd dev up`` on a temporary state dir, the dev cluster's settings: lease TTL
3 s, orphan cleanup grace 1.5 s) and prints one table. Measured:

- assignment latency: a lookup of a topic whose bundle has no owner yet (the sidecar picks a
  broker, writes Assigning, the broker acks Own, Owned is applied), one at a time;
- lookup latency and throughput for owned bundles on one sidecar (answered from its table),
  one at a time and with ``concurrency`` calls in flight;
- failover: after kill -9 of a non-leader's sidecar and broker, until every bundle it owned is
  owned by a live broker; after kill -9 of the leader's sidecar, until another leader is elected.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from rich.console import Console

from bench.report import cuts, drain, measurements_table
from lbd.core.bundles import NamespaceBundles
from lbd.core.names import NamespaceName
from lbd.ctl.client import RpcFailure, SidecarClient
from lbd.devcluster.cluster import DevCluster, DevClusterSpec, down, up
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from lbd.workload.traffic import Workload, WorkloadSpec

NAMESPACE = "bench/lookups"
FAILOVER_TIMEOUT_S = 60.0


def run(
    *, brokers: int = 3, bundles: int = 128, lookups: int = 5_000, concurrency: int = 32
) -> dict[str, float]:
    """Start a dev cluster, measure, stop it; latencies in ms, rates per second, times in s."""
    with tempfile.TemporaryDirectory(prefix="lbd-bench-") as tmp:
        state_dir = Path(tmp) / "dev"
        cluster = up(state_dir, DevClusterSpec(brokers=brokers))
        try:
            return _measure(cluster, bundles, lookups, concurrency)
        finally:
            down(state_dir)


def _measure(cluster: DevCluster, bundles: int, lookups: int, concurrency: int) -> dict[str, float]:
    first = cluster.nodes[0]
    result: dict[str, float] = {}
    with SidecarClient(first.grpc_addr, timeout_s=30) as client:
        client.create_namespace(NAMESPACE, bundles)
        layout = NamespaceBundles.default(NamespaceName.parse(NAMESPACE), bundles)
        workload = Workload(WorkloadSpec(topics_per_bundle=1))
        fresh = [workload.topics(b.id)[0] for b in layout.bundles()]
        assign_ms = _latencies_ms(lambda topic: client.lookup(topic), fresh)
        result.update(_percentiles("assign_latency", assign_ms))
        result["assign_per_s"] = 1000 * len(assign_ms) / sum(assign_ms)

        rng = random.Random(0)
        owned = [f"persistent://{NAMESPACE}/t-{rng.randrange(1_000_000)}" for _ in range(lookups)]
        sequential = owned[: max(1, lookups // 5)]
        lookup_ms = _latencies_ms(lambda topic: client.lookup(topic), sequential)
        result.update(_percentiles("lookup_latency", lookup_ms))
        result["lookup_sequential_per_s"] = 1000 * len(lookup_ms) / sum(lookup_ms)
        result["lookup_concurrent_per_s"] = asyncio.run(
            _throughput(first.grpc_addr, owned, concurrency)
        )
        result["lookup_concurrency"] = float(concurrency)
    result.update(_failover(cluster))
    return result


def _latencies_ms(call: Callable[[str], object], topics: list[str]) -> list[float]:
    out: list[float] = []
    for topic in topics:
        start = time.perf_counter()
        call(topic)
        out.append(1000 * (time.perf_counter() - start))
    return out


def _percentiles(name: str, values: list[float]) -> dict[str, float]:
    p50_ms, p99_ms = cuts(values)
    return {f"{name}_p50_ms": p50_ms, f"{name}_p99_ms": p99_ms}


async def _throughput(addr: str, topics: list[str], concurrency: int) -> float:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = lbd_pb2_grpc.LoadBalancerStub(channel)
        drained = await drain(
            topics,
            lambda topic: stub.Lookup(lbd_pb2.LookupRequest(topic=topic), timeout=30),
            concurrency,
        )
        return drained.per_s


def _failover(cluster: DevCluster) -> dict[str, float]:
    """Kill a non-leader's sidecar and broker, then the leader's sidecar; time the recoveries."""
    clients = {n.broker_id: SidecarClient(n.grpc_addr, timeout_s=5) for n in cluster.nodes}
    try:
        leader = clients[cluster.nodes[0].broker_id].leader().broker_id
        owners = _owners(clients[leader])
        others = [n for n in cluster.nodes if n.broker_id != leader]
        if not others or not owners:
            return {}
        victim = next((n for n in others if n.broker_id in owners.values()), others[0])
        if victim.broker_id not in owners.values():
            # A cluster just started can place every bundle on one broker (the least loaded
            # pool holds it alone while the others' first reports come in): the victim is
            # given a share first, as the chaos tests' victim_owning does.
            share = sorted(owners)[: max(1, len(owners) // len(cluster.nodes))]
            for bundle in share:
                clients[leader].transfer(bundle, victim.broker_id)
            _wait(lambda: all(_owners(clients[leader]).get(b) == victim.broker_id for b in share))
            owners = _owners(clients[leader])
        orphans = [b for b, o in owners.items() if o == victim.broker_id]
        os.kill(victim.sidecar.pid, signal.SIGKILL)
        os.kill(victim.broker.pid, signal.SIGKILL)
        start = time.monotonic()
        _wait(
            lambda: all(
                _owners(clients[leader]).get(b) not in (None, victim.broker_id) for b in orphans
            )
        )
        out = {"failover_orphans_owned_again_s": time.monotonic() - start}
        live = [b for b in clients if b not in (victim.broker_id, leader)]
        if not live:
            return out
        os.kill(cluster.node(leader).sidecar.pid, signal.SIGKILL)
        start = time.monotonic()
        _wait(lambda: clients[live[0]].leader().broker_id not in ("", leader))
        out["failover_new_leader_s"] = time.monotonic() - start
        return out
    finally:
        for client in clients.values():
            client.close()


def _owners(client: SidecarClient) -> dict[str, str]:
    return {
        b.bundle: b.owner_broker_id
        for b in client.bundles(NAMESPACE).bundles
        if b.state == lbd_pb2.BUNDLE_STATE_OWNED
    }


def _wait(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + FAILOVER_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if done():
                return
        except RpcFailure:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"the cluster did not recover within {FAILOVER_TIMEOUT_S:g}s")


def main() -> None:
    """Run :func:`run` with the command-line arguments and print a table."""
    parser = argparse.ArgumentParser(prog="python -m bench.sidecar_bench", description=__doc__)
    parser.add_argument("--brokers", type=int, default=3)
    parser.add_argument("--bundles", type=int, default=128)
    parser.add_argument("--lookups", type=int, default=5_000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    console = Console()
    with console.status("benchmarking the sidecar on a dev cluster..."):
        result = run(
            brokers=args.brokers,
            bundles=args.bundles,
            lookups=args.lookups,
            concurrency=args.concurrency,
        )
    console.print(measurements_table("sidecar on a dev cluster", result))


if __name__ == "__main__":
    main()
