"""Benchmark: live balancing with real clients, 5 brokers then 10, beside Pulsar's figure.

``python -m bench.balance_live_bench [--quick] [--keep DIR]`` starts a 5-broker dev cluster
of its own (broker fronts, real storage), assigns the 48 bundles of one namespace round-robin
and runs producers and consumers of the official ``pulsar-client`` on one topic per bundle, a
quarter of them five times as busy as the rest: equal bundle counts, unequal traffic. The
leader's shedding (``cluster_planner``, the default) balances it; then 5 more brokers join
(:func:`lbd.devcluster.cluster.add_brokers`), empty, and the leader fills them.

Every 10 s the bench reads the brokers' load reports as the leader's sidecar holds them
(``GetLoad``): each broker's raw messages/s in and out of its latest report. The spread measured
is of the load the brokers *carry*: that throughput over the broker's network capacity, as the
planner normalises a broker's bytes (:func:`carried_loads`); a registered broker that has not
reported yet carries nothing. Beside it, the std of the EMA loads the leader plans on.

Reported: the minutes and shedding cycles from the joining brokers' start (sampling goes on
while they start) until the carried std of all 10 is under the target, the moves made (before
and after the join), the std once all 10 report and at the end, the send latency of the moved
topics' producers while the moves ran against the other producers' in the same window, and the
clients' failed sends and lost messages.

Pulsar's published figure for its extensible load manager: 5 → 10 brokers balanced in about
5 minutes at its 1-minute shedding interval, i.e. about 5 cycles. The settings here shorten
every interval by the same factor (:data:`SETTINGS`) so that the run stays within minutes; the
figure is compared in cycles as well as in minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.report import Figure, figures_table
from lbd.core.bundles import NamespaceBundles
from lbd.core.names import NamespaceName
from lbd.core.shedding.model import mean_and_std
from lbd.ctl.client import RpcFailure, SidecarClient
from lbd.devcluster.cluster import DevCluster, DevClusterSpec, add_brokers, down, up
from lbd.traffic.clients import ClientTraffic, TrafficSpec
from lbd.traffic.records import TrafficRecord, summarize
from lbd.workload.traffic import Workload, WorkloadSpec

NAMESPACE = "bench/balance-live"
BUNDLES = 48
BROKERS = 5
JOINING = 5
RATE = 5.0
"""Messages/s of a quiet topic; a quarter of the topics get ``HOT_FACTOR`` times that: 480
messages/s produced in all, as many consumed. Every process of the 10 brokers and the clients
share this machine's cores: at more, latencies measure the machine's queueing."""
HOT_FRACTION = 0.25
HOT_FACTOR = 5.0
MESSAGE_BYTES = 256
BANDWIDTH_LIMIT_MBIT = 0.33
"""Each broker front's network capacity (``front.bandwidth_limit_mbit``), scaled to the traffic:
480 messages/s of 256 bytes over 5 brokers is about 0.2 Mbit/s each way per broker, some 60% of
this, as the balance suite's scale-up starts at 70%. At the default 1,000 Mbit/s the traffic
would be noise beside each front's CPU."""

TIME_SCALE = 5
"""Every interval below is lbd's (and Pulsar's) default divided by this."""
SHEDDING_INTERVAL_S = 60 / TIME_SCALE
TARGET_STD = 0.10
SETTINGS: Mapping[str, str] = {
    "shedding.strategy": "cluster_planner",
    "shedding.interval_s": f"{SHEDDING_INTERVAL_S:g}",
    "load_report.interval_s": f"{10 / TIME_SCALE:g}",
    "shedding.bundle_grace_period_s": f"{1800 // TIME_SCALE}",
    "shedding.cooldown_s": f"{180 // TIME_SCALE}",
    # The balance suite's target (Pulsar's default is 0.25): 5 empty brokers beside 5 at 60%
    # are a std of 0.3, under 0.25 after the first few moves.
    "shedding.target_std": f"{TARGET_STD:g}",
    # Bundles stay as they are: a split would change what there is to balance.
    "split.interval_s": "3600",
    "front.bandwidth_limit_mbit": f"{BANDWIDTH_LIMIT_MBIT:g}",
}
"""The sidecars' and fronts' settings (everything else at lbd's defaults)."""

