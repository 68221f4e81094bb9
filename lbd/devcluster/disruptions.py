"""What an operator's actions and a cluster's faults cost real clients, measured end to end.

:class:`ClientHarness` runs real producers and consumers (:mod:`lbd.traffic`) on topics spread
over every broker front of a running dev cluster, then disrupts the cluster one event at a time:
an admin transfer, unload or split of a busy bundle, a drain, a rolling restart, kills and
pauses of broker fronts and sidecars, an etcd pause, a restart of the storage server. Each event
is a window of time; after the last one, the clients' own records give each window's figures
(failed sends, lost and duplicated messages, reordering, the longest send latency and delivery
gap) and the brokers' ``lbd_front_lookups_total`` gives the lookups the clients made in it.

The brokers' event logs are then checked as a whole: no two brokers served a bundle at once, no
broker accepted a message for a bundle it did not serve at that instant, and storage holds every
topic's messages in the order of its owners (:mod:`lbd.devcluster.serving`).

Processes killed or stopped here are started again by the harness (same command, ports and
data) once the cluster recovered; they are children of the caller, stopped by :meth:`close`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

from lbd.core.errors import LbdError
from lbd.ctl.client import RpcFailure, SidecarClient
from lbd.devcluster.cluster import DevCluster, is_alive
from lbd.devcluster.faults import Launch, Respawned, freeze, kill, respawn
from lbd.devcluster.links import Mode, set_links
from lbd.devcluster.processes import client_tls_context, health_serving
from lbd.devcluster.servers import pulsar_handshake
from lbd.devcluster.serving import (
    dual_serving,
    read_events,
    serving_intervals,
    storage_order_violations,
    writes,
    writes_outside_serving,
)
from lbd.gen.v1 import lbd_pb2
from lbd.traffic.clients import ClientTraffic, TrafficSpec
from lbd.traffic.records import TrafficSummary, summarize

_T = TypeVar("_T")

SETTLE_S = 2.0
"""After an event's cluster side is over, how long its window stays open (clients catch up)."""
DRAIN_S = 180.0
"""How long the clients may take, once they stop sending, to receive what was acknowledged (it
ends as soon as they have). A consumer that reconnects after a long outage waits up to the
official client's longest backoff (60 s), and its lookup may be held then retried: one still on
its way back is late, not short of messages."""
RECOVERY_TIMEOUT_S = 90.0
RESTART_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class EventFigures:
    """What one event cost the clients."""

    name: str
    seconds: float
    summary: TrafficSummary
    lookups: int
    """LOOKUP commands clients started in the window (a redirect's follow-up not counted)."""
    affected_topics: int
    note: str = ""
    resume_s: float | None = None
    """Failovers: the longest time from a bundle being Owned again to its producer's next
    receipt."""
    recovery_s: float | None = None
    """Partitions: from the links' return until the cluster was whole again
    (:meth:`ClientHarness.partition`)."""
    moved: int | None = None
    """Partitions: bundles Owned before whose owner changed by the window's end."""
    unreceipted: int = 0
    """Sends the broker fronts wrote to storage and stopped without a receipt for, in the
    window (their ``unreceipted`` events), accepted before a partition's cut: the clients sent
    them again elsewhere, and storage may have stored them before the cut took their receipts,
    so at most this many messages may be stored twice. (Sends accepted after the cut never
    reach storage: the front resets the connection that holds them.)"""

    @property
    def lookups_per_topic(self) -> float:
        return self.lookups / self.affected_topics if self.affected_topics else float(self.lookups)


@dataclass(frozen=True, slots=True)
class SafetyFigures:
    """The brokers' logs judged as a whole (the module docstring)."""

    dual_served: tuple[str, ...]
    writes_outside_serving: tuple[str, ...]
    storage_order: tuple[str, ...]
    writes_checked: int

    def line(self) -> str:
        """One line for a table's caption or a log."""
        return (
            f"brokers' logs: {len(self.dual_served)} dual-served intervals, "
            f"{len(self.writes_outside_serving)} writes by a broker not serving the bundle, "
            f"{len(self.storage_order)} storage-order violations ({self.writes_checked} write "
            "records)"
        )


@dataclass(slots=True)
class _Window:
    name: str
    start_ns: int
    end_ns: int = 0
    lookups: int = 0
    topics: tuple[str, ...] = ()
    note: str = ""
    fault_ns: int | None = None
    cut_ns: int | None = None
    """Partitions: when the links were cut (not for a flaky link, which passes now and then)."""
    victim: str | None = None
    bundles: tuple[str, ...] = ()
    recovery_s: float | None = None
    moved: int | None = None


