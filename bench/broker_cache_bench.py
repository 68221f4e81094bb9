"""Benchmark of the broker-side ownership cache: topic lookups answered in process.

``python -m bench.broker_cache_bench [--bundles N] [--topics N] [--rounds N]`` fills an
:class:`~lbd.broker.ownership.OwnershipView` by applying a synthetic ``WatchOwnership`` snapshot
directly (every bundle of ``--namespaces`` namespaces Owned, spread over 10 brokers; no server),
then measures, with the real monotonic clock and its staleness check on every call:

- ``owner_of_topic`` on memo hits: ``topics`` topics looked up ``rounds`` times over;
- ``owner_of_topic`` on misses: topics never seen before (parse, CRC-32, bisect, memoize);
- ``owner(bundle)``;
- live changes taken in (each re-indexes one bundle and voids its namespace's memo), and the
  snapshot itself.

:func:`figures` sets the lookups against their goal: a million per second, in process.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from rich.console import Console

from bench.report import Figure, measurements_table
from lbd.broker.ownership import OwnershipView
from lbd.core.bundles import FULL_UPPER
from lbd.gen.v1 import lbd_pb2

BROKERS = 10
LOOKUPS_GOAL_PER_S = 1_000_000.0
_T = TypeVar("_T")


def run(
    *,
    bundles: int = 1_000,
    topics: int = 10_000,
    rounds: int = 100,
    misses: int = 100_000,
    namespaces: int = 4,
) -> dict[str, float]:
    """Measure the cache; rates in calls per second.

    ``bundles`` Owned bundles split evenly among ``namespaces`` namespaces, ``topics`` topics
    spread over them looked up ``rounds`` times each (memo hits after the first), ``misses``
    lookups of topics seen once.
    """
    names = [f"bench/ns-{n}" for n in range(namespaces)]
    per_namespace = max(1, bundles // namespaces)
    snapshot = [
        lbd_pb2.OwnershipChange(
            bundle=bundle,
            state=lbd_pb2.BUNDLE_STATE_OWNED,
            owner_broker_id=f"broker-{i % BROKERS}",
            version_id=1,
        )
        for i, bundle in enumerate(_bundle_ids(names, per_namespace))
    ]
    # A bound of a day: the check runs on every call as it would, and never refuses mid-run.
    view = OwnershipView(stale_after_s=86_400.0, memo_size=max(topics, 1) * 2)
    start = time.perf_counter()
    view.stream_opened()
    for message in snapshot:
        view.receive(message)
    view.receive(lbd_pb2.OwnershipChange(snapshot_done=True))
    view.receive(lbd_pb2.OwnershipChange(heartbeat=True, vouched_age_ms=0))
    snapshot_s = time.perf_counter() - start

    hot = [f"persistent://{names[i % namespaces]}/topic-{i}" for i in range(topics)]
    owner_of_topic = view.owner_of_topic
    _each(owner_of_topic, hot)  # warm the memo
    hits_s = _timed(lambda: _each(owner_of_topic, hot, rounds))

    cold = [f"persistent://{names[i % namespaces]}/cold-{i}" for i in range(misses)]
    misses_s = _timed(lambda: _each(owner_of_topic, cold))

    bundle_ids = [m.bundle for m in snapshot]
    owner = view.owner
    owner_s = _timed(lambda: _each(owner, bundle_ids, rounds))

    changes = [
        lbd_pb2.OwnershipChange(
            bundle=m.bundle,
            state=lbd_pb2.BUNDLE_STATE_OWNED,
            owner_broker_id=f"broker-{(i + 1) % BROKERS}",
            version_id=2,
        )
        for i, m in enumerate(snapshot)
    ]
    changes_s = _timed(lambda: _each(view.receive, changes))
    return {
        "owner_of_topic_memo_hit_per_s": rounds * topics / hits_s,
        "owner_of_topic_miss_per_s": misses / misses_s,
        "owner_bundle_per_s": rounds * len(bundle_ids) / owner_s,
        "changes_applied_per_s": len(changes) / changes_s,
        "snapshot_bundles_per_s": len(snapshot) / snapshot_s,
        "bundles": float(len(snapshot)),
        "topics": float(topics),
    }


def figures(result: dict[str, float]) -> list[Figure]:
    """A topic's owner from the memo and a bundle's owner, each against the goal.

    A miss is left out: a topic misses once, and again only after a change in its namespace.
    """
    return [
        Figure(name, result[key], "per s", LOOKUPS_GOAL_PER_S, "goal", ">= 1")
        for name, key in (
            ("ownership cache: owner of a topic (memo hit)", "owner_of_topic_memo_hit_per_s"),
            ("ownership cache: owner of a bundle", "owner_bundle_per_s"),
        )
    ]


def _bundle_ids(namespaces: Sequence[str], per_namespace: int) -> list[str]:
    step = (FULL_UPPER + 1) // per_namespace
    bounds = [i * step for i in range(per_namespace)] + [FULL_UPPER]
    return [
        f"{ns}/0x{lo:08x}_0x{hi:08x}" for ns in namespaces for lo, hi in itertools.pairwise(bounds)
    ]


def _each(call: Callable[[_T], object], items: Sequence[_T], rounds: int = 1) -> None:
    """Call ``call`` on every item, ``rounds`` times over."""
    for _ in range(rounds):
        for item in items:
            call(item)


def _timed(work: Callable[[], None]) -> float:
    """Seconds ``work`` took."""
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def main() -> None:
    """Run :func:`run` with the command-line arguments and print a table."""
    parser = argparse.ArgumentParser(prog="python -m bench.broker_cache_bench", description=__doc__)
    parser.add_argument("--bundles", type=int, default=1_000)
    parser.add_argument("--topics", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--misses", type=int, default=100_000)
    parser.add_argument("--namespaces", type=int, default=4)
    args = parser.parse_args()
    console = Console()
    with console.status("benchmarking the broker-side ownership cache..."):
        result = run(
            bundles=args.bundles,
            topics=args.topics,
            rounds=args.rounds,
            misses=args.misses,
            namespaces=args.namespaces,
        )
    console.print(measurements_table("broker-side ownership cache (calls per second)", result))


if __name__ == "__main__":
    main()
