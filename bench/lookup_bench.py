"""Owned Lookups on a sidecar against the gRPC ceiling: lbd beside a trivial server, in one run.

``python -m bench.lookup_bench [--lookups N] [--rounds N]`` starts a 3-broker dev cluster of its
own, owns every bundle of a namespace, records the LookupResponse bytes the sidecar gives for each
topic, and starts :mod:`bench.trivial_server` answering those same bytes from a dict. The same
grpc.aio client then drives both, alternating, at each concurrency; each figure is the median of
``rounds`` runs, and the ratio is lbd / trivial (throughput: 1.0 is the ceiling; latency: 1.0 is
as fast as the ceiling). :func:`figures` sets them against the goals (README "Benchmarks").
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

from bench.report import Figure, cuts, drain
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
    """Medians over the rounds, by concurrency, for lbd and for the trivial server."""

    lbd: dict[int, Run]
    trivial: dict[int, Run]


def run(*, lookups: int = 4_000, rounds: int = 3) -> Medians:
    """Start a dev cluster and the trivial server, measure both, stop them."""
    with tempfile.TemporaryDirectory(prefix="lbd-bench-lookup-") as tmp:
        state_dir = Path(tmp) / "dev"
        cluster = up(state_dir, DevClusterSpec(brokers=3))
        try:
            addr = cluster.nodes[0].grpc_addr
            rng = random.Random(0)
            topics = [f"persistent://{NAMESPACE}/t-{rng.randrange(10**9)}" for _ in range(lookups)]
            with SidecarClient(addr, timeout_s=30) as client:
                client.create_namespace(NAMESPACE, BUNDLES)
            responses = asyncio.run(_responses(addr, topics))
            responses_file = Path(tmp) / "responses.bin"
            write_responses(responses_file, responses)
            with _trivial_server(Path(tmp), responses_file) as trivial_addr:
                return asyncio.run(_measure(addr, trivial_addr, topics, rounds))
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


async def _measure(addr: str, trivial_addr: str, topics: list[str], rounds: int) -> Medians:
    requests = [_request(t) for t in topics]
    samples: dict[str, dict[int, list[Run]]] = {"lbd": {}, "trivial": {}}
    async with (
        grpc.aio.insecure_channel(addr) as lbd_channel,
        grpc.aio.insecure_channel(trivial_addr) as trivial_channel,
    ):
        calls = {"lbd": _raw_lookup(lbd_channel), "trivial": _raw_lookup(trivial_channel)}
        for call in calls.values():  # warm both channels up
            await _pass(call, requests[:200], 8)
        for i in range(rounds):
            for concurrency in CONCURRENCIES:
                order = ("lbd", "trivial") if i % 2 == 0 else ("trivial", "lbd")
                for name in order:
                    result = await _pass(calls[name], requests, concurrency)
                    samples[name].setdefault(concurrency, []).append(result)
    return Medians(
        lbd={c: _median(runs) for c, runs in samples["lbd"].items()},
        trivial={c: _median(runs) for c, runs in samples["trivial"].items()},
    )


async def _pass(
    call: grpc.aio.UnaryUnaryMultiCallable, requests: list[bytes], concurrency: int
) -> Run:
    drained = await drain(requests, lambda request: call(request, timeout=30), concurrency)
    _, p99_ms = cuts(drained.latencies_ms)
    return Run(per_s=drained.per_s, p99_ms=p99_ms)


def _median(runs: list[Run]) -> Run:
    return Run(
        per_s=statistics.median(r.per_s for r in runs),
        p99_ms=statistics.median(r.p99_ms for r in runs),
    )


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
    parser.add_argument("--lookups", type=int, default=4_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    Console().print(table(run(lookups=args.lookups, rounds=args.rounds)))


if __name__ == "__main__":
    main()