@dataclass(slots=True)
class _Proc:
    """A process of the cluster as the harness tracks it (its current pid, and how it was
    started, to start it again)."""

    pid: int
    launch: Launch
    log: Path
    respawned: Respawned | None = None


class LookupCounter:
    """Sums ``lbd_front_lookups_total{authoritative="false"}`` over the fronts, across their
    restarts (a restarted front counts from zero again)."""

    def __init__(self, metrics_addrs: dict[str, str]) -> None:
        self._addrs = metrics_addrs
        self._last: dict[str, float] = {}
        self._total = 0.0

    def poll(self) -> int:
        """The clients' lookups counted so far."""
        for broker, addr in self._addrs.items():
            value = _scrape_lookups(addr)
            if value is None:
                continue
            previous = self._last.get(broker, 0.0)
            self._total += value - previous if value >= previous else value
            self._last[broker] = value
        return round(self._total)


def _scrape_lookups(addr: str) -> float | None:
    try:
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return None
    total = 0.0
    for line in text.splitlines():
        if line.startswith("lbd_front_lookups_total{") and 'authoritative="false"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


class ClientHarness:
    """Real clients on a dev cluster, and the events that disrupt it (the module docstring)."""

    def __init__(
        self,
        cluster: DevCluster,
        spec: TrafficSpec,
        *,
        recovery_timeout_s: float = RECOVERY_TIMEOUT_S,
    ) -> None:
        """``recovery_timeout_s``: how long an event may take to recover (a failover with the
        default timings takes minutes)."""
        if not cluster.service_url:
            raise LbdError("the dev cluster runs simulated brokers: no client can connect")
        self.cluster = cluster
        self.traffic = ClientTraffic(spec)
        self.recovery_timeout_s = recovery_timeout_s
        self.windows: list[_Window] = []
        self.killed_at_ns: dict[str, int] = {}
        credentials = cluster.credentials()
        self.admin = {
            n.broker_id: SidecarClient(n.grpc_addr, credentials=credentials, timeout_s=20)
            for n in cluster.nodes
        }
        self.lookups = LookupCounter({n.broker_id: n.broker_metrics_addr for n in cluster.nodes})
        self._procs: dict[str, _Proc] = {}
        self._paused: set[str] = set()
        for n in cluster.nodes:
            self._track(f"front/{n.broker_id}", n.broker.pid, Path(n.broker.log))
            self._track(f"sidecar/{n.broker_id}", n.sidecar.pid, Path(n.sidecar.log))
        self._track("etcd", cluster.etcd.pid, Path(cluster.etcd.log))
        if cluster.storage is not None:
            self._track("storage", cluster.storage.pid, Path(cluster.storage.log))

    def _track(self, name: str, pid: int, log: Path) -> None:
        self._procs[name] = _Proc(pid, Launch.of(pid), log)

    # -- running -------------------------------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the clients; return once every topic delivered a message."""
        self.traffic.start()
        record = self.traffic.record
        _wait(
            "every topic delivering",
            lambda: (
                len({record.producers[d.producer].topic for d in list(record.deliveries)})
                >= len(self.traffic.spec.topics)
                or None
            ),
            timeout_s,
        )

    def finish(self) -> tuple[list[EventFigures], SafetyFigures]:
        """Stop the clients (their sends settle) and judge every window and the logs."""
        self.traffic.stop(drain_s=DRAIN_S)
        record = self.traffic.record
        events = read_events(self.cluster)
        figures = []
        for w in self.windows:
            figures.append(
                EventFigures(
                    name=w.name,
                    seconds=(w.end_ns - w.start_ns) / 1e9,
                    summary=summarize(record, since_ns=w.start_ns, until_ns=w.end_ns),
                    lookups=w.lookups,
                    affected_topics=len(w.topics),
                    note=w.note,
                    resume_s=self._resume_s(w, events) if w.fault_ns is not None else None,
                    recovery_s=w.recovery_s,
                    moved=w.moved,
                    unreceipted=_unreceipted(
                        events, w.start_ns, w.end_ns, w.end_ns if w.cut_ns is None else w.cut_ns
                    ),
                )
            )
        intervals = serving_intervals(events, self.killed_at_ns)
        logged = writes(events)
        safety = SafetyFigures(
            dual_served=tuple(dual_serving(intervals)),
            writes_outside_serving=tuple(writes_outside_serving(intervals, logged)),
            storage_order=tuple(storage_order_violations(logged)),
            writes_checked=len(logged),
        )
        return figures, safety

    def close(self) -> None:
        """Close the admin clients; stop the processes this harness started (after ``lbd dev
        down``, which does not know them)."""
        for client in self.admin.values():
            client.close()
        for proc in self._procs.values():
            if proc.respawned is not None:
                proc.respawned.stop()

    def event(
        self,
        name: str,
        action: Callable[[_Window], None],
        *,
        topics: tuple[str, ...] = (),
        settle_s: float = SETTLE_S,
    ) -> None:
        """Run one event as a window: the action, then ``settle_s`` for the clients."""
        window = _Window(name, time.monotonic_ns(), topics=topics)
        before = self.lookups.poll()
        action(window)
        time.sleep(settle_s)
        window.end_ns = time.monotonic_ns()
        window.lookups = self.lookups.poll() - before
        self.windows.append(window)

    # -- the cluster as the clients use it -----------------------------------------------------

    def client(self, broker: str | None = None) -> SidecarClient:
        """The admin client of ``broker``'s sidecar (None: any live one)."""
        if broker is not None:
            return self.admin[broker]
        for b, client in self.admin.items():
            if self._answers(f"sidecar/{b}"):
                return client
        raise LbdError("no sidecar is alive")

    def placement(self) -> dict[str, tuple[str, str]]:
        """Each traffic topic's bundle and owner, as a live sidecar answers."""
        client = self.client()
        out = {}
        for topic in self.traffic.spec.topics:

            def ask(t: str = topic) -> lbd_pb2.LookupResponse:
                return client.lookup(t, read_only=True)

            answer = _retry(ask)
            out[topic] = (answer.bundle, answer.owner_broker_id)
        return out

    def busy_bundle(self) -> tuple[str, str, tuple[str, ...]]:
        """The bundle with the most traffic topics: its id, its owner and its topics."""
        by_bundle: dict[tuple[str, str], list[str]] = {}
        for topic, key in self.placement().items():
            by_bundle.setdefault(key, []).append(topic)
        (bundle, owner), topics = max(by_bundle.items(), key=lambda kv: (len(kv[1]), kv[0]))
        return bundle, owner, tuple(topics)

    def owners(self) -> dict[str, str]:
        """Bundle -> owner of every Owned bundle, as a live sidecar sees it."""
        return {
            b.bundle: b.owner_broker_id
            for b in _retry(lambda: self.client().bundles("").bundles)
            if b.state == lbd_pb2.BUNDLE_STATE_OWNED
        }

    def topics_of(self, broker: str) -> tuple[str, ...]:
        """The traffic topics ``broker`` owns now."""
        return tuple(t for t, (_, owner) in self.placement().items() if owner == broker)

    # -- events --------------------------------------------------------------------------------

    def transfer(self) -> None:
        """An admin Transfer of the busiest bundle to another broker."""
        bundle, owner, topics = self.busy_bundle()
        dst = self._other(owner)

        def act(w: _Window) -> None:
            _retry(lambda: self.client().transfer(bundle, dst))
            _wait(f"{bundle} Owned by {dst}", lambda: self.owners().get(bundle) == dst or None)
            w.note = f"{owner} -> {dst}"

        self.event("transfer", act, topics=topics, settle_s=1.0)

    def unload(self) -> None:
        """An admin Unload of the busiest bundle (its clients look it up again)."""
        bundle, owner, topics = self.busy_bundle()

        def act(w: _Window) -> None:
            _retry(lambda: self.client().unload(bundle))
            time.sleep(0.5)
            placed = _wait(f"{bundle} Owned again", lambda: self.owners().get(bundle))
            w.note = f"from {owner}, then Owned by {placed}"

        self.event("unload", act, topics=topics)

    def split(self) -> None:
        """An admin Split of the busiest bundle."""
        bundle, owner, topics = self.busy_bundle()

        def act(w: _Window) -> None:
            _retry(lambda: self.client().split(bundle, "range_equally_divide", ()))
            owners = _wait(
                f"{bundle} split", lambda: ((o := self.owners()) and bundle not in o and o) or None
            )
            children = sorted(b for b in owners if b.startswith(bundle.rpartition("/")[0] + "/"))
            w.note = f"{bundle} on {owner} split ({len(children)} bundles in the namespace)"

        self.event("split", act, topics=topics)

    def drain(self) -> None:
        """An admin Drain of the broker with the most traffic topics; then back in service."""
        broker = self.busiest_broker()
        topics = self.topics_of(broker)

        def act(w: _Window) -> None:
            _retry(lambda: self.client().drain(broker))
            _wait(
                f"{broker} drained",
                lambda: broker not in self.owners().values() or None,
                self.recovery_timeout_s,
            )
            _retry(lambda: self.client().uncordon(broker))
            w.note = f"{broker} drained and back in service"

        self.event("drain", act, topics=topics)

    def rolling_restart(self) -> None:
        """SIGTERM to each broker's front, then its sidecar; both started again; the next one
        once they are back."""
        topics = self.traffic.spec.topics

        def act(w: _Window) -> None:
            for broker in self.admin:
                self._terminate(f"front/{broker}")
                self._terminate(f"sidecar/{broker}")
                self._restart(f"sidecar/{broker}")
                self._restart(f"front/{broker}")
                self._wait_registered(broker)
            w.note = f"{len(self.admin)} brokers, one at a time"

        self.event("rolling restart", act, topics=topics)

    def kill_front(self) -> None:
        """kill -9 of the busiest broker front; started again once its bundles moved."""
        self._failover("kill -9 front", "front", pause_s=None)

    def kill_sidecar(self) -> None:
        """kill -9 of the busiest broker's sidecar; started again once its bundles moved."""
        self._failover("kill -9 sidecar", "sidecar", pause_s=None)

    def kill_leader(self) -> None:
        """kill -9 of the leader's sidecar; started again once its bundles moved. A leader that
        owns no traffic topic (the earlier faults moved them all away) is first given the
        busiest bundle, so that the failover has clients to hand over."""
        leader = _retry(lambda: self.client().leader()).broker_id
        if not self.topics_of(leader):
            bundle, _, _ = self.busy_bundle()
            _retry(lambda: self.client().transfer(bundle, leader))
            _wait(
                f"{bundle} Owned by {leader}",
                lambda: self.owners().get(bundle) == leader or None,
            )
            time.sleep(1.0)  # the moved clients settle before the fault's window opens
        self._failover("kill -9 leader sidecar", "sidecar", pause_s=None, victim=leader)

    def pause_front(self, seconds: float = 30.0) -> None:
        """SIGSTOP of the busiest broker front for ``seconds``."""
        self._failover(f"SIGSTOP front {seconds:g} s", "front", pause_s=seconds)

    def pause_sidecar(self, seconds: float = 30.0) -> None:
        """SIGSTOP of the busiest broker's sidecar for ``seconds``."""
        self._failover(f"SIGSTOP sidecar {seconds:g} s", "sidecar", pause_s=seconds)

    def pause_etcd(self, seconds: float = 60.0) -> None:
        """etcd frozen for ``seconds``: nothing may close or move."""

        def act(w: _Window) -> None:
            pid = self._procs["etcd"].pid
            freeze(pid)
            try:
                time.sleep(seconds)
            finally:
                os.kill(pid, signal.SIGCONT)
            self._wait_flowing()
            w.note = f"{len(self.owners())} bundles Owned after"

        self.event(f"etcd paused {seconds:g} s", act, topics=self.traffic.spec.topics)

    def partition(
        self,
        name: str,
        links: Callable[[str], list[str]],
        seconds: float,
        *,
        victim: str | None = None,
        mode: Mode = "cut",
        period_s: float = 1.0,
    ) -> None:
        """Links of one broker's host cut (or made flaky) for ``seconds``, then restored
        (``lbd dev up --links``). ``links(broker)`` names them; the broker is ``victim`` or the
        one with the most traffic topics. The window's note says what moved while the links were
        down, and how long after they returned every bundle was Owned by a registered broker
        again with every sidecar listing every broker (:attr:`EventFigures.recovery_s`)."""
        if not self.cluster.links_control:
            raise LbdError("the dev cluster has no links to cut: start it with --links")
        broker = victim or self.busiest_broker()
        before = self.owners()
        cut = links(broker)
        topics = self.traffic.spec.topics

        def act(w: _Window) -> None:
            w.victim = broker
            set_links(self.cluster.links_control, cut, mode, period_s=period_s)
            if mode == "cut":  # what was accepted before may have been stored, nothing after
                w.cut_ns = time.monotonic_ns()
            try:
                time.sleep(seconds)
            finally:
                set_links(self.cluster.links_control, cut, "up")
            restored = time.monotonic()
            _wait(
                "every bundle Owned by a registered broker, every broker listed everywhere",
                lambda: self._whole(set(before)) or None,
                self.recovery_timeout_s,
            )
            w.recovery_s = time.monotonic() - restored
            self._wait_flowing()
            after = self.owners()
            w.moved = sum(after.get(b) != o for b, o in before.items())
            w.note = f"{', '.join(cut)} {mode} {seconds:g} s; {w.moved} bundles moved"

        self.event(name, act, topics=topics)

    def _whole(self, bundles: set[str]) -> bool:
        """Whether every sidecar lists every broker and every bundle of ``bundles`` (or its
        children) is Owned by one of them."""
        brokers = set(self.admin)
        for b, client in self.admin.items():
            if not self._answers(f"sidecar/{b}"):
                return False
            if {x.info.broker_id for x in client.brokers().brokers} != brokers:
                return False
        owners = self.owners()
        for bundle in bundles:
            held = [o for b, o in owners.items() if _overlaps(b, bundle)]
            if not held or any(o not in brokers for o in held):
                return False
        return True

    def restart_storage(self) -> None:
        """The storage pulsar-lite stopped (SIGTERM) and started again on its data."""

        def act(w: _Window) -> None:
            self._terminate("storage")
            self._restart("storage")
            self._wait_flowing()

        self.event("storage restarted", act, topics=self.traffic.spec.topics)

    # -- internals -----------------------------------------------------------------------------

    def _failover(
        self, name: str, part: str, *, pause_s: float | None, victim: str | None = None
    ) -> None:
        broker = victim or self.busiest_broker()
        placement = self.placement()
        topics = tuple(t for t, (_, owner) in placement.items() if owner == broker)
        bundles = tuple(sorted({b for b, owner in placement.values() if owner == broker}))
        key = f"{part}/{broker}"

        def act(w: _Window) -> None:
            proc = self._procs[key]
            w.victim, w.bundles = broker, bundles
            w.fault_ns = time.monotonic_ns()
            if pause_s is None:
                if part == "front":
                    self.killed_at_ns[broker] = time.monotonic_ns()
                kill(proc.pid)
            else:
                freeze(proc.pid)
                self._paused.add(key)
            started = time.monotonic()
            moved = _wait(
                f"{broker}'s bundles Owned elsewhere",
                lambda: all(self.owners().get(b, broker) != broker for b in bundles) or None,
                self.recovery_timeout_s,
            )
            failover_s = time.monotonic() - started
            if pause_s is not None:
                time.sleep(max(pause_s - (time.monotonic() - started), 0.0))
                os.kill(proc.pid, signal.SIGCONT)
                self._paused.discard(key)
            else:
                self._restart(key)
            self._wait_registered(broker)
            w.note = (
                f"{broker}: its {len(bundles)} bundles Owned elsewhere after {failover_s:.1f} s"
            )
            assert moved

        self.event(name, act, topics=topics)

    def _resume_s(self, w: _Window, events: list[dict[str, object]]) -> float | None:
        """The longest time from one of the victim's bundles being Owned by another broker to
        the next receipt of a producer of its topics."""
        assert w.fault_ns is not None
        owned_at: dict[str, int] = {}
        for e in events:
            t = int(str(e["t_ns"]))
            if e["event"] == "own" and e["broker"] != w.victim and t > w.fault_ns:
                owned_at.setdefault(str(e["bundle"]), t)
        producers = {p.topic: p for p in self.traffic.record.producers}
        lags = []
        for topic in w.topics:
            bundle = _bundle_holding(topic, w.bundles)
            t_owned = min((t for b, t in owned_at.items() if _overlaps(b, bundle)), default=None)
            if t_owned is None:
                continue
            producer = producers[topic]
            acks = [
                s.ended_ns
                for s in list(producer.sends)
                if s.error is None and s.ended_ns is not None and s.ended_ns > t_owned
            ]
            if acks:
                lags.append((min(acks) - t_owned) / 1e9)
        return max(lags) if lags else None

    def busiest_broker(self, *, avoid: str | None = None) -> str:
        """The broker owning the most traffic topics (other than ``avoid``)."""
        counts = {b: 0 for b in self.admin if b != avoid}
        for _, owner in self.placement().values():
            if owner in counts:
                counts[owner] += 1
        return max(sorted(counts), key=lambda b: counts[b])

    def _other(self, broker: str) -> str:
        return next(b for b in sorted(self.admin) if b != broker)

    def _answers(self, key: str) -> bool:
        """Whether the process runs and is not frozen by this harness."""
        return key not in self._paused and self._alive(key)

    def _alive(self, key: str) -> bool:
        from lbd.devcluster.cluster import ProcessRecord

        return is_alive(ProcessRecord(self._procs[key].pid, None, ""))

    def _terminate(self, key: str, timeout_s: float = 60.0) -> None:
        proc = self._procs[key]
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        _wait(f"{key} stopped", lambda: not self._alive(key) or None, timeout_s)

    def _restart(self, key: str) -> None:
        proc = self._procs[key]
        if proc.respawned is not None:
            proc.respawned.stop()
        role, _, broker = key.partition("/")
        node = self.cluster.node(broker) if broker else None
        if role == "sidecar":
            assert node is not None
            credentials = self.cluster.credentials()

            def up() -> bool:
                return health_serving(node.grpc_addr, 0.5, credentials)
        elif role == "front":
            assert node is not None
            port = int(node.service_url.rpartition(":")[2])
            tls = None
            if self.cluster.pulsar_client:
                tls = client_tls_context(self.cluster.pulsar_client)

            def up() -> bool:
                return pulsar_handshake(port, 0.5, tls)
        elif role == "storage":
            port = int(self.cluster.storage_url.rpartition(":")[2])

            def up() -> bool:
                return pulsar_handshake(port, 0.5)
        else:
            raise LbdError(f"the harness does not start {key} again")

        proc.respawned = respawn(proc.launch, proc.log, up, RESTART_TIMEOUT_S)
        proc.pid = proc.respawned.process.pid

    def _wait_registered(self, broker: str) -> None:
        def every_sidecar_lists_it() -> bool | None:
            for b, client in self.admin.items():
                if not self._answers(f"sidecar/{b}"):
                    continue
                if broker not in {x.info.broker_id for x in client.brokers().brokers}:
                    return None
            return True

        _wait(f"{broker} registered everywhere", every_sidecar_lists_it, self.recovery_timeout_s)

    def _wait_flowing(self, timeout_s: float | None = None) -> None:
        """Until every topic delivered a message sent after this call."""
        since = time.monotonic_ns()
        record = self.traffic.record

        def flowing() -> bool | None:
            fresh = {
                record.producers[d.producer].topic
                for d in list(record.deliveries)
                if d.at_ns > since and record.producers[d.producer].sends[d.seq].sent_ns > since
            }
            return len(fresh) >= len(self.traffic.spec.topics) or None

        _wait("every topic delivering again", flowing, timeout_s or self.recovery_timeout_s)


