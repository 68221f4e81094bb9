"""Test helpers of the leader-duty tests: waiting under a manual clock, and the leader's
schedulers built on the sidecars of the shared harness (by composition: the harness is not ours).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence

from harness import Harness, Sidecar

from lbd.adapters.clock import ManualClock
from lbd.adapters.memory.loadstore import MemoryLoadStore, MemoryLoadTopic
from lbd.config.schema import SheddingSettings
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BundleLoad, TopBundlesLoadData
from lbd.metrics import Metrics
from lbd.services.shedding import UnloadScheduler


async def settle(clock: ManualClock, until: Callable[[], bool], seconds: float = 10.0) -> None:
    """Advance ``clock`` in small steps until ``until()`` holds; fail after ``seconds``."""
    waited = 0.0
    while not until():
        assert waited < seconds, f"condition not reached within {seconds}s of clock time"
        await clock.run_for(0.1)
        waited += 0.1


async def turns(until: Callable[[], bool], limit: int = 1000) -> None:
    """Let other tasks run (no clock time passes) until ``until()`` holds; fail after ``limit``
    loop turns."""
    for _ in range(limit):
        if until():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"condition not reached within {limit} loop turns")


async def started_store(topic: MemoryLoadTopic, clock: ManualClock) -> MemoryLoadStore:
    """A load store reading ``topic`` from now on."""
    store = MemoryLoadStore(topic, clock)
    await store.start()
    return store


async def unload_scheduler(
    h: Harness, sidecar: Sidecar, settings: SheddingSettings, metrics: Metrics | None = None
) -> UnloadScheduler:
    """The unload scheduler of ``sidecar`` (as the leader would run it) on ``h``'s load topics."""
    return UnloadScheduler(
        sidecar.proposer,
        sidecar.follower,
        sidecar.registry,
        await started_store(h.broker_load, h.clock),
        await started_store(h.top_bundles, h.clock),
        h.clock,
        settings,
        metrics=metrics,
        rng=random.Random(1),
    )


async def publish_load(
    h: Harness, broker: BrokerId, load: float, bundles: Sequence[BundleId], bytes_per_bundle: float
) -> None:
    """Publish ``broker``'s load data (``load``) and its top bundles, as its reporter would."""
    data = BrokerLoadData(
        broker,
        weighted_max_ema=load,
        msg_throughput_ema=bytes_per_bundle * len(bundles),
        updated_at_ms=h.clock.now_ms(),
    )
    tops = TopBundlesLoadData(
        broker, tuple(BundleLoad(b, msg_throughput_in=bytes_per_bundle) for b in bundles)
    )
    await MemoryLoadStore(h.broker_load, h.clock).publish(broker, data.to_json())
    await MemoryLoadStore(h.top_bundles, h.clock).publish(broker, tops.to_json())
