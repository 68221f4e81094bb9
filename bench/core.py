"""Benchmarks of the pure core: the hot paths every sidecar runs."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from lbd.core.assign import BrokerCandidate, select_broker
from lbd.core.bundles import NamespaceBundles, bundle_id
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BundleLoad
from lbd.core.names import NamespaceName
from lbd.core.settings import AssignmentConfig, SheddingConfig
from lbd.core.shedding import STRATEGIES, LoadSnapshot, ShedderState, Strategy
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, encode_value
from lbd.core.table import ChannelPosition, StateTable


@dataclass(frozen=True, slots=True)
class Result:
    """One benchmark's measurement."""

    name: str
    ops: int
    seconds: float
    unit: str = "op"

    @property
    def rate(self) -> float:
        """Operations per second."""
        return self.ops / self.seconds if self.seconds > 0 else float("inf")


def _timed(name: str, ops: int, fn: Callable[[], object], unit: str = "op") -> Result:
    start = time.perf_counter()
    fn()
    return Result(name, ops, time.perf_counter() - start, unit)


def _channel_log(bundles: int) -> list[tuple[ChannelPosition, BundleId, bytes]]:
    """Assign then own ``bundles`` bundles: two messages each."""
    log = []
    entry = 0
    step = (1 << 32) // bundles
    for i in range(bundles):
        b = bundle_id(NamespaceName("bench", "ns"), i * step, (i + 1) * step)
        broker = BrokerId(f"broker-{i % 10}")
        for version, state in ((1, ServiceUnitState.Assigning), (2, ServiceUnitState.Owned)):
            entry += 1
            value = ServiceUnitStateData(state=state, version_id=version, dst_broker=broker)
            log.append((ChannelPosition(0, entry), b, encode_value(value)))
    return log


def _snapshot(brokers: int, bundles_per_broker: int, rng: random.Random) -> LoadSnapshot:
    loads: dict[BrokerId, BrokerLoadData | None] = {}
    top: dict[BrokerId, tuple[BundleLoad, ...]] = {}
    now = 1_000_000
    for i in range(brokers):
        b = BrokerId(f"broker-{i}")
        skew = rng.random() ** 3
        loads[b] = BrokerLoadData(
            broker=b, weighted_max_ema=skew, msg_throughput_ema=skew * 1e9, updated_at_ms=now
        )
        per = skew * 1e9 / bundles_per_broker
        top[b] = tuple(
            BundleLoad(BundleId(f"t/ns-{i}/0x{j:08x}_0x{j + 1:08x}"), per / 2, per / 2)
            for j in range(bundles_per_broker)
        )
    return LoadSnapshot(brokers=loads, top_bundles=top)


def run(quick: bool = False) -> Iterator[Result]:
    """Yield each benchmark's result as it completes."""
    n = 20_000 if quick else 100_000
    log = _channel_log(n // 2)

    def apply_all() -> StateTable:
        table = StateTable()
        for position, key, value in log:
            table.apply(position, key, value)
        return table

    table = apply_all()
    yield _timed(f"channel table: apply {len(log)} messages", len(log), apply_all, "msg")
    snap = table.snapshot()
    yield _timed(f"table snapshot, {len(table)} bundles", len(table), table.snapshot, "bundle")
    yield _timed(
        f"table from snapshot, {len(table)} bundles",
        len(table),
        lambda: StateTable.from_snapshot(snap),
        "bundle",
    )

    layout = NamespaceBundles.default(NamespaceName("bench", "ns"), 128)
    topics = [f"persistent://bench/ns/topic-{i}" for i in range(n)]
    yield _timed(
        "bundle lookup (128 bundles)",
        len(topics),
        lambda: [layout.find(t) for t in topics],
        "lookup",
    )

    rng = random.Random(1)
    candidates = [BrokerCandidate(BrokerId(f"broker-{i}"), "v", 10) for i in range(100)]
    load = {
        c.broker: BrokerLoadData(broker=c.broker, weighted_max_ema=rng.random(), updated_at_ms=1)
        for c in candidates
    }
    target = BundleId("bench/ns/0x00000000_0x01000000")
    picks = 2_000 if quick else 10_000
    yield _timed(
        "assignment among 100 brokers",
        picks,
        lambda: [
            select_broker(target, candidates, load, AssignmentConfig(), rng) for _ in range(picks)
        ],
        "pick",
    )

    config = SheddingConfig(
        hit_count_threshold=0,
        min_throughput_threshold=0,
        avg_shedder_hit_count_low_threshold=1,
        avg_shedder_hit_count_high_threshold=1,
    )
    for brokers in (100, 1000):
        snapshot = _snapshot(brokers, 20, random.Random(brokers))
        for name, strategy in STRATEGIES.items():
            cycles = 5 if brokers == 1000 else 20
            result, _ = strategy(snapshot, config, ShedderState(), 1_000_000, random.Random(1))

            def shed(s: LoadSnapshot = snapshot, f: Strategy = strategy, n: int = cycles) -> None:
                for _ in range(n):
                    f(s, config, ShedderState(), 1_000_000, random.Random(1))

            label = f"{name}: {brokers} brokers x 20 bundles, {len(result.decisions)} decisions"
            yield _timed(label, cycles, shed, "cycle")
