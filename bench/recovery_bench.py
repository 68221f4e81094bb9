"""Orphans owned again: a broker with N bundles is killed, until every bundle is Owned elsewhere.

``python -m bench.recovery_bench [--bundles N]`` starts a 3-broker dev cluster of its own (lease
TTL 3 s, orphan cleanup grace 1.5 s, hand-over wait 4.5 s: lbd's defaults), cordons two brokers
so that N bundles of a namespace are assigned to the third, uncordons them (each then gets one
more bundle of the namespace), kills the third's sidecar and broker with SIGKILL (a
non-leader), and reads the state channel itself (a Pulsar reader of the topic, as every sidecar
follows it), timing each phase of the repair from the kill:

- the first and last announcement (``Releasing`` from the dead broker): the cleanup grace ends;
- the first and last hand-over (``Assigning`` to a live broker): the hand-over wait ends;
- the last bundle Owned by a live broker.

The protocol fixes the waits (lease TTL, then the grace, then the hand-over wait after each
announcement); what the repair itself costs is the spread of each phase and the time from the
first hand-over to the last bundle Owned, which :func:`figures` sets against its goal: ten
thousand orphans Owned again within 5 s (docs/performance.md, "The figures of `make bench`").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from rich.console import Console

from bench.report import Figure, cuts, drain, lookup_many_owned, measurements_table
from lbd.adapters.pulsar_channel import PulsarChannelLog
from lbd.adapters.pulsar_client import PulsarConnection
from lbd.config import PulsarSettings
from lbd.core.bundles import Bundle, NamespaceBundles
from lbd.core.names import NamespaceName
from lbd.core.state import ServiceUnitState, decode_value
from lbd.ctl.client import SidecarClient
from lbd.devcluster.cluster import DevCluster, DevClusterSpec, down, up
from lbd.gen.v1 import lbd_pb2_grpc
from lbd.workload.traffic import Workload, WorkloadSpec

NAMESPACE = "bench/recovery"
TIMEOUT_S = 300.0
ASSIGN_CONCURRENCY = 4
ASSIGN_PER_CALL = 256
REPAIR_GOAL_S = 5.0


@dataclass(slots=True)
class Timeline:
    """Seconds after the kill at which each phase began and ended (None: not seen)."""

    first_announced: float | None = None
    last_announced: float | None = None
    first_handover: float | None = None
    last_handover: float | None = None
    all_owned: float | None = None
    settle_s: list[float] = field(default_factory=list)
    """Each bundle's hand-over to its Owned, in seconds (the destination's Own round trip)."""


def run(*, bundles: int = 10_000, defaults: bool = False) -> dict[str, float]:
    """Start a dev cluster, measure one broker's death with ``bundles`` bundles, stop it.
    ``defaults``: the sidecars keep every default setting, not the dev cluster's."""
    with tempfile.TemporaryDirectory(prefix="lbd-bench-recovery-") as tmp:
        state_dir = Path(tmp) / "dev"
        # One broker takes every bundle: the simulated brokers' topics would pass the default
        # max topics per broker (50,000) before ten thousand bundles.
        base = DevClusterSpec(brokers=3, sim_brokers=True)
        if defaults:
            base = dataclasses.replace(base, settings={})
        spec = base.with_overrides(["assignment.max_topics_per_broker=10000000"])
        cluster = up(state_dir, spec)
        try:
            return _measure(cluster, bundles)
        finally:
            down(state_dir)


def _measure(cluster: DevCluster, bundles: int) -> dict[str, float]:
    first = cluster.nodes[0]
    with SidecarClient(first.grpc_addr, timeout_s=60) as client:
        leader = client.leader().broker_id
        victim = next(n for n in cluster.nodes if n.broker_id != leader)
        others = [n.broker_id for n in cluster.nodes if n is not victim]
        for broker in others:
            client.cordon(broker, "bench: every bundle goes to the victim")
        # One more bundle per survivor, assigned to it: its simulated broker builds the
        # namespace's pool of topic names (0.1 s for 10,000 bundles) for that bundle, before
        # the kill rather than on the first orphan it takes.
        client.create_namespace(NAMESPACE, bundles + len(others))
        layout = NamespaceBundles.default(NamespaceName.parse(NAMESPACE), bundles + len(others))
        every = layout.bundles()
        orphans, warm = every[:bundles], every[bundles:]
        started = time.monotonic()
        _assign_all(first.grpc_addr, orphans)
        assign_s = time.monotonic() - started
        for broker, bundle in zip(others, warm, strict=True):
            client.uncordon(broker)
            client.assign(str(bundle.id), broker)
    timeline = Timeline()
    ready = threading.Event()
    killed_at: list[float] = []
    watcher = threading.Thread(
        target=lambda: asyncio.run(
            _watch(cluster.pulsar_url, victim.broker_id, bundles, timeline, ready, killed_at)
        ),
        daemon=True,
    )
    watcher.start()
    if not ready.wait(60):
        raise TimeoutError("the ownership watch did not start")
    killed_at.append(time.monotonic())
    os.kill(victim.sidecar.pid, signal.SIGKILL)
    os.kill(victim.broker.pid, signal.SIGKILL)
    watcher.join(TIMEOUT_S)
    if timeline.all_owned is None:
        raise TimeoutError(f"the orphans were not all Owned again within {TIMEOUT_S:g}s")
    result = {
        "bundles": float(bundles),
        "setup: bundles assigned per second": bundles / assign_s,
    }
    for name, value in (
        ("first announcement (s after kill)", timeline.first_announced),
        ("last announcement (s after kill)", timeline.last_announced),
        ("first hand-over (s after kill)", timeline.first_handover),
        ("last hand-over (s after kill)", timeline.last_handover),
        ("all Owned again (s after kill)", timeline.all_owned),
    ):
        if value is not None:
            result[name] = value
    if timeline.first_handover is not None:
        result["first hand-over to all Owned (s)"] = timeline.all_owned - timeline.first_handover
    if timeline.first_announced is not None and timeline.last_announced is not None:
        result["announcement spread (s)"] = timeline.last_announced - timeline.first_announced
    if len(timeline.settle_s) >= 2:
        p50, p99 = cuts([s * 1000 for s in timeline.settle_s])
        result["hand-over to Owned, p50 (ms)"] = p50
        result["hand-over to Owned, p99 (ms)"] = p99
    return result