SAMPLE_S = 10.0
MOVE_WINDOW_S = (1.0, 5.0)
"""The window of the moves: from this long before the first move after the join to this long
after the last one."""


@dataclass(frozen=True, slots=True)
class Sample:
    """The brokers' load reports at one instant, as the leader's sidecar holds them."""

    t_s: float
    """Seconds since the join (negative before it)."""
    msg_rates: dict[str, float]
    """Each registered broker's messages/s in and out, its latest report (0: none yet)."""
    leader_loads: dict[str, float]
    """Each reporting broker's EMA load (``weighted_max_ema``), what the planner starts from."""

    @property
    def carried_std(self) -> float:
        """The std of the load the brokers carry (:func:`carried_loads`)."""
        loads = carried_loads(self.msg_rates, MESSAGE_BYTES, 2 * BANDWIDTH_LIMIT_MBIT)
        return mean_and_std(loads.values())[1]

    @property
    def leader_std(self) -> float:
        return mean_and_std(self.leader_loads.values())[1]


@dataclass(frozen=True, slots=True)
class Latencies:
    """Send latencies (ms) of a group of producers in a window."""

    sends: int
    p50_ms: float
    p99_ms: float
    max_ms: float

    def cells(self) -> str:
        if not self.sends:
            return "-"
        return f"{self.p50_ms:.1f} / {self.p99_ms:.1f} / {self.max_ms:.0f} ({self.sends:,} sends)"


@dataclass(frozen=True, slots=True)
class BalanceLiveResult:
    """What one run measured."""

    samples: list[Sample]
    join_s: float
    """How long starting and registering the joining brokers took (t = 0 is their start)."""
    moves_before: int
    moves_after: int
    moved_topics: int
    moved: Latencies
    others: Latencies
    move_window_s: float
    sent: int
    failed: int
    lost: int
    settings: dict[str, str] = field(default_factory=dict)

    @property
    def after(self) -> list[Sample]:
        return [s for s in self.samples if s.t_s >= 0]

    @property
    def whole(self) -> list[Sample]:
        """The samples from the join on in which every joining broker was registered."""
        return [s for s in self.after if len(s.msg_rates) == BROKERS + JOINING]

    @property
    def seconds_to_target(self) -> float | None:
        """From the joining brokers' start until the carried std of all of them is under target."""
        return seconds_to_target([(s.t_s, s.carried_std) for s in self.whole], TARGET_STD)

    @property
    def cycles_to_target(self) -> int | None:
        seconds = self.seconds_to_target
        return None if seconds is None else cycles(seconds, SHEDDING_INTERVAL_S)


def carried_loads(
    msg_rates: Mapping[str, float], message_bytes: int, capacity_mbit: float
) -> dict[str, float]:
    """Each broker's carried load: its messages/s (in + out) as Mbit/s over its network
    capacity (in + out), as the planner prices a broker's bytes against its capacity."""
    return {b: r * message_bytes * 8 / 1e6 / capacity_mbit for b, r in msg_rates.items()}


def seconds_to_target(samples: Sequence[tuple[float, float]], target: float) -> float | None:
    """The time of the first sample at or after 0 whose std is under ``target`` (samples are
    ``(t_s, std)`` in time order); None when none is."""
    return next((t for t, std in samples if t >= 0 and std < target), None)


def cycles(seconds: float, interval_s: float) -> int:
    """Shedding cycles that ran within ``seconds`` of the join (at least 1: the leader's first
    cycle after the join came at most one interval after it)."""
    return max(1, math.ceil(seconds / interval_s - 1e-9))


def latencies(
    record: TrafficRecord, producers: Iterable[int], since_ns: int, until_ns: int
) -> Latencies:
    """The receipted sends of ``producers`` sent within ``[since_ns, until_ns)``."""
    values = sorted(
        (s.ended_ns - s.sent_ns) / 1e6
        for p in producers
        for s in list(record.producers[p].sends)
        if since_ns <= s.sent_ns < until_ns and s.ended_ns is not None and s.error is None
    )
    if not values:
        return Latencies(0, 0.0, 0.0, 0.0)
    return Latencies(len(values), _rank(values, 0.50), _rank(values, 0.99), values[-1])


