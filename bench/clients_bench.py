"""Benchmark: what each event costs real Pulsar clients, and the broker front's own overhead.

``python -m bench.clients_bench [--quick] [--transfers N] [--defaults] [--secure]
[--events NAME,...]`` starts a 3-broker dev cluster of its own (broker fronts, real storage),
runs producers (``send_async``) and consumers (acknowledging) of the official ``pulsar-client``
on topics spread over every broker, and puts the cluster through each event in turn
(:class:`lbd.devcluster.disruptions.ClientHarness`): admin transfers of a busy bundle, an unload,
a split, a drain, a rolling restart of every broker, kill -9 of a broker front, of a sidecar and
of the leader's sidecar, SIGSTOP of a front and of a sidecar for 30 s, etcd paused 60 s, the
storage pulsar-lite restarted. One row per event, from the clients' own records: sends that
failed, acknowledged messages never received (lost), duplicates, reordering, the longest send
latency, the longest gap in delivery on a topic, the lookups the clients made (per topic of the
bundle concerned), and how long after a failover's bundles were Owned again their producers
resumed. Then the brokers' event logs judged whole: dual serving, messages accepted by a broker
that did not serve the bundle at that instant, storage order.

``overhead`` produces through one broker front and straight to the storage pulsar-lite, the same
client in the same run, interleaved: the front's throughput and p50 latency against storage's.

With ``--defaults`` the sidecars keep lbd's default timings (a failover waits out a 3 s lease, a
1.5 s orphan grace and the 4.5 s hand-over wait) instead of the dev cluster's (a 7 s grace).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pulsar
from rich.console import Console
from rich.table import Table

from bench.report import Figure, figures_table
from lbd.ctl.client import SidecarClient
from lbd.devcluster.cluster import DEV_SETTINGS, DevCluster, DevClusterSpec, down, up
from lbd.devcluster.disruptions import ClientHarness, EventFigures, SafetyFigures
from lbd.traffic.clients import ClientTls, TrafficSpec, topics_for
from lbd.traffic.records import TrafficRecord, lost_sends

NAMESPACE = "bench/clients"
BUNDLES = 16
TOPICS = 24
RATE = 20.0
"""Messages per second per topic: 480 a second through the cluster. Every process of the cluster
and the clients share this machine's 2 cores: at 1,200 a second the events' latencies measure
the machine's queueing more than lbd's handovers (the throughput of one front is measured
apart, by ``overhead``)."""

EVENTS = (
    "transfer",
    "unload",
    "split",
    "drain",
    "rolling_restart",
    "kill_front",
    "kill_sidecar",
    "pause_front",
    "pause_sidecar",
    "kill_leader",
    "pause_etcd",
    "restart_storage",
)
QUICK_EVENTS = ("transfer", "unload", "split", "kill_front", "restart_storage")

QUIET = ("shedding.interval_s=3600", "split.interval_s=3600")
"""No shedding or automatic split: the events alone move bundles."""


@dataclass(frozen=True, slots=True)
class Overhead:
    """Producing through a front and straight to storage, interleaved in one run."""

    front_rate: float
    storage_rate: float
    front_p50_ms: float
    storage_p50_ms: float
    messages: int

    @property
    def rate_ratio(self) -> float:
        return self.front_rate / self.storage_rate

    @property
    def latency_ratio(self) -> float:
        return self.front_p50_ms / self.storage_p50_ms


@dataclass(frozen=True, slots=True)
class ClientsResult:
    """Every event's figures, the logs judged whole, and the front's overhead."""

    events: list[EventFigures]
    safety: SafetyFigures
    overhead: Overhead | None
    timings: str
    secure: bool


def run(
    *,
    events: Sequence[str] = EVENTS,
    transfers: int = 50,
    defaults: bool = False,
    secure: bool = False,
    overhead: bool = True,
    pause_s: float = 30.0,
    etcd_pause_s: float = 60.0,
    keep: Path | None = None,
    client_log_level: str = "error",
) -> ClientsResult:
    """Start a dev cluster, run the events under client traffic, stop it. ``keep``: the
    cluster's state dir (its logs, event logs and the clients' log), kept after the run, with
    ``lost.jsonl`` (each acknowledged message no consumer received, with its storage id)."""
    settings = {} if defaults else dict(DEV_SETTINGS)
    spec = DevClusterSpec(brokers=3, secure=secure, settings=settings).with_overrides(list(QUIET))
    with contextlib.ExitStack() as stack:
        if keep is None:
            state_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lbd-bench-")))
        else:
            state_dir = keep
        cluster = up(state_dir, spec)
        harness = None
        try:
            measured = measure_overhead(cluster) if overhead else None
            spec_of_clients = dataclasses.replace(traffic_spec(cluster), log_level=client_log_level)
            harness = ClientHarness(
                cluster, spec_of_clients, recovery_timeout_s=400.0 if defaults else 90.0
            )
            create_namespace(cluster)
            harness.start()
            actions: dict[str, Callable[[], None]] = {
                "transfer": harness.transfer,
                "unload": harness.unload,
                "split": harness.split,
                "drain": harness.drain,
                "rolling_restart": harness.rolling_restart,
                "kill_front": harness.kill_front,
                "kill_sidecar": harness.kill_sidecar,
                "pause_front": lambda: harness.pause_front(pause_s),
                "pause_sidecar": lambda: harness.pause_sidecar(pause_s),
                "kill_leader": harness.kill_leader,
                "pause_etcd": lambda: harness.pause_etcd(etcd_pause_s),
                "restart_storage": harness.restart_storage,
            }
            for name in events:
                for _ in range(transfers if name == "transfer" else 1):
                    actions[name]()
            figures, safety = harness.finish()
            if keep is not None:
                _write_lost(harness.traffic.record, keep / "lost.jsonl")
        finally:
            down(state_dir)
            if harness is not None:
                harness.close()
    return ClientsResult(
        figures, safety, measured, "defaults" if defaults else "dev timings", secure
    )


def _write_lost(record: TrafficRecord, path: Path) -> None:
    """One JSON line per acknowledged message no consumer received: its topic, producer,
    sequence, storage id and times (monotonic ns, as the brokers' event logs)."""
    with path.open("w") as out:
        for p, seq in lost_sends(record):
            send = record.producers[p].sends[seq]
            line = {
                "topic": record.producers[p].topic,
                "producer": p,
                "seq": seq,
                "message_id": send.message_id,
                "sent_ns": send.sent_ns,
                "receipt_ns": send.ended_ns,
            }
            out.write(json.dumps(line) + "\n")


def traffic_spec(cluster: DevCluster) -> TrafficSpec:
    """The clients of the events: 24 topics of the benchmark namespace, 50 messages/s each."""
    c = cluster.pulsar_client
    tls = ClientTls(c["ca_file"], c.get("cert_file"), c.get("key_file")) if c else None
    return TrafficSpec(
        service_url=cluster.service_url,
        topics=topics_for([NAMESPACE], TOPICS, "events"),
        rate=RATE,
        size=256,
        tls=tls,
        log_file=str(Path(cluster.state_dir) / "clients.log"),
    )


def create_namespace(cluster: DevCluster) -> None:
    """The benchmark namespace, with its bundles."""
    client = SidecarClient(cluster.nodes[0].grpc_addr, credentials=cluster.credentials())
    try:
        client.create_namespace(NAMESPACE, BUNDLES)
    finally:
        client.close()


def measure_overhead(cluster: DevCluster, *, messages: int = 5_000, rounds: int = 3) -> Overhead:
    """Produce ``messages`` as fast as the client pipelines them, and 200 one at a time, through
    one front and straight to storage, alternating ``rounds`` times; the best round of each."""
    c = cluster.pulsar_client
    log = str(Path(cluster.state_dir) / "clients.log")
    kwargs: dict[str, object] = {"logger": pulsar.FileLogger(pulsar.LoggerLevel.Error, log)}
    if c:
        kwargs["tls_trust_certs_file_path"] = c["ca_file"]
        kwargs["authentication"] = pulsar.AuthenticationTLS(c["cert_file"], c["key_file"])
    front_url = cluster.nodes[0].service_url
    rates: dict[str, list[float]] = {"front": [], "storage": []}
    p50s: dict[str, list[float]] = {"front": [], "storage": []}
    admin = SidecarClient(cluster.nodes[0].grpc_addr, credentials=cluster.credentials())
    try:
        topic = _topic_owned_by(admin, cluster.nodes[0].broker_id)
    finally:
        admin.close()
    for _ in range(rounds):
        for name, url, extra in (
            ("front", front_url, kwargs),
            ("storage", cluster.storage_url, {"logger": kwargs["logger"]}),
        ):
            client = pulsar.Client(url, **extra)
            try:
                producer = client.create_producer(topic, batching_enabled=False)
                rates[name].append(_pipelined_rate(producer, messages))
                p50s[name].append(_sequential_p50_ms(producer, 200))
            finally:
                client.close()
    return Overhead(
        front_rate=max(rates["front"]),
        storage_rate=max(rates["storage"]),
        front_p50_ms=min(p50s["front"]),
        storage_p50_ms=min(p50s["storage"]),
        messages=messages,
    )


def _topic_owned_by(admin: SidecarClient, broker: str) -> str:
    """A topic of public/default whose bundle ``broker`` owns (assigned to it if free)."""
    for i in range(1000):
        topic = f"persistent://public/default/overhead-{i}"
        answer = admin.lookup(topic, read_only=True)
        if answer.owner_broker_id == broker:
            return topic
        if not answer.owner_broker_id:
            admin.assign(answer.bundle, broker)
            return topic
    raise RuntimeError(f"no topic of public/default is owned by {broker}")


def _pipelined_rate(producer: pulsar.Producer, messages: int) -> float:
    body = b"x" * 256
    done = threading.Semaphore(0)
    failed: list[object] = []

    def callback(result: object, _id: object) -> None:
        if result != pulsar.Result.Ok:
            failed.append(result)
        done.release()

    window = threading.BoundedSemaphore(1000)

    def sent(result: object, message_id: object) -> None:
        window.release()
        callback(result, message_id)

    start = time.perf_counter()
    for _ in range(messages):
        window.acquire()
        producer.send_async(body, sent)
    for _ in range(messages):
        done.acquire()
    seconds = time.perf_counter() - start
    if failed:
        raise RuntimeError(f"{len(failed)} sends failed while measuring: {failed[0]}")
    return messages / seconds


def _sequential_p50_ms(producer: pulsar.Producer, messages: int) -> float:
    body = b"x" * 256
    latencies = []
    for _ in range(messages):
        start = time.perf_counter()
        producer.send(body)
        latencies.append(1000 * (time.perf_counter() - start))
    return statistics.median(latencies)


def _rows(result: ClientsResult) -> list[list[str]]:
    rows = []
    for name, group in _grouped(result.events):
        maxima = sorted(e.summary.latency_max_ms for e in group)
        rows.append(
            [
                name,
                str(len(group)),
                str(sum(e.summary.failed for e in group)),
                str(sum(e.summary.lost for e in group)),
                str(sum(e.summary.duplicates for e in group)),
                str(sum(e.summary.reordered for e in group)),
                f"{maxima[-1]:.0f}"
                + (
                    f" (p99 {_p99(maxima):.0f}, median {maxima[len(maxima) // 2]:.0f})"
                    if len(group) > 1
                    else ""
                ),
                f"{max(e.summary.latency_p99_ms for e in group):.1f}",
                f"{max(e.summary.longest_gap_ms for e in group):.0f}",
                f"{max(e.lookups_per_topic for e in group):.1f}",
                _resumed(group),
                group[-1].note,
            ]
        )
    return rows


COLUMNS = (
    "event",
    "n",
    "failed",
    "lost",
    "dup",
    "reordered",
    "max send ms",
    "p99 send ms",
    "longest gap ms",
    "lookups/topic",
    "resumed s",
    "",
)


def events_markdown(result: ClientsResult) -> str:
    """The events table as Markdown (for the README)."""
    head = "| " + " | ".join(c or "note" for c in COLUMNS) + " |"
    rule = "|" + "|".join("---" if c in ("event", "") else "---:" for c in COLUMNS) + "|"
    return "\n".join([head, rule, *("| " + " | ".join(r) + " |" for r in _rows(result))])


def events_table(result: ClientsResult) -> Table:
    """One row per kind of event (repeated events: their worst, and the p99 of their maxima)."""
    mode = f"{result.timings}{', secure' if result.secure else ''}"
    table = Table(title=f"real clients through the brokers, per event ({mode})")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("event", "") else "right")
    for row in _rows(result):
        table.add_row(*row)
    table.caption = result.safety.line()
    return table