def figures(result: dict[str, float]) -> list[Figure]:
    """The repair's own time, first hand-over to all Owned, against its goal (none if unseen)."""
    repair_s = result.get("first hand-over to all Owned (s)")
    if repair_s is None:
        return []
    name = f"{result['bundles']:,.0f} orphans: first hand-over to all Owned"
    return [Figure(name, repair_s, "s", REPAIR_GOAL_S, "goal", "<= 1")]


def _assign_all(addr: str, bundles: list[Bundle]) -> None:
    """Have ``bundles`` assigned: LookupMany calls of ``ASSIGN_PER_CALL`` topics, one per
    bundle, ``ASSIGN_CONCURRENCY`` calls in flight."""
    workload = Workload(WorkloadSpec(topics_per_bundle=1))
    topics = [workload.topics(b.id)[0] for b in bundles]
    calls = [topics[i : i + ASSIGN_PER_CALL] for i in range(0, len(topics), ASSIGN_PER_CALL)]

    async def assign_all() -> None:
        async with grpc.aio.insecure_channel(addr) as channel:
            stub = lbd_pb2_grpc.LoadBalancerStub(channel)

            await drain(calls, lambda chunk: lookup_many_owned(stub, chunk), ASSIGN_CONCURRENCY)

    asyncio.run(assign_all())


async def _watch(
    pulsar_url: str,
    victim: str,
    bundles: int,
    timeline: Timeline,
    ready: threading.Event,
    killed_at: list[float],
) -> None:
    """Follow the state channel itself, from its end before the kill: every sidecar applies the
    same messages in the same order, and a reader of the topic costs no sidecar anything (a
    ``WatchOwnership`` stream of 30,000 changes took a fifth of a core from the sidecar serving
    it and a third of one in this process, on the two cores the whole cluster shares)."""
    connection = PulsarConnection(pulsar_url)
    log = PulsarChannelLog(connection, PulsarSettings().state_channel_topic)
    prefix = NAMESPACE + "/"
    owned_elsewhere: set[str] = set()
    announced: set[str] = set()
    handed: dict[str, float] = {}
    try:
        end = None
        async for message in log.catch_up(None):
            end = message.position
        ready.set()
        deadline = time.monotonic() + TIMEOUT_S
        async with contextlib.aclosing(log.follow(end)) as messages:
            async for message in messages:
                if time.monotonic() > deadline:
                    return
                if not killed_at or not message.key.startswith(prefix):
                    continue
                value = decode_value(message.value)
                if value is None:
                    continue
                at = time.monotonic() - killed_at[0]
                bundle, state, owner = message.key, value.state, value.dst_broker
                if state is ServiceUnitState.Releasing and value.source_broker == victim:
                    announced.add(bundle)
                    timeline.first_announced = timeline.first_announced or at
                    if len(announced) == bundles:
                        timeline.last_announced = at
                elif state is ServiceUnitState.Assigning and owner != victim:
                    handed.setdefault(bundle, at)
                    timeline.first_handover = timeline.first_handover or at
                    if len(handed) == bundles:
                        timeline.last_handover = at
                elif (
                    state is ServiceUnitState.Owned
                    and owner != victim
                    and bundle not in owned_elsewhere  # a position may be delivered again
                ):
                    owned_elsewhere.add(bundle)
                    if bundle in handed:
                        timeline.settle_s.append(at - handed[bundle])
                    if len(owned_elsewhere) == bundles:
                        timeline.all_owned = at
                        return
    finally:
        await log.close()
        await connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery_bench", description=__doc__)
    parser.add_argument("--bundles", type=int, default=10_000)
    args = parser.parse_args()
    console = Console()
    with console.status(f"recovery: {args.bundles:,} orphans on a dev cluster..."):
        result = run(bundles=args.bundles)
    console.print(measurements_table("orphans owned again after kill -9", result))


if __name__ == "__main__":
    main()
