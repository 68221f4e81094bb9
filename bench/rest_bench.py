"""HTTP lookups (Pulsar's REST API on a broker's web port) against gRPC Lookups, one run.

``python -m bench.rest_bench [--topics N] [--pairs N] [--per-pass N]`` starts a 3-broker dev
cluster of its own, owns every bundle of a namespace, then at each concurrency drives ``pairs``
pairs of passes of ``per_pass`` lookups of owned topics: one pass of ``GET
/lookup/v2/topic/...`` on broker-1's web port (kept-alive connections, one per call in
flight), one of ``Lookup`` on broker-1's sidecar (one grpc.aio channel), the order alternating
from pair to pair as in :mod:`bench.lookup_bench`. An HTTP lookup is a gRPC Lookup behind one more
hop (the broker front translates it, docs/operating.md), so the ratio says what that hop costs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import grpc
from rich.console import Console
from rich.table import Table

from bench.lookup_bench import Run, summary
from bench.report import Drained, Figure, drain
from lbd.ctl.client import SidecarClient
from lbd.devcluster.cluster import DevClusterSpec, down, up
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc

NAMESPACE = "bench/rest"
BUNDLES = 16
CONCURRENCIES = (1, 8, 32)
RATIO_GOAL = ">= 0.5"
"""HTTP lookups per second against gRPC Lookups at concurrency 8: the extra hop (HTTP parse,
one more gRPC call from the front) may cost at most half."""


@dataclass(frozen=True, slots=True)
class RestResult:
    """Per concurrency: the HTTP and the gRPC lookups' median throughput and p99."""

    http: dict[int, Run]
    grpc: dict[int, Run]


def run(*, topics: int = 2_000, pairs: int = 8, per_pass: int = 500) -> RestResult:
    """Start a dev cluster, measure both ways, stop it."""
    with tempfile.TemporaryDirectory(prefix="lbd-bench-rest-") as tmp:
        state_dir = Path(tmp) / "dev"
        cluster = up(state_dir, DevClusterSpec(brokers=3))
        try:
            node = cluster.nodes[0]
            rng = random.Random(0)
            names = [f"persistent://{NAMESPACE}/t-{rng.randrange(10**9)}" for _ in range(topics)]
            with SidecarClient(node.grpc_addr, timeout_s=30) as client:
                client.create_namespace(NAMESPACE, BUNDLES)
                for name in names:
                    client.lookup(name)
            return asyncio.run(_measure(node.grpc_addr, node.web_url, names, pairs, per_pass))
        finally:
            down(state_dir)


class _HttpPool:
    """Kept-alive HTTP/1.1 connections to one web port, one per call in flight."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or 80
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._all: list[asyncio.StreamWriter] = []

    async def get(self, path: str) -> bytes:
        if self._idle:
            reader, writer = self._idle.pop()
        else:
            reader, writer = await asyncio.open_connection(self._host, self._port)
            self._all.append(writer)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {self._host}\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        body = await reader.readexactly(length)
        if status != 200:
            raise RuntimeError(f"GET {path}: {status} {body!r}")
        self._idle.append((reader, writer))
        return body

    async def close(self) -> None:
        for writer in self._all:
            writer.close()


@contextlib.asynccontextmanager
async def _clients(addr: str, web_url: str) -> AsyncIterator[tuple[_HttpPool, object]]:
    pool = _HttpPool(web_url)
    async with grpc.aio.insecure_channel(addr) as channel:
        try:
            yield pool, lbd_pb2_grpc.LoadBalancerStub(channel)
        finally:
            await pool.close()


async def _measure(
    addr: str, web_url: str, topics: list[str], pairs: int, per_pass: int
) -> RestResult:
    passes: dict[str, dict[int, list[Drained]]] = {"http": {}, "grpc": {}}
    async with _clients(addr, web_url) as (pool, stub):
        lookup = stub.Lookup  # type: ignore[attr-defined]

        async def http(topic: str) -> object:
            return await pool.get(f"/lookup/v2/topic/{topic.replace('://', '/')}")

        async def rpc(topic: str) -> object:
            return await lookup(lbd_pb2.LookupRequest(topic=topic), timeout=30)

        calls = {"http": http, "grpc": rpc}
        for call in calls.values():  # warm both up
            await drain(topics[:100], call, 8)
        at = 0
        for concurrency in CONCURRENCIES:
            for i in range(pairs):
                chunk = [topics[(at + j) % len(topics)] for j in range(per_pass)]
                at += per_pass
                for name in ("http", "grpc") if i % 2 == 0 else ("grpc", "http"):
                    drained = await drain(chunk, calls[name], concurrency)
                    passes[name].setdefault(concurrency, []).append(drained)
    return RestResult(
        http={c: summary(runs) for c, runs in passes["http"].items()},
        grpc={c: summary(runs) for c, runs in passes["grpc"].items()},
    )


def table(result: RestResult) -> Table:
    out = Table(title="HTTP lookups on a broker's web port against gRPC Lookups on its sidecar")
    for column in ("in flight", "HTTP/s", "gRPC/s", "HTTP / gRPC", "HTTP p99 ms", "gRPC p99 ms"):
        out.add_column(column, justify="right")
    for c in CONCURRENCIES:
        h, g = result.http[c], result.grpc[c]
        out.add_row(
            str(c),
            f"{h.per_s:,.0f}",
            f"{g.per_s:,.0f}",
            f"{h.per_s / g.per_s:.2f}",
            f"{h.p99_ms:.2f}",
            f"{g.p99_ms:.2f}",
        )
    return out


def figures(result: RestResult) -> list[Figure]:
    at = 8
    return [
        Figure(
            name=f"HTTP lookups per second, {at} in flight",
            value=result.http[at].per_s,
            unit="/s",
            baseline=result.grpc[at].per_s,
            baseline_label="gRPC Lookups on the same broker's sidecar, same run",
            goal=RATIO_GOAL,
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topics", type=int, default=2_000)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--per-pass", type=int, default=500)
    args = parser.parse_args()
    result = run(topics=args.topics, pairs=args.pairs, per_pass=args.per_pass)
    Console().print(table(result))


if __name__ == "__main__":
    main()