def _grouped(events: list[EventFigures]) -> list[tuple[str, list[EventFigures]]]:
    groups: dict[str, list[EventFigures]] = {}
    for e in events:
        groups.setdefault(e.name, []).append(e)
    return list(groups.items())


def _p99(values: list[float]) -> float:
    return values[min(len(values) - 1, max(0, round(0.99 * len(values)) - 1))]


def _resumed(group: list[EventFigures]) -> str:
    values = [e.resume_s for e in group if e.resume_s is not None]
    return f"{max(values):.2f}" if values else "-"


def figures(result: ClientsResult) -> list[Figure]:
    """Each goal of the real-clients issue against what the run measured. A goal of none is set
    as a baseline of 1 that the count must not exceed 0 times."""
    out: list[Figure] = []
    groups = dict(_grouped(result.events))

    def at_most(name: str, value: float, unit: str, goal: float) -> None:
        out.append(Figure(name, value, unit, goal, "goal", "<= 1"))

    def none(name: str, value: float, unit: str) -> None:
        out.append(Figure(name, value, unit, 1.0, "goal: none", "<= 0"))

    if "transfer" in groups:
        maxima = sorted(e.summary.latency_max_ms for e in groups["transfer"])
        at_most(f"transfer: longest send latency, p99 of {len(maxima)}", _p99(maxima), "ms", 50.0)
        none(
            "transfer: failed sends and lookups afterwards",
            float(sum(e.summary.failed + e.lookups for e in groups["transfer"])),
            "",
        )
    if "unload" in groups:
        at_most(
            "unload: lookups per topic (1 + consumers)",
            max(e.lookups_per_topic for e in groups["unload"]),
            "",
            2.0,
        )
    if "rolling restart" in groups:
        e = groups["rolling restart"][0]
        at_most("rolling restart: send latency p99.99", e.summary.latency_p9999_ms, "ms", 100.0)
        none("rolling restart: failed sends", float(e.summary.failed), "")
    resumed = [
        e.resume_s for e in result.events if e.resume_s is not None and e.name.startswith("kill")
    ]
    if resumed:
        at_most(
            "failover after kill -9: producers resumed after Owned again", max(resumed), "s", 1.0
        )
    none(
        "acknowledged messages lost, every event",
        float(sum(e.summary.lost for e in result.events)),
        "",
    )
    s = result.safety
    none(
        "messages accepted by a broker not serving the bundle",
        float(len(s.writes_outside_serving) + len(s.storage_order)),
        "",
    )
    if result.overhead is not None:
        o = result.overhead
        out.append(
            Figure(
                "front: produce throughput",
                o.front_rate,
                "msg/s",
                o.storage_rate,
                "storage, same run",
                ">= 0.7",
            )
        )
        out.append(
            Figure(
                "front: p50 send latency",
                o.front_p50_ms,
                "ms",
                o.storage_p50_ms,
                "storage, same run",
                "<= 1.5",
            )
        )
    return out


