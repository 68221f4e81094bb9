"""How the benchmark suites measure calls and print what they measured.

Measuring: :func:`drain` (calls from one shared list, a number of them in flight, each timed) and
:func:`cuts` (the p50 and p99 of the latencies). Printing: :func:`measurements_table`, and
:func:`figures_table` for the figures measured against a baseline (:class:`Figure`).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from rich.table import Table

from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Drained:
    """What :func:`drain` measured: the wall-clock time of the whole pass, and each call's."""

    seconds: float
    latencies_ms: list[float]

    @property
    def per_s(self) -> float:
        """Calls per second over the whole pass."""
        return len(self.latencies_ms) / self.seconds


async def drain(
    items: Iterable[_T], call: Callable[[_T], Awaitable[object]], concurrency: int
) -> Drained:
    """Await ``call`` on every item, ``concurrency`` in flight; time the pass and each call.

    ``concurrency`` workers take the next item from one shared iterator as each finishes its
    call, so the calls in flight stay at ``concurrency`` until the items run out (a fixed split
    would leave the workers with the faster calls idle at the end). With ``concurrency`` 1 the
    calls go one at a time. The first error a call raises is raised here.
    """
    pending = iter(items)
    latencies_ms: list[float] = []

    async def worker() -> None:
        for item in pending:
            start = time.perf_counter()
            await call(item)
            latencies_ms.append(1000 * (time.perf_counter() - start))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Drained(time.perf_counter() - start, latencies_ms)


async def lookup_owned(stub: lbd_pb2_grpc.LoadBalancerStub, topic: str) -> None:
    """A Lookup of ``topic`` that must answer Owned (RuntimeError otherwise): an assignment when
    the bundle has no owner yet, else an answer from the table."""
    reply = await stub.Lookup(lbd_pb2.LookupRequest(topic=topic), timeout=60)
    if reply.state != lbd_pb2.BUNDLE_STATE_OWNED:
        raise RuntimeError(f"{topic}: answered {reply.state}, not Owned")


async def lookup_many_owned(stub: lbd_pb2_grpc.LoadBalancerStub, topics: Sequence[str]) -> None:
    """One LookupMany of ``topics`` whose every answer must be Owned (RuntimeError otherwise,
    naming the first topic that was not)."""
    request = lbd_pb2.LookupManyRequest(lookups=[lbd_pb2.LookupRequest(topic=t) for t in topics])
    reply = await stub.LookupMany(request, timeout=60)
    for topic, result in zip(topics, reply.results, strict=True):
        if result.answer.state != lbd_pb2.BUNDLE_STATE_OWNED:
            raise RuntimeError(f"{topic}: answered {result}, not Owned")


def cuts(values: Sequence[float]) -> tuple[float, float]:
    """The p50 and p99 of ``values`` (at least two), never outside their range."""
    percentiles = statistics.quantiles(values, n=100, method="inclusive")
    return percentiles[49], percentiles[98]


def measurements_table(title: str, result: dict[str, float]) -> Table:
    """One row per measurement, values with thousands separators."""
    table = Table(title=title)
    table.add_column("measurement")
    table.add_column("value", justify="right")
    for name, value in result.items():
        table.add_row(name, f"{value:,.2f}")
    return table


@dataclass(frozen=True, slots=True)
class Figure:
    """One figure beside its baseline: measured in the same run where one exists, else the goal.

    ``ratio`` is ``value / baseline``; ``goal`` says which ratio is good (e.g. ``">= 0.9"``).
    """

    name: str
    value: float
    unit: str
    baseline: float
    baseline_label: str
    """What the baseline is: "trivial grpc.aio server, same run", "1k bundles, same run", "goal"."""
    goal: str
    """The ratio the goal asks for, as ``">= X"`` or ``"<= X"``."""

    @property
    def ratio(self) -> float:
        """``value / baseline`` (infinite on a zero baseline)."""
        return self.value / self.baseline if self.baseline else float("inf")

    @property
    def met(self) -> bool:
        """Whether the ratio meets the goal."""
        op, _, bound = self.goal.partition(" ")
        limit = float(bound)
        return self.ratio >= limit if op == ">=" else self.ratio <= limit


def _amount(value: float, unit: str) -> str:
    text = f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.2f}"
    return f"{text} {unit}".rstrip()


def figures_table(title: str, figures: Iterable[Figure]) -> Table:
    """One row per figure: value, baseline, ratio, the goal and whether it is met."""
    table = Table(title=title)
    for column in ("figure", "lbd", "baseline", "ratio", "goal", "met"):
        table.add_column(column, justify="left" if column in ("figure", "baseline") else "right")
    for f in figures:
        table.add_row(
            f.name,
            _amount(f.value, f.unit),
            f"{_amount(f.baseline, f.unit)} ({f.baseline_label})",
            f"{f.ratio:,.2f}",
            f"ratio {f.goal}",
            "yes" if f.met else "no",
        )
    return table
