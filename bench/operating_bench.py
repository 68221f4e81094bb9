"""Benchmark of operating a cluster: per-transfer unavailability, and the drain of 200 bundles.

``python -m bench.operating_bench [--transfers N] [--drain N]`` starts a dev cluster of its own
(``lbd dev up --traffic``: the simulated brokers report load; the dev cluster's short timings;
the default execution governor) and prints one table. While it measures, a thread keeps owned
Lookups flowing through every sidecar (the traffic a broker's clients make). Measured:

- per-move unavailability of ``transfers`` admin transfers, one after another, each bundle to the
  next broker: the time no broker served the bundle, from the source's Release acknowledgement
  to the destination's Own acknowledgement, as the leader's operations record it (p50, p99, max);
  the end-to-end Transfer call time beside it;
- a drain of a broker owning ``drain`` bundles under the default governor: the time from the
  Drain call until its operation succeeded, the moves per second, and the most moves the
  governor had in flight at once as the operation's moves show it.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console

from bench.report import measurements_table
from lbd.core.bundles import NamespaceBundles
from lbd.core.names import NamespaceName
from lbd.ctl.client import RpcFailure, SidecarClient
from lbd.devcluster.cluster import DEV_SETTINGS, DevCluster, DevClusterSpec, down, up
from lbd.gen.v1 import lbd_pb2
from lbd.workload.traffic import Workload, WorkloadSpec

TRANSFERS_NAMESPACE = "bench/transfers"
DRAIN_NAMESPACE = "bench/drain"
DRAIN_TIMEOUT_S = 600.0


def run(*, transfers: int = 60, drain: int = 200) -> dict[str, float]:
    """Start a dev cluster, measure, stop it; times in ms unless named ``_s``."""
    settings = {**DEV_SETTINGS, "shedding.interval_s": "3600", "operations.keep_finished": "1000"}
    with tempfile.TemporaryDirectory(prefix="lbd-bench-") as tmp:
        state_dir = Path(tmp) / "dev"
        cluster = up(state_dir, DevClusterSpec(brokers=3, traffic=True, settings=settings))
        try:
            return _measure(cluster, transfers, drain)
        finally:
            down(state_dir)


def _measure(cluster: DevCluster, transfers: int, drain: int) -> dict[str, float]:
    brokers = [n.broker_id for n in cluster.nodes]
    result: dict[str, float] = {}
    with SidecarClient(cluster.nodes[0].grpc_addr, timeout_s=60) as client:
        topics = _owned(client, TRANSFERS_NAMESPACE, 24, brokers)
        stop = threading.Event()
        lookups = threading.Thread(target=_lookups, args=(cluster, topics, stop), daemon=True)
        lookups.start()
        try:
            result.update(_transfers(client, brokers, transfers))
            result.update(_drain(client, brokers, drain))
        finally:
            stop.set()
            lookups.join(timeout=10)
    return result


def _owned(client: SidecarClient, namespace: str, bundles: int, brokers: list[str]) -> list[str]:
    """Create ``namespace`` and assign its bundles round robin; one topic of each."""
    client.create_namespace(namespace, bundles)
    layout = NamespaceBundles.default(NamespaceName.parse(namespace), bundles).bundles()
    workload = Workload(WorkloadSpec(topics_per_bundle=1))
    for i, bundle in enumerate(layout):
        client.assign(bundle.id, brokers[i % len(brokers)])
    return [workload.topics(b.id)[0] for b in layout]


def _lookups(cluster: DevCluster, topics: list[str], stop: threading.Event) -> None:
    clients = [SidecarClient(n.grpc_addr, timeout_s=10) for n in cluster.nodes]
    try:
        i = 0
        while not stop.is_set():
            # A bundle in flight, or a sidecar busy: the lookup is simply made again later.
            with contextlib.suppress(RpcFailure):
                clients[i % len(clients)].lookup(topics[i % len(topics)])
            i += 1
            time.sleep(0.002)
    finally:
        for c in clients:
            c.close()


def _owners(client: SidecarClient, namespace: str) -> dict[str, str]:
    return {
        b.bundle: b.owner_broker_id
        for b in client.bundles(namespace).bundles
        if b.state == lbd_pb2.BUNDLE_STATE_OWNED
    }


def _transfers(client: SidecarClient, brokers: list[str], count: int) -> dict[str, float]:
    calls_ms: list[float] = []
    before = {op.id for op in client.operations().operations}
    for i in range(count):
        owners = _owners(client, TRANSFERS_NAMESPACE)
        bundle = sorted(owners)[i % len(owners)]
        dst = brokers[(brokers.index(owners[bundle]) + 1) % len(brokers)]
        start = time.perf_counter()
        client.transfer(bundle, dst)
        calls_ms.append(1000 * (time.perf_counter() - start))
    ops = [op for op in client.operations().operations if op.id not in before]
    unavailable = sorted(
        m.unavailable_ms
        for op in ops
        if op.kind == "admin"
        for m in op.moves
        if m.state == lbd_pb2.MOVE_STATE_DONE and m.unavailable_ms >= 0
    )
    if len(unavailable) < count:
        raise RuntimeError(f"only {len(unavailable)} of {count} transfers recorded unavailability")
    cuts = statistics.quantiles(unavailable, n=100, method="inclusive")
    call_cuts = statistics.quantiles(calls_ms, n=100, method="inclusive")
    return {
        "transfers": float(count),
        "unavailable_p50_ms": cuts[49],
        "unavailable_p99_ms": cuts[98],
        "unavailable_max_ms": unavailable[-1],
        "transfer_call_p50_ms": call_cuts[49],
        "transfer_call_p99_ms": call_cuts[98],
    }


def _drain(client: SidecarClient, brokers: list[str], bundles: int) -> dict[str, float]:
    victim = brokers[-1]
    client.create_namespace(DRAIN_NAMESPACE, bundles)
    for bundle in NamespaceBundles.default(NamespaceName.parse(DRAIN_NAMESPACE), bundles).bundles():
        client.assign(bundle.id, victim)
    owned = sum(1 for o in _owners(client, "").values() if o == victim)
    start = time.perf_counter()
    op = client.drain(victim)
    peak = 0
    last = op
    for last in client.watch_operation(op.id, timeout_s=DRAIN_TIMEOUT_S):
        peak = max(peak, sum(1 for m in last.moves if m.state == lbd_pb2.MOVE_STATE_IN_FLIGHT))
    seconds = time.perf_counter() - start
    if last.state != lbd_pb2.OPERATION_STATE_SUCCEEDED:
        raise RuntimeError(f"the drain of {victim} ended {last.state}: {last.error}")
    left = sum(1 for o in _owners(client, "").values() if o == victim)
    client.uncordon(victim)
    return {
        "drain_bundles": float(owned),
        "drain_s": seconds,
        "drain_moves_per_s": last.moves_done / seconds,
        "drain_peak_in_flight": float(peak),
        "drain_left_on_broker": float(left),
    }


def main() -> None:
    """Run once and print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.operating_bench", description=__doc__)
    parser.add_argument("--transfers", type=int, default=60)
    parser.add_argument("--drain", type=int, default=200)
    args = parser.parse_args()
    with Console().status("operating: transfers and a drain on a dev cluster..."):
        result = run(transfers=args.transfers, drain=args.drain)
    Console().print(measurements_table("operating a 3-broker dev cluster", result))


if __name__ == "__main__":
    main()