def _bundle_holding(topic: str, bundles: tuple[str, ...]) -> str:
    from lbd.core.bundles import parse_bundle_id, topic_hash

    h = topic_hash(topic)
    namespace = topic.partition("://")[2].rsplit("/", 1)[0]
    for b in bundles:
        parsed = parse_bundle_id(b)
        if str(parsed.namespace) == namespace and h in parsed.range:
            return b
    return bundles[0] if bundles else ""


def _overlaps(a: str, b: str) -> bool:
    from lbd.core.bundles import parse_bundle_id

    if not a or not b:
        return False
    return parse_bundle_id(a).overlaps(parse_bundle_id(b))


def _retry(call: Callable[[], _T], timeout_s: float = 30.0) -> _T:
    """A call to a sidecar, retried while it fails (a leader change, an outage ending)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except RpcFailure:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def _wait(what: str, probe: Callable[[], _T | None], timeout_s: float = 30.0) -> _T:
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
            raise LbdError(f"{what}: not within {timeout_s:g} s (last error: {last})")
        time.sleep(0.05)


def _unreceipted(
    events: list[dict[str, object]], start_ns: int, end_ns: int, before_ns: int
) -> int:
    """The sends the fronts stopped without a receipt for between ``start_ns`` and ``end_ns``
    that they had accepted before ``before_ns``."""
    return sum(
        1
        for e in events
        if e["event"] == "unreceipted" and start_ns <= int(str(e["t_ns"])) <= end_ns
        for accepted in cast(list[int], e.get("accepted_ns", []))
        if accepted < before_ns
    )
