"""One bundle split into thousands of children on a dev cluster, against the split's deadline.

``python -m bench.split_bench [--children N] [--state-dir DIR]`` starts a 3-broker dev cluster of
its own, creates a namespace of one bundle, has it Owned (a Lookup of one of its topics), then
calls the admin Split with ``specified_positions_divide`` and ``N - 1`` boundaries spread evenly
over the bundle's hash range. The split protocol: the owner's sidecar proposes ``Splitting`` with
every child named, has its broker Own each child, proposes each child ``Owned``, cuts the
namespace layout and proposes the parent ``Deleted``; the call answers once the parent is no
longer ``Splitting``. Measured from the call, as another sidecar's ``WatchOwnership`` stream
shows it:

- when the call returned;
- when the first child, and then every child, was ``Owned`` (the settle time);
- when the parent was ``Deleted``.

The split's deadline is ``monitor.inflight_timeout_s``: the leader takes a ``Splitting`` older
than that for stuck and either rolls it back (the parent ``Owned`` again) or, once a child has a
value, finishes it as ``Deleted`` whether or not every child was taken (children left without a
value are then assigned afresh by later Lookups). The settle time is reported as a fraction of
it. (The call itself gives up after ``assignment.settle_timeout_s``.)

Limits: ``split.max_bundles_per_namespace`` (128 by default) would refuse the split, so the
cluster runs with it raised to ``N``; a split's children are capped by the core constant
``lbd.core.state.MAX_SPLIT_CHILDREN`` (8,192, not a setting), over which the Split is refused
with INVALID_ARGUMENT and the benchmark fails saying so. The default here is :data:`CHILDREN`
(5,000, the figure of the README). Beyond 64 children the ``Splitting`` value names them by
the widths of their ranges, which keeps it within the channel's 64 KiB. ``--state-dir`` runs the
cluster there and keeps its logs (one per sidecar and simulated broker) for inspection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from rich.console import Console

from bench.report import Figure, figures_table, measurements_table
from lbd.config.schema import MonitorSettings
from lbd.core.bundles import FULL_LOWER, FULL_UPPER, Bundle, BundleRange
from lbd.core.names import NamespaceName
from lbd.ctl.client import SidecarClient
from lbd.devcluster.cluster import DevCluster, DevClusterSpec, down, up
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from lbd.workload.traffic import Workload, WorkloadSpec

NAMESPACE = "bench/split"
CHILDREN = 5_000
"""Children of the split measured by default: the README's figure."""
ALGORITHM = "specified_positions_divide"
DEADLINE_SETTING = "monitor.inflight_timeout_s"
DEADLINE = f"split deadline ({DEADLINE_SETTING}) s"
CALL_TIMEOUT_S = 120.0
"""The Split call's own deadline (the sidecar answers DEADLINE_EXCEEDED well before it)."""
AFTER_CALL_S = 30.0
"""How long the watch may lag the call: the owner proposes the parent Deleted only once every
child is Owned, so a child still not Owned by then was left out (the leader finished the split)."""
NO_REPORT_WAIT_S = 15.0
"""How long the Split is made again while the owner's sidecar has no report with the bundle."""


@dataclass(slots=True)
class Timeline:
    """Seconds after the Split call was made at which each step was seen (None: not seen)."""

    call_returned: float | None = None
    first_child_owned: float | None = None
    all_children_owned: float | None = None
    parent_deleted: float | None = None


def run(*, children: int = CHILDREN, state_dir: Path | None = None) -> dict[str, float]:
    """Start a dev cluster, split one bundle into ``children``, stop it.

    ``state_dir``: where the cluster lives, kept afterwards (None: a temporary directory).
    """
    if children < 2:
        raise ValueError(f"children must be at least 2, got {children}")
    spec = DevClusterSpec(brokers=3, sim_brokers=True).with_overrides(
        [f"split.max_bundles_per_namespace={max(children, 128)}"]
    )
    with _state_dir(state_dir) as where:
        cluster = up(where, spec)
        try:
            return _measure(cluster, children)
        finally:
            down(where)


@contextlib.contextmanager
def _state_dir(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="lbd-bench-split-") as tmp:
        yield Path(tmp) / "dev"


def _measure(cluster: DevCluster, children: int) -> dict[str, float]:
    deadline_s = float(cluster.settings.get(DEADLINE_SETTING, MonitorSettings().inflight_timeout_s))
    namespace = NamespaceName.parse(NAMESPACE)
    parent = Bundle(namespace, BundleRange(FULL_LOWER, FULL_UPPER))
    (topic,) = Workload(WorkloadSpec(topics_per_bundle=1)).topics(parent.id)
    with SidecarClient(cluster.nodes[0].grpc_addr, timeout_s=60) as client:
        client.create_namespace(NAMESPACE, 1)
        owner = client.lookup(topic).owner_broker_id
    split_on = cluster.node(owner).grpc_addr
    watch_on = next(n for n in cluster.nodes if n.broker_id != owner).grpc_addr
    points = evenly_spaced(parent.range, children)
    timeline = asyncio.run(_split_and_watch(split_on, watch_on, parent, points))
    returned, first = timeline.call_returned, timeline.first_child_owned
    settled = timeline.all_children_owned
    deleted = timeline.parent_deleted
    if settled is None or returned is None or first is None or deleted is None:
        raise RuntimeError(f"the split did not finish: {timeline}")
    return {
        "children": float(children),
        "Split call returned s": returned,
        "first child Owned s": first,
        "all children Owned s": settled,
        "parent Deleted s": deleted,
        DEADLINE: deadline_s,
        "all children Owned / split deadline": settled / deadline_s,
    }


