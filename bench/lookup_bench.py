"""Owned Lookups on a sidecar against the gRPC ceiling: lbd beside a trivial server, in one run.

``python -m bench.lookup_bench [--topics N] [--pairs N] [--per-pass N]`` starts a 3-broker dev
cluster of its own, owns every bundle of a namespace, records the LookupResponse bytes the sidecar
gives for each of ``topics`` topics, and starts :mod:`bench.trivial_server` answering those same
bytes from a dict. The same grpc.aio client then drives both at each concurrency in ``pairs``
pairs of passes of ``per_pass`` lookups, one server right after the other, the order alternating
from pair to pair. Short passes, closely interleaved, and many of them: on a 2-core machine
where the client and the server each use most of a core, one pass of a third of a second can run
half as fast, or half again as fast, as the other server's pass right after it, and a few long
rounds set one slow stretch against the other server's fast one.

Throughput is the median over a server's passes, and the ratio lbd / trivial (1.0 is the
ceiling); the p99 is taken over all of a server's latencies at that concurrency together.
:func:`figures` sets them against the goals (docs/performance.md, "The figures of `make bench`").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from rich.console import Console
from rich.table import Table

from bench.report import Drained, Figure, cuts, drain
from bench.trivial_server import METHOD, SERVICE, write_responses
from lbd.ctl.client import SidecarClient
from lbd.devcluster.cluster import DevClusterSpec, down, up
from lbd.gen.v1 import lbd_pb2

NAMESPACE = "bench/lookups"
BUNDLES = 64
CONCURRENCIES = (1, 8, 32, 128)
P99_AT = (8, 128)
START_TIMEOUT_S = 30.0

SAME_RUN = "trivial grpc.aio server, same run"
THROUGHPUT_GOAL = ">= 0.9"
"""lbd's owned Lookups per second against the trivial server's, at every concurrency."""
P99_GOAL_AT = 8
P99_GOAL_MS = 5.0
P99_CEILING_GOAL = "<= 1.1"
"""lbd's p99 against the trivial server's: the throughput goal's allowance, 1 / 0.9, as latency."""


@dataclass(frozen=True, slots=True)
class Run:
    """One pass of every topic at one concurrency against one server."""

    per_s: float
    p99_ms: float


@dataclass(frozen=True, slots=True)
class Medians:
    """By concurrency, for lbd and for the trivial server: the median throughput of the passes,
    and the p99 of their latencies together."""

    lbd: dict[int, Run]
    trivial: dict[int, Run]


def run(*, topics: int = 4_000, pairs: int = 16, per_pass: int = 1_000) -> Medians:
    """Start a dev cluster and the trivial server, measure both, stop them."""
    with tempfile.TemporaryDirectory(prefix="lbd-bench-lookup-") as tmp:
        state_dir = Path(tmp) / "dev"
        cluster = up(state_dir, DevClusterSpec(brokers=3))
        try:
            addr = cluster.nodes[0].grpc_addr
            rng = random.Random(0)
            names = [f"persistent://{NAMESPACE}/t-{rng.randrange(10**9)}" for _ in range(topics)]
            with SidecarClient(addr, timeout_s=30) as client:
                client.create_namespace(NAMESPACE, BUNDLES)
            responses = asyncio.run(_responses(addr, names))
            responses_file = Path(tmp) / "responses.bin"
            write_responses(responses_file, responses)
            with _trivial_server(Path(tmp), responses_file) as trivial_addr:
                return asyncio.run(_measure(addr, trivial_addr, names, pairs, per_pass))
        finally:
            down(state_dir)


async def _responses(addr: str, topics: list[str]) -> dict[str, bytes]:
    """Each topic's LookupResponse bytes from the sidecar (assigning bundles as needed)."""
    async with grpc.aio.insecure_channel(addr) as channel:
        call = _raw_lookup(channel)
        out: dict[str, bytes] = {}
        for topic in topics:
            out[topic] = await call(_request(topic), timeout=30)
        return out


def _raw_lookup(channel: grpc.aio.Channel) -> grpc.aio.UnaryUnaryMultiCallable:
    return channel.unary_unary(
        f"/{SERVICE}/{METHOD}",
        request_serializer=lambda raw: raw,
        response_deserializer=lambda raw: raw,
    )


def _request(topic: str) -> bytes:
    return lbd_pb2.LookupRequest(topic=topic).SerializeToString()


