"""Who served what, when: the simulated brokers' event logs turned into serving intervals.

The record that the chaos tests and the outage benchmark judge a run by (``tests/chaos``,
``bench/outage_bench.py``).

A broker serves a bundle from its ``own`` event until the earliest of: the arrival of its
Release or Close (``revoked``: it stops serving then, though the command waits its turn), its
``release`` or ``close`` of the bundle, the end of its session (``session`` ``lost``), its death
(the test's kill time), and the end of its serving lease. The lease is what bounds a broker that
writes nothing (a paused process logs nothing while paused): each ``lease`` event says the lease
is valid until ``until_ns``, and a broker with no valid lease serves nothing, whatever it was told
to own.

:func:`dual_serving` reports every overlap of two brokers' intervals on one bundle, however
short; :func:`serving_without_ownership` is for a table to compare with.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from lbd.devcluster.cluster import DevCluster

Event = Mapping[str, object]

END = 2**63
"""A time after every event: an interval still open when the log ends."""


@dataclass(frozen=True, slots=True, order=True)
class Interval:
    """``broker`` served ``bundle`` during ``[start, end)`` (nanoseconds of one clock)."""

    bundle: str
    start: int
    end: int
    broker: str


def read_events(cluster: DevCluster) -> list[dict[str, object]]:
    """Every simulated broker's events as logged so far, in time order."""
    out: list[dict[str, object]] = []
    for node in cluster.nodes:
        path = Path(node.events_file)
        if path.exists():
            out.extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return sorted(out, key=lambda e: int(str(e["t_ns"])))


def _lease_windows(events: list[Event]) -> list[tuple[int, int]]:
    """The times a broker held a valid lease: from each grant to its ``until_ns``, merged."""
    windows: list[tuple[int, int]] = []
    for e in events:
        if e["event"] != "lease":
            continue
        start, until = int(e["t_ns"]), int(str(e["until_ns"]))  # type: ignore[call-overload]
        if until <= start:
            continue
        if windows and start <= windows[-1][1]:
            windows[-1] = (windows[-1][0], max(windows[-1][1], until))
        else:
            windows.append((start, until))
    return windows


def serving_intervals(events: Iterable[Event], killed_at_ns: Mapping[str, int]) -> list[Interval]:
    """Every interval any broker served any bundle, from the merged event logs.

    ``killed_at_ns``: when a broker was killed (it logs nothing after): what it served, and its
    lease, end at its death. A broker started again under the same id logs anew after it; its
    events are judged on their own."""
    by_broker: dict[str, list[Event]] = {}
    for e in sorted(events, key=lambda e: int(e["t_ns"])):  # type: ignore[call-overload]
        by_broker.setdefault(str(e["broker"]), []).append(e)
    out: list[Interval] = []
    for broker, log in by_broker.items():
        death = killed_at_ns.get(broker, END)
        before = [e for e in log if int(e["t_ns"]) < death]  # type: ignore[call-overload]
        after = [e for e in log if int(e["t_ns"]) >= death]  # type: ignore[call-overload]
        out.extend(_incarnation(broker, before, death))
        out.extend(_incarnation(broker, after, END))
    return sorted(out)


def _incarnation(broker: str, log: list[Event], death: int) -> list[Interval]:
    """What one process of ``broker`` served, from its events, until ``death``."""
    assigned: list[tuple[str, int, int]] = []
    since: dict[str, int] = {}
    for e in log:
        t, bundle = int(e["t_ns"]), e["bundle"]  # type: ignore[call-overload]
        if e["event"] == "own" and isinstance(bundle, str):
            since.setdefault(bundle, t)
        elif e["event"] in ("revoked", "release", "close") and isinstance(bundle, str):
            if bundle in since:
                assigned.append((bundle, since.pop(bundle), t))
        elif e["event"] == "session" and e.get("detail") == "lost":
            assigned.extend((b, s, t) for b, s in since.items())
            since.clear()
    assigned.extend((b, s, END) for b, s in since.items())
    out = []
    windows = _lease_windows(log)
    for bundle, start, end in assigned:
        end = min(end, death)
        for w_start, w_end in windows:
            lo, hi = max(start, w_start), min(end, w_end, death)
            if lo < hi:
                out.append(Interval(bundle, lo, hi, broker))
    return out


def dual_serving(intervals: Iterable[Interval]) -> list[str]:
    """Every overlap of two brokers serving one bundle, as a sentence with its length."""
    by_bundle: dict[str, list[Interval]] = {}
    for i in intervals:
        by_bundle.setdefault(i.bundle, []).append(i)
    problems: list[str] = []
    for bundle, spans in by_bundle.items():
        spans.sort()
        for n, a in enumerate(spans):
            for b in spans[n + 1 :]:
                if b.start >= a.end:
                    break
                if b.broker != a.broker:
                    ms = (min(a.end, b.end) - b.start) / 1e6
                    problems.append(
                        f"{bundle}: {a.broker} and {b.broker} both served it for {ms:.3f} ms"
                    )
    return problems


@dataclass(frozen=True, slots=True)
class Write:
    """Storage entries ``first``..``last`` of ``topic``, accepted by ``broker`` under
    ``bundle`` between ``start`` and ``end`` (a broker front's ``write`` event)."""

    topic: str
    bundle: str
    broker: str
    start: int
    end: int
    first: tuple[int, int]
    last: tuple[int, int]


def writes(events: Iterable[Event]) -> list[Write]:
    """Every ``write`` event of the logs."""
    out = []
    for e in events:
        if e["event"] != "write":
            continue
        out.append(
            Write(
                topic=str(e["topic"]),
                bundle=str(e["bundle"]),
                broker=str(e["broker"]),
                start=int(str(e["t_ns"])),
                end=int(str(e["until_ns"])),
                first=_entry(str(e["first"])),
                last=_entry(str(e["last"])),
            )
        )
    return out


def _entry(text: str) -> tuple[int, int]:
    ledger, _, entry = text.partition(":")
    return int(ledger), int(entry)


def writes_outside_serving(intervals: Iterable[Interval], logged: Iterable[Write]) -> list[str]:
    """Every write a broker accepted while it did not serve the bundle (no Own, after its
    Release or Close, or with no valid lease), as a sentence."""
    by_key: dict[tuple[str, str], list[Interval]] = {}
    for i in intervals:
        by_key.setdefault((i.broker, i.bundle), []).append(i)
    problems = []
    for w in logged:
        spans = by_key.get((w.broker, w.bundle), [])
        if not any(s.start <= w.start and w.end < s.end for s in spans):
            problems.append(
                f"{w.broker} accepted entries {w.first}..{w.last} of {w.topic} under {w.bundle} "
                "while it did not serve the bundle"
            )
    return problems


def storage_order_violations(logged: Iterable[Write]) -> list[str]:
    """Every pair of writes of one topic by two brokers where the one accepted first was stored
    after the other: storage's order must follow the order of ownership."""
    by_topic: dict[str, list[Write]] = {}
    for w in logged:
        by_topic.setdefault(w.topic, []).append(w)
    problems = []
    for topic, spans in by_topic.items():
        spans.sort(key=lambda w: w.start)
        for n, a in enumerate(spans):
            for b in spans[n + 1 :]:
                if b.broker != a.broker and a.end < b.start and not a.last < b.first:
                    problems.append(
                        f"{topic}: {a.broker}'s entries up to {a.last} were stored after "
                        f"{b.broker}'s from {b.first}, which it accepted later"
                    )
    return problems