def _rank(sorted_values: Sequence[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def run(*, quick: bool = False, keep: Path | None = None) -> BalanceLiveResult:
    """Start the cluster and the clients, let 5 brokers balance, add 5, sample until the carried
    std is under target (and two samples more) or a bound; stop every process, even on error.
    ``keep``: the cluster's state dir (its logs and the clients' log), kept after the run."""
    before_s, after_s = (60.0, 150.0) if quick else (120.0, 300.0)
    spec = DevClusterSpec(brokers=BROKERS, settings=dict(SETTINGS))
    with contextlib.ExitStack() as stack:
        if keep is None:
            state_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lbd-bench-")))
        else:
            state_dir = keep
        stack.callback(down, state_dir)  # registered first: runs last, after the clients stop
        cluster = up(state_dir, spec)
        sampler = _Sampler(cluster)
        stack.callback(sampler.close)
        topics = _assign_round_robin(sampler.leader(), cluster)
        traffic = ClientTraffic(
            TrafficSpec(
                service_url=cluster.service_url,
                topics=tuple(topics.values()),
                rate=RATE,
                size=MESSAGE_BYTES,
                hot_fraction=HOT_FRACTION,
                hot_factor=HOT_FACTOR,
                log_file=str(state_dir / "clients.log"),
            )
        )
        with contextlib.ExitStack() as running:
            running.callback(traffic.stop, 5.0)  # on an error; a clean run drains below
            traffic.start()
            _wait_delivering(traffic.record, len(topics))
            started_ms = time.time_ns() // 1_000_000
            raw = sampler.until(before_s, settled=True)
            # The joining brokers start in the background while the sampling goes on: the clock
            # starts with them, as Pulsar's figure counts from the new brokers' start.
            join_started = time.monotonic()
            join_ms = time.time_ns() // 1_000_000
            with ThreadPoolExecutor(1, thread_name_prefix="lbd-bench-join") as pool:
                joining = pool.submit(add_brokers, state_dir, JOINING)
                raw += sampler.until(after_s, settled=False, joining=joining)
            joined = time.monotonic() if sampler.joined_at is None else sampler.joined_at
            running.pop_all()
        traffic.stop(drain_s=60.0)
        moves = _moves(sampler.leader(), started_ms)
    record = traffic.record
    after = [(at, bundle) for at, bundle in moves if at >= join_ms]
    moved_bundles = {bundle for _, bundle in after}
    moved = [i for i, bundle in enumerate(topics) if bundle in moved_bundles]
    others = [i for i in range(len(topics)) if i not in set(moved)]
    lo = hi = 0
    if after:
        offset_ns = time.time_ns() - time.monotonic_ns()  # from the decisions' wall clock
        lo = after[0][0] * 1_000_000 - offset_ns - int(MOVE_WINDOW_S[0] * 1e9)
        hi = after[-1][0] * 1_000_000 - offset_ns + int(MOVE_WINDOW_S[1] * 1e9)
    summary = summarize(record)
    return BalanceLiveResult(
        samples=[Sample(at - join_started, rates, loads) for at, rates, loads in raw],
        join_s=joined - join_started,
        moves_before=sum(1 for at, _ in moves if at < join_ms),
        moves_after=len(after),
        moved_topics=len(moved),
        moved=latencies(record, moved, lo, hi),
        others=latencies(record, others, lo, hi),
        move_window_s=(hi - lo) / 1e9,
        sent=summary.sent,
        failed=summary.failed,
        lost=summary.lost,
        settings=dict(SETTINGS),
    )


_RawSample = tuple[float, dict[str, float], dict[str, float]]


class _Sampler:
    """Reads the brokers' load reports from the leader's sidecar every :data:`SAMPLE_S`."""

    def __init__(self, cluster: DevCluster) -> None:
        self._clients: dict[str, SidecarClient] = {}
        self.joined_at: float | None = None
        """When the brokers being added were all registered (monotonic seconds)."""
        self.refresh(cluster)

    def refresh(self, cluster: DevCluster) -> None:
        """Know every node of ``cluster`` (after brokers joined)."""
        for node in cluster.nodes:
            if node.broker_id not in self._clients:
                self._clients[node.broker_id] = SidecarClient(
                    node.grpc_addr, credentials=cluster.credentials(), timeout_s=10.0
                )

    def leader(self) -> SidecarClient:
        """The leader's sidecar (the first one's while nobody leads)."""
        first = next(iter(self._clients.values()))
        with contextlib.suppress(RpcFailure):
            leader = first.leader().broker_id
            if leader in self._clients:
                return self._clients[leader]
        return first

    def sample(self) -> _RawSample:
        client = self.leader()
        registered = [b.info.broker_id for b in client.brokers().brokers]
        load = client.load()
        rates = {b: 0.0 for b in registered}
        rates.update((b.broker_id, b.msg_rate) for b in load.brokers)
        return time.monotonic(), rates, {b.broker_id: b.load for b in load.brokers}

    def until(
        self, bound_s: float, *, settled: bool, joining: Future[DevCluster] | None = None
    ) -> list[_RawSample]:
        """Sample every :data:`SAMPLE_S` for at most ``bound_s``. ``settled``: stop at the first
        sample under target after the first minute; else at the third in a row under it (the
        first, and two that show it held) once ``joining`` (brokers being added) is done."""
        out: list[_RawSample] = []
        start = time.monotonic()
        under = 0
        if joining is not None:
            time.sleep(SAMPLE_S)  # the previous phase's last sample stands for this instant
            start = time.monotonic() - SAMPLE_S
        while True:
            if joining is not None and joining.done() and self.joined_at is None:
                self.joined_at = time.monotonic()
                self.refresh(joining.result())  # raises what stopped the join
            at, rates, loads = self.sample()
            out.append((at, rates, loads))
            std = Sample(0.0, rates, loads).carried_std
            whole = joining is None or self.joined_at is not None
            under = under + 1 if std < TARGET_STD and whole else 0
            elapsed = at - start
            if elapsed >= bound_s:
                return out
            if settled and under and elapsed >= 60.0:
                return out
            if not settled and under >= 3:
                return out
            time.sleep(max(0.0, start + SAMPLE_S * (len(out) + bool(joining)) - time.monotonic()))

    def close(self) -> None:
        for client in self._clients.values():
            client.close()


def _assign_round_robin(admin: SidecarClient, cluster: DevCluster) -> dict[str, str]:
    """Create the namespace, assign its bundles to the brokers in turn; each bundle's topic."""
    admin.create_namespace(NAMESPACE, BUNDLES)
    layout = NamespaceBundles.default(NamespaceName.parse(NAMESPACE), BUNDLES).bundles()
    workload = Workload(WorkloadSpec(topics_per_bundle=1))
    topics = {}
    for i, bundle in enumerate(layout):
        admin.assign(str(bundle.id), cluster.nodes[i % len(cluster.nodes)].broker_id)
        topics[str(bundle.id)] = workload.topics(bundle.id)[0]
    return topics


def _wait_delivering(record: TrafficRecord, topics: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len({record.producers[d.producer].topic for d in list(record.deliveries)}) < topics:
        if time.monotonic() >= deadline:
            raise RuntimeError(f"not every one of {topics} topics delivered within {timeout_s}s")
        time.sleep(0.5)


def _moves(leader: SidecarClient, since_ms: int) -> list[tuple[int, str]]:
    """The moves the leader decided since ``since_ms``: (when, bundle), oldest first."""
    decisions = leader.decisions(since_ms=since_ms).decisions
    return [(d.at_ms, d.bundle) for d in decisions if d.kind in ("transfer", "unload")]


def settings_line(result: BalanceLiveResult) -> str:
    """The settings of the run, for a caption."""
    s = result.settings
    return (
        f"cluster_planner; shedding every {s['shedding.interval_s']} s and load reports every "
        f"{s['load_report.interval_s']} s (lbd's and Pulsar's 60 s and 10 s over {TIME_SCALE}), "
        f"grace {s['shedding.bundle_grace_period_s']} s, target std {s['shedding.target_std']}, "
        f"{BUNDLES} bundles, {RATE:g} msg/s a topic ({HOT_FRACTION:.0%} at {HOT_FACTOR:g}x), "
        f"{MESSAGE_BYTES} B, {s['front.bandwidth_limit_mbit']} Mbit/s per broker"
    )


def _minutes(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds / 60:.1f}"


def summary_rows(result: BalanceLiveResult) -> list[tuple[str, str]]:
    """The run's figures, one (name, value) a row."""
    after = result.whole
    seconds = result.seconds_to_target
    cycles_text = "never" if result.cycles_to_target is None else str(result.cycles_to_target)
    return [
        ("joining brokers: started and registered in", f"{result.join_s:.1f} s"),
        (
            "carried std at the join / at the end",
            f"{after[0].carried_std:.3f} / {after[-1].carried_std:.3f}" if after else "-",
        ),
        (
            "leader's EMA std at the join / at the end",
            f"{after[0].leader_std:.3f} / {after[-1].leader_std:.3f}" if after else "-",
        ),
        (
            "shedding cycles to target after the join",
            f"{cycles_text} (Pulsar: about {PULSAR_CYCLES:g})",
        ),
        (
            "time to target after the join",
            f"{_minutes(seconds)} min here; "
            f"{_minutes(None if seconds is None else seconds * TIME_SCALE)} min at 60 s cycles "
            f"(Pulsar: about {PULSAR_MINUTES:g})",
        ),
        ("moves before the join / after it", f"{result.moves_before} / {result.moves_after}"),
        ("topics moved after the join", str(result.moved_topics)),
        (
            f"send ms p50 / p99 / max, moved topics ({result.move_window_s:.0f} s of moves)",
            result.moved.cells(),
        ),
        ("send ms p50 / p99 / max, the other topics, same window", result.others.cells()),
        ("sends / failed / lost", f"{result.sent:,} / {result.failed} / {result.lost}"),
    ]


def table(result: BalanceLiveResult) -> Table:
    """The run's figures, the settings as the caption."""
    t = Table(title=f"live balance: {BROKERS} brokers, then {BROKERS + JOINING}, real clients")
    t.add_column("figure", justify="left")
    t.add_column("value", justify="right")
    for name, value in summary_rows(result):
        t.add_row(name, value)
    t.caption = settings_line(result)
    return t


def samples_table(result: BalanceLiveResult) -> Table:
    """Every sample: the carried std, the leader's EMA std, the busiest and idlest broker."""
    t = Table(title=f"the brokers' load reports every {SAMPLE_S:g} s (t = 0: {JOINING} more start)")
    for column in ("t s", "brokers", "carried std", "leader's EMA std", "msg/s min / max"):
        t.add_column(column, justify="right")
    for s in result.samples:
        rates = sorted(s.msg_rates.values())
        t.add_row(
            f"{s.t_s:.0f}",
            str(len(rates)),
            f"{s.carried_std:.3f}",
            f"{s.leader_std:.3f}",
            f"{rates[0]:.0f} / {rates[-1]:.0f}" if rates else "-",
        )
    return t


PULSAR_MINUTES = 5.0
"""Pulsar's published figure for its extensible load manager (StreamNative, "Introducing
Extensible Load Balancer in Pulsar 3.0", 2023): 5 → 10 brokers balanced in about 5 minutes."""
PULSAR_CYCLES = PULSAR_MINUTES * 60 / 60
"""The same in shedding cycles, at Pulsar's default 1-minute interval."""


def figures(result: BalanceLiveResult) -> list[Figure]:
    """Cycles to target beside Pulsar's (its minutes at one cycle a minute), and no client
    harm."""
    cycles_value = result.cycles_to_target
    return [
        Figure(
            "5 -> 10 brokers: shedding cycles until the carried std is under target",
            float(cycles_value) if cycles_value is not None else math.inf,
            "cycles",
            PULSAR_CYCLES,
            "Pulsar extensible LM, published, 1 cycle/min",
            "<= 1",
        ),
        Figure(
            "5 -> 10 brokers: failed sends and lost messages",
            float(result.failed + result.lost),
            "",
            1.0,
            "goal: none",
            "<= 0",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.balance_live_bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter bounds (a smoke run)")
    parser.add_argument(
        "--keep", type=Path, help="run the cluster in this directory and keep its logs"
    )
    args = parser.parse_args()
    console = Console()
    with console.status("balance-live: 5 brokers under real clients, then 5 more..."):
        result = run(quick=args.quick, keep=args.keep)
    console.print(samples_table(result))
    console.print(table(result))
    console.print(figures_table("live balance: the figures", figures(result)))


if __name__ == "__main__":
    main()