@contextlib.contextmanager
def _trivial_server(tmp: Path, responses: Path) -> Iterator[str]:
    port_file = tmp / "trivial.port"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.trivial_server",
            f"--port-file={port_file}",
            f"--responses={responses}",
        ],
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the trivial server did not start")
            time.sleep(0.05)
        yield f"127.0.0.1:{port_file.read_text()}"
    finally:
        process.terminate()
        process.wait(timeout=10)


async def _measure(
    addr: str, trivial_addr: str, topics: list[str], pairs: int, per_pass: int
) -> Medians:
    requests = [_request(t) for t in topics]
    passes: dict[str, dict[int, list[Drained]]] = {"lbd": {}, "trivial": {}}
    async with (
        grpc.aio.insecure_channel(addr) as lbd_channel,
        grpc.aio.insecure_channel(trivial_addr) as trivial_channel,
    ):
        calls = {"lbd": _raw_lookup(lbd_channel), "trivial": _raw_lookup(trivial_channel)}
        for call in calls.values():  # warm both channels up
            await _pass(call, requests[:200], 8)
        at = 0
        for concurrency in CONCURRENCIES:
            for i in range(pairs):
                chunk = [requests[(at + j) % len(requests)] for j in range(per_pass)]
                at += per_pass
                for name in ("lbd", "trivial") if i % 2 == 0 else ("trivial", "lbd"):
                    drained = await _pass(calls[name], chunk, concurrency)
                    passes[name].setdefault(concurrency, []).append(drained)
    return Medians(
        lbd={c: summary(runs) for c, runs in passes["lbd"].items()},
        trivial={c: summary(runs) for c, runs in passes["trivial"].items()},
    )


async def _pass(
    call: grpc.aio.UnaryUnaryMultiCallable, requests: list[bytes], concurrency: int
) -> Drained:
    return await drain(requests, lambda request: call(request, timeout=30), concurrency)


def summary(passes: list[Drained]) -> Run:
    """The median throughput of ``passes`` and the p99 of all their latencies."""
    _, p99_ms = cuts([ms for p in passes for ms in p.latencies_ms])
    return Run(per_s=statistics.median(p.per_s for p in passes), p99_ms=p99_ms)


def table(medians: Medians) -> Table:
    """lbd, the trivial server, and their ratio per measurement."""
    out = Table(title="owned Lookup: lbd vs a trivial grpc.aio server (same client, same run)")
    for column in ("measurement", "lbd", "trivial server", "ratio"):
        out.add_column(column, justify="left" if column == "measurement" else "right")
    for c in CONCURRENCIES:
        a, b = medians.lbd[c].per_s, medians.trivial[c].per_s
        out.add_row(f"lookups/s at concurrency {c}", f"{a:,.0f}", f"{b:,.0f}", f"{a / b:.2f}")
    for c in P99_AT:
        a, b = medians.lbd[c].p99_ms, medians.trivial[c].p99_ms
        out.add_row(f"p99 ms at concurrency {c}", f"{a:,.2f}", f"{b:,.2f}", f"{b / a:.2f}")
    return out


def figures(medians: Medians) -> list[Figure]:
    """The goals' figures: throughput at every concurrency, and the p99 at 8 in flight.

    The p99 stands twice: against the trivial server's in the same run, which says whether what
    is missing is lbd's, and against the 5 ms of the goal, which a slow machine can miss with
    both servers.
    """
    out = [
        Figure(
            f"owned Lookups at concurrency {c}",
            medians.lbd[c].per_s,
            "per s",
            medians.trivial[c].per_s,
            SAME_RUN,
            THROUGHPUT_GOAL,
        )
        for c in CONCURRENCIES
    ]
    name = f"owned Lookup p99 at concurrency {P99_GOAL_AT}"
    p99_ms = medians.lbd[P99_GOAL_AT].p99_ms
    out.append(
        Figure(name, p99_ms, "ms", medians.trivial[P99_GOAL_AT].p99_ms, SAME_RUN, P99_CEILING_GOAL)
    )
    out.append(Figure(name, p99_ms, "ms", P99_GOAL_MS, "goal", "<= 1"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lookup_bench", description=__doc__)
    parser.add_argument("--topics", type=int, default=4_000)
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--per-pass", type=int, default=1_000)
    args = parser.parse_args()
    Console().print(table(run(topics=args.topics, pairs=args.pairs, per_pass=args.per_pass)))


if __name__ == "__main__":
    main()