def overhead_table(o: Overhead) -> Table:
    """The front's overhead, both ways."""
    table = Table(title=f"one producer, {o.messages:,} messages of 256 bytes, best of the rounds")
    for column in ("path", "messages/s (pipelined)", "p50 send ms (one at a time)"):
        table.add_column(column, justify="left" if column == "path" else "right")
    table.add_row("through a broker front", f"{o.front_rate:,.0f}", f"{o.front_p50_ms:.2f}")
    table.add_row("straight to storage", f"{o.storage_rate:,.0f}", f"{o.storage_p50_ms:.2f}")
    table.add_row("ratio", f"{o.rate_ratio:.2f}", f"{o.latency_ratio:.2f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.clients_bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few events, 5 transfers")
    parser.add_argument("--transfers", type=int, default=50)
    parser.add_argument("--defaults", action="store_true", help="lbd's default timings")
    parser.add_argument("--secure", action="store_true", help="a --secure dev cluster")
    parser.add_argument("--events", help=f"comma-separated, of: {', '.join(EVENTS)}")
    parser.add_argument("--markdown", action="store_true", help="the events table as Markdown too")
    parser.add_argument(
        "--keep", type=Path, help="run the cluster in this directory and keep its logs"
    )
    parser.add_argument(
        "--client-log",
        default="error",
        choices=("error", "warn", "info"),
        help="the clients' log level: error, warn or info",
    )
    args = parser.parse_args()
    events = (
        tuple(args.events.split(",")) if args.events else (QUICK_EVENTS if args.quick else EVENTS)
    )
    unknown = set(events) - set(EVENTS)
    if unknown:
        parser.error(f"unknown events: {', '.join(sorted(unknown))}")
    console = Console()
    with console.status("clients: a dev cluster under real traffic, event by event..."):
        result = run(
            events=events,
            transfers=5 if args.quick else args.transfers,
            defaults=args.defaults,
            secure=args.secure,
            keep=args.keep,
            client_log_level=args.client_log,
        )
    console.print(events_table(result))
    if args.markdown:
        print(events_markdown(result))
    if result.overhead is not None:
        console.print(overhead_table(result.overhead))
    console.print(figures_table("real clients: the goals", figures(result)))


if __name__ == "__main__":
    main()
