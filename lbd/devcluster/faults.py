"""Outages of a running dev cluster's servers, measured the way an operator would judge them.

:func:`run_outage` takes etcd or pulsar-lite away for a while (paused with SIGSTOP, as a frozen
VM, or killed with SIGKILL and started again on its data, as a crash and a restart), keeps
asking every sidecar for owned bundles meanwhile, brings the server back, and reports:

- how many intervals two brokers served one bundle at once, and how many bundles ended up not
  Owned by a registered broker (the brokers' event logs, :mod:`lbd.devcluster.serving`);
- how many serving intervals ended during the outage and its aftermath (a bundle closed), and how
  many bundles changed owner;
- the recovery time: from the server's return until every sidecar again lists every broker,
  names a leader and assigns a never-owned bundle;
- how lookups fared meanwhile: owned ones must keep answering, ones that need an assignment must
  fail fast.

The chaos tests assert on the report; the outage benchmark prints it. A server started again by
:func:`respawn` is a child of the caller, not of the dev cluster's supervisor: the caller stops
it (:meth:`Respawned.stop`) after ``lbd dev down``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import grpc

from lbd.ctl.client import RpcFailure, SidecarClient
from lbd.devcluster.cluster import DevCluster, ProcessRecord
from lbd.devcluster.servers import die_with_parent_prefix, wait_stopped
from lbd.devcluster.serving import dual_serving, read_events, serving_intervals
from lbd.gen.v1 import lbd_pb2

Target = Literal["etcd", "pulsar"]
How = Literal["pause", "kill"]

PROBE_INTERVAL_S = 1.0
"""How often every sidecar is asked for an owned bundle during the outage."""
RECOVERY_POLL_S = 0.05
RECOVERY_TIMEOUT_S = 60.0
LOOKUP_TIMEOUT_S = 10.0


@dataclass
class Respawned:
    """A server process started again by :func:`respawn` (the caller's child)."""

    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        """Kill it and reap it. Idempotent."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@dataclass(frozen=True, slots=True)
class OutageReport:
    """What one outage did to the cluster (see the module docstring)."""

    scenario: str
    outage_s: float
    dual_served: tuple[str, ...]
    lost_bundles: tuple[str, ...]
    closed: int
    """Serving intervals that ended between the fault and the end of the settle time."""
    moved: int
    """Bundles Owned before whose owner changed by the end."""
    recovery_s: float
    owned_lookups: int
    owned_lookup_failures: int
    assignment_fail_s: float | None
    """How long the slowest lookup that needed an assignment took to fail during the outage
    (None: none was tried, or one succeeded)."""
    notes: tuple[str, ...] = field(default=())


@dataclass(frozen=True, slots=True)
class Probes:
    """Topics to look up: ``owned`` ones (one per sidecar is asked each round) and ``fresh``
    ones in bundles nobody owns yet (each used once)."""

    owned: tuple[str, ...]
    fresh: Iterator[str]


def process_record(cluster: DevCluster, target: Target) -> ProcessRecord:
    """The record of the dev cluster's etcd or pulsar-lite."""
    return cluster.etcd if target == "etcd" else cluster.pulsar


def freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it stopped."""
    os.kill(pid, signal.SIGSTOP)
    if not wait_stopped(pid):
        raise RuntimeError(f"process {pid} did not stop after SIGSTOP")


def kill(pid: int, timeout_s: float = 5.0) -> None:
    """SIGKILL ``pid`` and wait until it is gone (or a zombie its parent has not reaped)."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    stat = Path(f"/proc/{pid}/stat")
    while time.monotonic() < deadline:
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.01)
    raise RuntimeError(f"process {pid} still runs {timeout_s:g}s after SIGKILL")


@dataclass(frozen=True, slots=True)
class Launch:
    """How a running process was started: enough to start it again the same way."""

    argv: tuple[str, ...]
    cwd: str
    env: dict[str, str]

    @classmethod
    def of(cls, pid: int) -> Launch:
        """Read ``pid``'s command line, working directory and environment from /proc."""
        proc = Path(f"/proc/{pid}")
        argv = tuple(a.decode() for a in proc.joinpath("cmdline").read_bytes().split(b"\0") if a)
        env = dict(
            entry.decode().partition("=")[::2]
            for entry in proc.joinpath("environ").read_bytes().split(b"\0")
            if b"=" in entry
        )
        return cls(argv, os.readlink(proc / "cwd"), env)


