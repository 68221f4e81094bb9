"""What mutual TLS and roles cost on the hot path: owned Lookups, plaintext vs ``--secure``.

``python -m bench.security_bench [--lookups N]`` starts a plain dev cluster and a ``--secure`` one
(mutual TLS, certificate roles, etcd with TLS and auth), one after the other in the same run,
and drives the same owned lookups through each with the same grpc.aio client: one at a time
(p50/p99 latency) and at each concurrency (throughput). The ratio is secure / plain; above 1 the
secure cluster is faster (noise), below 1 it pays for TLS and the role check.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.report import cuts, drain
from lbd.broker.credentials import ClientCredentials
from lbd.ctl.client import SidecarClient
from lbd.devcluster.cluster import DevClusterSpec, down, up
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc

NAMESPACE = "bench/security"
BUNDLES = 16
CONCURRENCIES = (1, 8, 32)


@dataclass(frozen=True, slots=True)
class Figures:
    p50_ms: float
    p99_ms: float
    per_s: dict[int, float]


def run(*, lookups: int = 4_000) -> dict[str, Figures]:
    """Plain and secure figures, measured in this order in one run."""
    modes = (("plain", False), ("mTLS", True))
    return {name: _cluster_figures(secure, lookups) for name, secure in modes}


def _cluster_figures(secure: bool, lookups: int) -> Figures:
    with tempfile.TemporaryDirectory(prefix="lbd-bench-sec-") as tmp:
        state_dir = Path(tmp) / "dev"
        cluster = up(state_dir, DevClusterSpec(brokers=3, secure=secure))
        try:
            credentials = cluster.credentials()
            addr = cluster.nodes[0].grpc_addr
            with SidecarClient(addr, credentials=credentials, timeout_s=30) as client:
                client.create_namespace(NAMESPACE, BUNDLES)
                rng = random.Random(0)
                topics = [
                    f"persistent://{NAMESPACE}/t-{rng.randrange(1_000_000)}" for _ in range(lookups)
                ]
                for topic in topics[:200]:
                    client.lookup(topic)  # every bundle owned before the clock starts
            return asyncio.run(_measure(addr, credentials, topics))
        finally:
            down(state_dir)


async def _measure(addr: str, credentials: ClientCredentials, topics: list[str]) -> Figures:
    async with credentials.aio_channel(addr) as channel:
        stub = lbd_pb2_grpc.LoadBalancerStub(channel)
        metadata = credentials.metadata()

        async def lookup(topic: str) -> None:
            await stub.Lookup(lbd_pb2.LookupRequest(topic=topic), metadata=metadata, timeout=30)

        one_by_one = await drain(topics[: len(topics) // 4], lookup, 1)
        p50_ms, p99_ms = cuts(one_by_one.latencies_ms)
        per_s = {c: (await drain(topics, lookup, c)).per_s for c in CONCURRENCIES}
        return Figures(p50_ms, p99_ms, per_s)


def table(figures: dict[str, Figures]) -> Table:
    """Plain, mTLS and their ratio per measurement."""
    plain, secure = figures["plain"], figures["mTLS"]
    out = Table(title="owned Lookup: plaintext vs mutual TLS + roles (3-broker dev clusters)")
    for column in ("measurement", "plain", "mTLS", "mTLS / plain"):
        out.add_column(column, justify="left" if column == "measurement" else "right")
    rows = [
        ("latency p50 (ms), one at a time", plain.p50_ms, secure.p50_ms),
        ("latency p99 (ms), one at a time", plain.p99_ms, secure.p99_ms),
        *(
            (f"lookups/s at concurrency {c}", plain.per_s[c], secure.per_s[c])
            for c in CONCURRENCIES
        ),
    ]
    for name, a, b in rows:
        out.add_row(name, f"{a:,.2f}", f"{b:,.2f}", f"{b / a:.2f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.security_bench", description=__doc__)
    parser.add_argument("--lookups", type=int, default=4_000)
    args = parser.parse_args()
    Console().print(table(run(lookups=args.lookups)))


if __name__ == "__main__":
    main()
