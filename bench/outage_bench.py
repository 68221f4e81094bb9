"""Benchmark of metadata and channel outages on a dev cluster: what closed, what moved, and how
long the cluster took to come back.

``python -m bench.outage_bench [--etcd-outage S] [--pulsar-outage S]`` starts a 3-broker dev
cluster of its own (``lbd dev up``, the dev cluster's short timings), owns a few bundles, and
runs :class:`lbd.devcluster.faults.OutageRun` for etcd paused, etcd killed and restarted on its
data, and pulsar-lite killed and restarted. One row per scenario: dual-served intervals, bundles
lost, serving intervals that ended (bundles closed) during the outage and its aftermath, bundles
that moved, the recovery time after the server's return (every sidecar lists every broker, names
a leader and assigns a never-owned bundle), owned lookups that failed during the outage, and how
long a lookup that needed an assignment took to fail meanwhile.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lbd.core.bundles import NamespaceBundles
from lbd.core.names import NamespaceName
from lbd.ctl.client import SidecarClient
from lbd.devcluster.cluster import DevClusterSpec, dev_settings, down, up
from lbd.devcluster.faults import OutageReport, OutageRun, Probes, Respawned
from lbd.workload.traffic import Workload, WorkloadSpec

NAMESPACE = "bench/outages"
OWNED = 12
BUNDLES = 256


def run(*, etcd_outage_s: float = 60.0, pulsar_outage_s: float = 20.0) -> list[OutageReport]:
    """Start a dev cluster, take etcd and pulsar-lite away in turn, stop it; one report each."""
    respawned: list[Respawned] = []
    with tempfile.TemporaryDirectory(prefix="lbd-bench-") as tmp:
        state_dir = Path(tmp) / "dev"
        cluster = up(state_dir, DevClusterSpec(brokers=3))
        try:
            layout = NamespaceBundles.default(NamespaceName.parse(NAMESPACE), BUNDLES).bundles()
            topics = Workload(WorkloadSpec(topics_per_bundle=1))
            owned = [topics.topics(b.id)[0] for b in layout[:OWNED]]
            clients = [SidecarClient(n.grpc_addr, timeout_s=30) for n in cluster.nodes]
            try:
                clients[0].create_namespace(NAMESPACE, BUNDLES)
                for n, topic in enumerate(owned):
                    clients[n % len(clients)].lookup(topic)
            finally:
                for client in clients:
                    client.close()
            fresh = (topics.topics(b.id)[0] for b in itertools.islice(layout, OWNED, None))
            settle_s = dev_settings().monitor.orphan_cleanup_grace_s + 3.0
            outages = OutageRun(
                cluster,
                NAMESPACE,
                Probes(tuple(owned), fresh),
                settle_s=settle_s,
                respawned=respawned,
            )
            try:
                return [
                    outages.run("etcd", "pause", etcd_outage_s),
                    outages.run("etcd", "kill", etcd_outage_s),
                    outages.run("pulsar", "kill", pulsar_outage_s),
                ]
            finally:
                outages.close()
        finally:
            down(state_dir)
            for process in respawned:
                process.stop()


def reports_table(reports: list[OutageReport]) -> Table:
    """One row per scenario."""
    table = Table(title="outages on a 3-broker dev cluster")
    columns = (
        "scenario",
        "outage s",
        "dual-served intervals",
        "lost bundles",
        "bundles closed",
        "moved",
        "recovery s",
        "owned lookups failed",
        "assignment fails in s",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "scenario" else "right")
    for r in reports:
        table.add_row(
            r.scenario,
            f"{r.outage_s:g}",
            str(len(r.dual_served)),
            str(len(r.lost_bundles)),
            str(r.closed),
            str(r.moved),
            f"{r.recovery_s:.2f}",
            f"{r.owned_lookup_failures} of {r.owned_lookups}",
            "-" if r.assignment_fail_s is None else f"{r.assignment_fail_s:.2f}",
        )
    return table


def main() -> None:
    """Run :func:`run` with the command-line arguments and print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.outage_bench", description=__doc__)
    parser.add_argument("--etcd-outage", type=float, default=60.0, metavar="S")
    parser.add_argument("--pulsar-outage", type=float, default=20.0, metavar="S")
    args = parser.parse_args()
    console = Console()
    with console.status("outages on a dev cluster..."):
        reports = run(etcd_outage_s=args.etcd_outage, pulsar_outage_s=args.pulsar_outage)
    console.print(reports_table(reports))


if __name__ == "__main__":
    main()