def evenly_spaced(whole: BundleRange, children: int) -> list[int]:
    """``children - 1`` split points cutting ``whole`` into ``children`` near-equal ranges."""
    width = whole.hi - whole.lo
    if children > width:
        raise ValueError(f"{whole} cannot be cut into {children} ranges")
    return [whole.lo + width * i // children for i in range(1, children)]


async def _split_and_watch(
    split_on: str, watch_on: str, parent: Bundle, points: list[int]
) -> Timeline:
    """Open the watch, call Split once it has the current values, wait for every child Owned."""
    edges = [parent.range.lo, *points, parent.range.hi]
    expected: set[str] = {
        Bundle(parent.namespace, BundleRange(lo, hi)).id for lo, hi in itertools.pairwise(edges)
    }
    timeline = Timeline()
    watching = _Watch(parent.id, expected, timeline)
    async with (
        grpc.aio.insecure_channel(split_on) as split_channel,
        grpc.aio.insecure_channel(watch_on) as watch_channel,
    ):
        stream = lbd_pb2_grpc.LoadBalancerStub(watch_channel).WatchOwnership(
            lbd_pb2.WatchOwnershipRequest(namespace=NAMESPACE)
        )
        follow = asyncio.create_task(watching.follow(stream))
        try:
            await asyncio.wait_for(watching.ready.wait(), 60)
            admin = lbd_pb2_grpc.AdminStub(split_channel)
            request = lbd_pb2.SplitRequest(bundle=parent.id, algorithm=ALGORITHM, boundaries=points)
            reply, started = await _split(admin, request, watching)
            timeline.call_returned = time.monotonic() - started
            if set(reply.children) != expected:
                raise RuntimeError(
                    f"Split answered {len(reply.children):,} children, not the "
                    f"{len(expected):,} asked for"
                )
            try:
                await asyncio.wait_for(asyncio.shield(follow), AFTER_CALL_S)
            except TimeoutError:
                raise TimeoutError(
                    f"{AFTER_CALL_S:g}s after the call returned: {watching.progress()}"
                ) from None
        finally:
            stream.cancel()
            follow.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await follow
    return timeline


async def _split(
    admin: lbd_pb2_grpc.AdminStub, request: lbd_pb2.SplitRequest, watching: _Watch
) -> tuple[lbd_pb2.SplitResponse, float]:
    """The Split call's answer, and when the call that got it was made (``watching.started``).

    Made again while the owner's sidecar refuses it for want of topics: until the broker's first
    load report with the bundle in it arrives, the sidecar knows of none in it, and
    specified_positions_divide splits only a bundle of at least 2 topics. Nothing changed then.
    """
    give_up = time.monotonic() + NO_REPORT_WAIT_S
    while True:
        started = watching.started = time.monotonic()
        try:
            reply: lbd_pb2.SplitResponse = await admin.Split(request, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            no_report = e.code() is grpc.StatusCode.INVALID_ARGUMENT and "topics" in (
                e.details() or ""
            )
            if no_report and time.monotonic() < give_up:
                await asyncio.sleep(0.2)
                continue
            raise RuntimeError(
                f"Split failed after {time.monotonic() - started:.1f}s with "
                f"{e.code().name}: {e.details()} ({watching.progress()})"
            ) from None
        return reply, started


@dataclass(slots=True)
class _Watch:
    """Follows ``WatchOwnership``: when each child was Owned and the parent Deleted."""

    parent: str
    children: set[str]
    timeline: Timeline
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    started: float | None = None
    """When the Split call was made (None: not yet; what the stream shows before is ignored)."""
    owned: set[str] = field(default_factory=set)
    parent_state: str = "not seen"

    def progress(self) -> str:
        """What the stream showed so far."""
        return (
            f"the watch saw {len(self.owned):,} of {len(self.children):,} children Owned, "
            f"the parent {self.parent_state}"
        )

    async def follow(self, stream: grpc.aio.UnaryStreamCall) -> None:
        """Until every child is Owned and the parent Deleted."""
        timeline = self.timeline
        async for change in stream:
            if change.snapshot_done:
                self.ready.set()
                continue
            if self.started is None:
                continue
            at = time.monotonic() - self.started
            if change.bundle == self.parent:
                self.parent_state = lbd_pb2.BundleState.Name(change.state)
                if change.state == lbd_pb2.BUNDLE_STATE_DELETED:
                    timeline.parent_deleted = at
            elif change.bundle in self.children and change.state == lbd_pb2.BUNDLE_STATE_OWNED:
                self.owned.add(change.bundle)
                if timeline.first_child_owned is None:
                    timeline.first_child_owned = at
                if len(self.owned) == len(self.children):
                    timeline.all_children_owned = at
            if timeline.all_children_owned is not None and timeline.parent_deleted is not None:
                return


def figures(result: dict[str, float]) -> list[Figure]:
    """The settle time against the split's deadline: well within it is at most half of it."""
    return [
        Figure(
            name=f"split into {result['children']:,.0f} children: all Owned",
            value=result["all children Owned s"],
            unit="s",
            baseline=result[DEADLINE],
            baseline_label="the split deadline",
            goal="<= 0.5",
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.split_bench", description=__doc__)
    parser.add_argument("--children", type=int, default=CHILDREN)
    parser.add_argument(
        "--state-dir", type=Path, help="run the dev cluster there and keep its logs"
    )
    args = parser.parse_args()
    console = Console()
    with console.status(f"split into {args.children:,} children on a dev cluster..."):
        result = run(children=args.children, state_dir=args.state_dir)
    console.print(measurements_table("one bundle split on a 3-broker dev cluster", result))
    console.print(figures_table("a split against its deadline", figures(result)))


if __name__ == "__main__":
    main()
