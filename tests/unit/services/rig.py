"""Test helpers of the leader-duty tests: waiting under a manual clock, a configuration whose
schedulers stay quiet unless a test runs them, and publishing load as a broker's reporter would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from harness import Harness, settle

__all__ = ["settle"]  # defined beside the harness, which uses it too

from lbd.adapters.memory.loadstore import MemoryLoadStore
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BundleLoad, TopBundlesLoadData
from lbd.core.settings import MonitorConfig, SidecarConfig

NEVER_S = 10.0**9
"""An interval no test's clock reaches."""

QUIET = SidecarConfig(
    shedding_interval_s=NEVER_S,
    split_interval_s=NEVER_S,
    monitor=MonitorConfig(interval_s=NEVER_S),
    checkpoint_interval_s=NEVER_S,
    load_report_interval_s=NEVER_S,
)
"""A sidecar whose schedulers (shedder, splits, monitor, checkpoints, load reports) only run
when a test calls them: the tests of one scheduler are not disturbed by the others."""


async def turns(until: Callable[[], bool], limit: int = 1000) -> None:
    """Let other tasks run (no clock time passes) until ``until()`` holds; fail after ``limit``
    loop turns."""
    for _ in range(limit):
        if until():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"condition not reached within {limit} loop turns")


async def let_run(turns: int = 100) -> None:
    """Let every ready task run for ``turns`` loop turns while no clock time passes (for a task
    that must get as far as it can before the test looks)."""
    for _ in range(turns):
        await asyncio.sleep(0)


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