def respawn(launch: Launch, log: Path, wait_up: Callable[[], bool], timeout_s: float) -> Respawned:
    """Start ``launch`` again (same ports, same data), logging to ``log``; wait until
    ``wait_up()`` holds."""
    with log.open("ab") as out:
        process = subprocess.Popen(
            [*die_with_parent_prefix(), *launch.argv],
            cwd=launch.cwd,
            env=launch.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    respawned = Respawned(process)
    deadline = time.monotonic() + timeout_s
    while not wait_up():
        if (code := process.poll()) is not None:
            raise RuntimeError(f"{launch.argv[0]} exited with code {code} on restart (see {log})")
        if time.monotonic() > deadline:
            respawned.stop()
            raise RuntimeError(f"{launch.argv[0]} did not come back within {timeout_s:g}s")
        time.sleep(0.02)
    return respawned


def _port_open(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition("//")[2].rpartition(":")
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=0.2):
        return True
    return False


class OutageRun:
    """One outage of one server of ``cluster``; :meth:`run` does it and returns the report."""

    def __init__(
        self,
        cluster: DevCluster,
        namespace: str,
        probes: Probes,
        *,
        settle_s: float,
        respawned: list[Respawned],
    ) -> None:
        """``settle_s``: how long after recovery to keep watching for closes and moves.
        Processes started again are appended to ``respawned`` for the caller to stop."""
        self._cluster = cluster
        self._namespace = namespace
        self._probes = probes
        self._settle_s = settle_s
        self._respawned = respawned
        self._clients = {
            node.broker_id: SidecarClient(
                node.grpc_addr, credentials=cluster.credentials(), timeout_s=LOOKUP_TIMEOUT_S
            )
            for node in cluster.nodes
        }

    def close(self) -> None:
        """Close the clients."""
        for client in self._clients.values():
            client.close()

    def run(self, target: Target, how: How, outage_s: float) -> OutageReport:
        """Take ``target`` away ``how`` for ``outage_s`` seconds, bring it back, measure."""
        witness = next(iter(self._clients.values()))
        before = self._owners(witness)
        record = process_record(self._cluster, target)
        launch = Launch.of(record.pid) if how == "kill" else None
        started_ns = time.monotonic_ns()
        if how == "pause":
            freeze(record.pid)
        else:
            kill(record.pid)
        owned, failed, assignment_fail_s = self._during(outage_s)
        if launch is None:
            os.kill(record.pid, signal.SIGCONT)
        else:
            endpoint = self._cluster.etcd_endpoint if target == "etcd" else self._cluster.pulsar_url
            log = Path(record.log).with_suffix(".restarted.log")
            self._respawned.append(respawn(launch, log, lambda: _port_open(endpoint), 30.0))
        back = time.monotonic()
        recovery_s = self._recover() - back
        time.sleep(self._settle_s)
        after = self._owners(witness)
        live = {b.info.broker_id for b in witness.brokers().brokers}
        events = read_events(self._cluster)
        # An interval still open is cut at its broker's last lease end, which lies ahead of
        # now: only an end before now is a bundle that stopped being served.
        read_ns = time.monotonic_ns()
        intervals = serving_intervals(events, {})
        ended = [i for i in intervals if started_ns <= i.end < read_ns]
        return OutageReport(
            scenario=f"{target} {'paused' if how == 'pause' else 'killed and restarted'}",
            outage_s=outage_s,
            dual_served=tuple(dual_serving(intervals)),
            lost_bundles=tuple(sorted(b for b in before if after.get(b) not in live)),
            closed=len(ended),
            moved=sum(1 for b, owner in before.items() if after.get(b) != owner),
            recovery_s=recovery_s,
            owned_lookups=owned,
            owned_lookup_failures=failed,
            assignment_fail_s=assignment_fail_s,
        )

    def _during(self, outage_s: float) -> tuple[int, int, float | None]:
        """Ask every sidecar for an owned bundle every second, and once for a bundle that
        needs an assignment; (owned lookups, failures, slowest failed assignment)."""
        deadline = time.monotonic() + outage_s
        owned = failed = 0
        slowest: float | None = None
        tried_fresh = False
        while time.monotonic() < deadline:
            round_started = time.monotonic()
            for n, client in enumerate(self._clients.values()):
                topic = self._probes.owned[n % len(self._probes.owned)]
                owned += 1
                try:
                    client.lookup(topic)
                except RpcFailure:
                    failed += 1
            if not tried_fresh and time.monotonic() - (deadline - outage_s) > 2.0:
                tried_fresh = True
                client = next(iter(self._clients.values()))
                asked = time.monotonic()
                try:
                    client.lookup(next(self._probes.fresh))
                except RpcFailure:
                    slowest = time.monotonic() - asked
            time.sleep(max(0.0, PROBE_INTERVAL_S - (time.monotonic() - round_started)))
        return owned, failed, slowest

    def _recover(self) -> float:
        """When every sidecar lists every broker, names a leader and assigns a fresh bundle."""
        expected = {node.broker_id for node in self._cluster.nodes}
        pending = dict(self._clients)
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        fresh: dict[str, str] = {}
        while pending:
            for broker, client in list(pending.items()):
                if broker not in fresh:
                    fresh[broker] = next(self._probes.fresh)
                topic = fresh[broker]
                with contextlib.suppress(RpcFailure, grpc.RpcError):
                    listed = {b.info.broker_id for b in client.brokers().brokers}
                    if listed == expected and client.leader().broker_id:
                        client.lookup(topic)
                        del pending[broker]
            if pending and time.monotonic() > deadline:
                raise AssertionError(
                    f"not recovered within {RECOVERY_TIMEOUT_S:g}s: {sorted(pending)}"
                )
            if pending:
                time.sleep(RECOVERY_POLL_S)
        return time.monotonic()

    def _owners(self, client: SidecarClient) -> dict[str, str]:
        return {
            b.bundle: b.owner_broker_id
            for b in client.bundles(self._namespace).bundles
            if b.state == lbd_pb2.BUNDLE_STATE_OWNED
        }
