"""A cluster of 100 brokers with 1k, 10k and 100k bundles: lookups, memory, idle CPU, catch-up.

``python -m bench.scale_bench [--sizes 1000,10000,100000] [--profiles dev,default]`` starts, for
each timing profile and each size, an etcd and a pulsar-lite of its own and a cluster of
``--brokers`` brokers:

- ``--sidecars`` of them (3) are real: an ``lbd serve`` process each with a simulated broker
  (``lbd sim broker``), as ``lbd dev up`` runs them;
- the others are lightweight: one bench thread registers all of them in etcd under one session
  lease and keeps it alive. They own bundles and lookups name them, but they have no sidecar (a
  sidecar per broker is the architecture; a hundred Python sidecars each replaying 100k bundles
  do not fit on a small machine, and the measured sidecars see the same table either way).

Before the sidecars start, the channel is filled with ``size`` Owned bundles spread round-robin
over all brokers (in namespaces of at most 1,000 bundles), so the sidecars start into a cluster
of that size. Measured per profile and size:

- catch-up: a full replay of the channel (a follower in the bench process, which then saves the
  checkpoint a leader would have saved), and the sidecars' start from spawn to health SERVING
  (that checkpoint, then the channel's tail), all at once as a cluster's nodes start: the
  slowest;
- idle, over ``--idle-s`` seconds once every real broker serves its bundles: each sidecar's CPU
  (percent of one core) and resident memory, and whether a fencing storm set in: fences, and
  channel changes the sidecars applied, in that window (0 and 0 when the cluster is calm);
- owned Lookups at 32 in flight through the leader's sidecar: p50 and p99.

The profiles are the dev cluster's settings (reports every second, sweeps every second) and lbd's
defaults. The figures are each Lookup p99 against the same profile's 1k-bundle p99 of the same
run (the goal: within 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import tempfile
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from rich.console import Console

from bench.report import (
    Figure,
    cuts,
    drain,
    figures_table,
    lookup_owned,
    measurements_table,
)
from lbd.adapters.etcd import EtcdConnection, EtcdOptions
from lbd.adapters.etcd_checkpoint import EtcdCheckpointStore
from lbd.adapters.etcd_store import EtcdMetadataStore
from lbd.adapters.pulsar_channel import PulsarChannelLog
from lbd.adapters.pulsar_client import PulsarConnection
from lbd.config import Settings
from lbd.config.loader import load_settings
from lbd.core.broker_info import BrokerInfo
from lbd.core.bundles import NamespaceBundles
from lbd.core.ids import BrokerId, BundleId
from lbd.core.names import NamespaceName
from lbd.core.namespace import NamespaceRecord
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, encode_value
from lbd.devcluster import EtcdServer, PulsarLiteServer, free_ports
from lbd.devcluster.cluster import CLUSTER_NAME, DEV_SETTINGS
from lbd.devcluster.processes import SidecarProcess, SimBrokerProcess, settings_env
from lbd.gen.v1 import lbd_pb2_grpc
from lbd.services.channel import checkpoints
from lbd.services.channel.follower import ChannelFollower
from lbd.workload.traffic import Workload, WorkloadSpec

PROFILES: Mapping[str, Mapping[str, str]] = {"dev": DEV_SETTINGS, "default": {}}
"""Timing profiles: the dev cluster's short timings, and lbd's defaults."""
NAMESPACE_BUNDLES = 1_000
"""Bundles per namespace of the filled channel."""
PUBLISHERS = 64
LOOKUP_CONCURRENCY = 32
WARM_UP = 100
"""Lookups made one at a time before the measured ones."""
SIDECAR_START_TIMEOUT_S = 600.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def run(
    *,
    sizes: Sequence[int] = (1_000, 10_000, 100_000),
    profiles: Sequence[str] = ("dev", "default"),
    brokers: int = 100,
    sidecars: int = 3,
    idle_s: float = 20.0,
    lookups: int = 3_000,
) -> dict[str, float]:
    """Measure every profile at every size; keys are ``"<profile> <size>: <what>"``."""
    if not 1 <= sidecars < brokers:
        raise ValueError(f"sidecars must be in [1, {brokers}), got {sidecars}")
    unknown = set(profiles) - set(PROFILES)
    if unknown:
        raise ValueError(f"unknown profiles {sorted(unknown)}; known: {sorted(PROFILES)}")
    result: dict[str, float] = {}
    for profile in profiles:
        for size in sizes:
            one = _run_one(PROFILES[profile], size, brokers, sidecars, idle_s, lookups)
            result.update({f"{profile} {size:,}: {k}": v for k, v in one.items()})
    return result


def figures(result: Mapping[str, float]) -> list[Figure]:
    """Each profile's Lookup p99 at every size beyond its smallest, against its smallest."""
    found: dict[str, dict[int, float]] = {}
    for key, value in result.items():
        match = re.fullmatch(r"(\w+) ([\d,]+): lookup p99 ms", key)
        if match:
            found.setdefault(match[1], {})[int(match[2].replace(",", ""))] = value
    out = []
    for profile, by_size in found.items():
        base = min(by_size)
        for size in sorted(by_size):
            if size != base:
                out.append(
                    Figure(
                        name=f"Lookup p99, 32 in flight, {size:,} bundles ({profile} timings)",
                        value=by_size[size],
                        unit="ms",
                        baseline=by_size[base],
                        baseline_label=f"{base:,} bundles, same run",
                        goal="<= 2",
                    )
                )
    return out


# -- one cluster ------------------------------------------------------------------------------


def _run_one(
    timings: Mapping[str, str], size: int, brokers: int, sidecars: int, idle_s: float, lookups: int
) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="lbd-bench-scale-") as tmp:
        root = Path(tmp)
        with (
            EtcdServer(root / "etcd") as etcd,
            PulsarLiteServer(root / "pulsar", log_level="error") as pulsar,
        ):
            settings = load_settings(
                None,
                env=settings_env(timings),
                overrides={
                    "cluster.name": CLUSTER_NAME,
                    "etcd.endpoints": [etcd.client_url],
                    "pulsar.service_url": pulsar.service_url,
                },
            )
            ids = [f"broker-{i}" for i in range(1, brokers + 1)]
            real, light = ids[:sidecars], ids[sidecars:]
            farm = _BrokerFarm(settings, light)
            farm.start()
            try:
                bundles, replay_s = asyncio.run(_fill(settings, size, ids))
                return {"catch-up: full replay of the channel s": replay_s} | _measure(
                    root,
                    timings,
                    etcd.client_url,
                    pulsar.service_url,
                    real,
                    brokers,
                    bundles,
                    idle_s,
                    lookups,
                )
            finally:
                farm.stop()


class _BrokerFarm:
    """Lightweight brokers: registered under one etcd session that a thread keeps alive."""

    def __init__(self, settings: Settings, brokers: Sequence[str]) -> None:
        self._settings = settings
        self._brokers = brokers
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="broker-farm", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(60)
        if self._error is not None or not self._ready.is_set():
            raise RuntimeError(f"lightweight brokers not registered: {self._error}")

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # reported by start(), or lost after the measurement
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        options = EtcdOptions.from_settings(self._settings)
        conn = EtcdConnection.from_options(options)
        store = EtcdMetadataStore(conn, options)
        try:
            await store.start()
            for n, broker in enumerate(self._brokers):
                info = BrokerInfo(
                    broker_id=BrokerId(broker),
                    service_url=f"pulsar://127.0.0.1:{10_000 + n}",
                    web_service_url=f"http://127.0.0.1:{20_000 + n}",
                    start_time_ms=int(time.time() * 1000),
                )
                await store.register_broker(BrokerId(broker), info.to_json())
            self._ready.set()
            await self._stop.wait()
        finally:
            await store.close()
            await conn.close()


async def _fill(
    settings: Settings, size: int, brokers: Sequence[str]
) -> tuple[list[BundleId], float]:
    """Create the namespaces, publish ``size`` Owned bundles round-robin over ``brokers``, and
    save a checkpoint of them as a leader would have; the bundles, and the replay's seconds."""
    options = EtcdOptions.from_settings(settings)
    conn = EtcdConnection.from_options(options)
    pulsar = PulsarConnection(settings.pulsar.service_url, operation_timeout_s=30)
    topic = settings.pulsar.state_channel_topic
    log = PulsarChannelLog(pulsar, topic)
    bundles: list[BundleId] = []
    try:
        store = EtcdMetadataStore(conn, options)
        for k in range(-(-size // NAMESPACE_BUNDLES)):
            count = min(NAMESPACE_BUNDLES, size - k * NAMESPACE_BUNDLES)
            ns = NamespaceName.parse(f"bench/scale-{k}")
            record = NamespaceRecord.create(ns, count, None)
            await store.put_namespace(str(ns), record.to_json().encode(), 0)
            bundles.extend(b.id for b in NamespaceBundles.default(ns, count).bundles())
        pending = iter(enumerate(bundles))
        now = int(time.time() * 1000)

        async def publisher() -> None:
            for i, bundle in pending:
                owner = BrokerId(brokers[i % len(brokers)])
                value = ServiceUnitStateData(
                    state=ServiceUnitState.Owned, version_id=1, dst_broker=owner, timestamp_ms=now
                )
                await log.publish(bundle, encode_value(value))

        await asyncio.gather(*(publisher() for _ in range(PUBLISHERS)))
        start = time.perf_counter()
        async with ChannelFollower(PulsarChannelLog(pulsar, topic)) as follower:
            await follower.wait_ready()
            replay_s = time.perf_counter() - start
            await checkpoints.save(EtcdCheckpointStore(conn, options.prefix), follower.table, 1)
    finally:
        await log.close()
        await pulsar.close()
        await conn.close()
    return bundles, replay_s


def _measure(
    root: Path,
    timings: Mapping[str, str],
    etcd_url: str,
    pulsar_url: str,
    real: Sequence[str],
    brokers: int,
    bundles: Sequence[BundleId],
    idle_s: float,
    lookups: int,
) -> dict[str, float]:
    ports = iter(free_ports(2 * len(real)))
    env = settings_env(timings)
    cars = [
        SidecarProcess(
            root / broker,
            broker_id=broker,
            grpc_port=next(ports),
            metrics_port=next(ports),
            cluster=CLUSTER_NAME,
            etcd_endpoint=etcd_url,
            pulsar_url=pulsar_url,
            env=env,
            start_timeout_s=SIDECAR_START_TIMEOUT_S,
        )
        for broker in real
    ]
    sims = [
        SimBrokerProcess(
            car.workdir,
            broker_id=car.broker_id,
            sidecar_addr=car.grpc_addr,
            msg_rate=0.0,
            seed=0,
            env=env,
        )
        for car in cars
    ]
    result: dict[str, float] = {}

    def start(n: int) -> float:
        """Start sidecar ``n`` and, once it serves, its broker: as a cluster's nodes start."""
        began = time.perf_counter()
        cars[n].start()
        took = time.perf_counter() - began
        sims[n].start()
        return took

    try:
        with ThreadPoolExecutor(len(cars)) as pool:
            starts = list(pool.map(start, range(len(cars))))
        result["catch-up: sidecar start (checkpoint), slowest s"] = max(starts)
        _wait_served(sims, brokers, len(bundles), timeout_s=SIDECAR_START_TIMEOUT_S)
        result.update(_idle(cars, idle_s))
        leader = _leader(cars)
        result.update(asyncio.run(_lookups(leader.grpc_addr, bundles, lookups)))
    finally:
        for process in (*sims, *cars):
            process.stop()
    return result


def _wait_served(
    sims: Sequence[SimBrokerProcess], brokers: int, size: int, *, timeout_s: float
) -> None:
    """Until each simulated broker has owned its round-robin share of the filled channel."""
    deadline = time.monotonic() + timeout_s
    for n, sim in enumerate(sims):
        share = len(range(n, size, brokers))
        while _owns(sim.events_path) < share:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{sim.broker_id} owns {_owns(sim.events_path)} of its {share} bundles "
                    f"after {timeout_s:g} s"
                )
            time.sleep(0.2)


def _owns(events: Path) -> int:
    try:
        text = events.read_text(encoding="utf-8")
    except FileNotFoundError:
        return 0
    return text.count('"event": "own"')


_SAMPLE = re.compile(r"^(\w+)(?:\{([^}]*)\})? (\S+)$", re.M)


def _metrics(car: SidecarProcess) -> dict[str, float]:
    """The sidecar's Prometheus samples, keyed ``name{labels}``."""
    with urllib.request.urlopen(f"http://{car.metrics_addr}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {f"{m[1]}{{{m[2]}}}" if m[2] else m[1]: float(m[3]) for m in _SAMPLE.finditer(text)}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


_APPLIED = 'lbd_channel_follower_messages_total{outcome="accepted"}'
_FENCES = "lbd_fence_total"


def _idle(cars: Sequence[SidecarProcess], idle_s: float) -> dict[str, float]:
    """CPU, memory and channel activity of every sidecar over ``idle_s`` seconds."""
    pids = [car.pid for car in cars]
    if None in pids:
        raise RuntimeError("a sidecar stopped before the idle window")
    before = [(_cpu_s(pid), _metrics(car)) for pid, car in zip(pids, cars, strict=True) if pid]
    time.sleep(idle_s)
    after = [(_cpu_s(pid), _metrics(car)) for pid, car in zip(pids, cars, strict=True) if pid]
    cpu = [100 * (a[0] - b[0]) / idle_s for a, b in zip(after, before, strict=True)]
    applied = sum(
        a[1].get(_APPLIED, 0) - b[1].get(_APPLIED, 0) for a, b in zip(after, before, strict=True)
    )
    fences = sum(
        a[1].get(_FENCES, 0) - b[1].get(_FENCES, 0) for a, b in zip(after, before, strict=True)
    )
    rss = [_rss_mib(pid) for pid in pids if pid]
    return {
        "idle: sidecar CPU %, mean": sum(cpu) / len(cpu),
        "idle: sidecar CPU %, max": max(cpu),
        "idle: sidecar RSS MiB, max": max(rss),
        "idle: fences": fences,
        "idle: channel changes applied (all sidecars)": applied,
    }


def _leader(cars: Sequence[SidecarProcess]) -> SidecarProcess:
    for car in cars:
        if _metrics(car).get("lbd_is_leader") == 1:
            return car
    raise RuntimeError("no sidecar says it leads")


async def _lookups(addr: str, bundles: Sequence[BundleId], n: int) -> dict[str, float]:
    rng = random.Random(0)
    workload = Workload(WorkloadSpec(topics_per_bundle=1))
    topics = [workload.topics(rng.choice(bundles))[0] for _ in range(n + WARM_UP)]
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = lbd_pb2_grpc.LoadBalancerStub(channel)

        async def lookup(topic: str) -> None:
            await lookup_owned(stub, topic)

        for topic in topics[:WARM_UP]:  # the connection, and the sidecar's first calls
            await lookup(topic)
        drained = await drain(topics[WARM_UP:], lookup, LOOKUP_CONCURRENCY)
    p50, p99 = cuts(drained.latencies_ms)
    return {"lookup p50 ms": p50, "lookup p99 ms": p99}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scale_bench", description=__doc__)
    parser.add_argument(
        "--sizes", default="1000,10000,100000", help="bundle counts, comma-separated"
    )
    parser.add_argument("--profiles", default="dev,default", help=f"of {', '.join(PROFILES)}")
    parser.add_argument("--brokers", type=int, default=100)
    parser.add_argument("--sidecars", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--lookups", type=int, default=3_000)
    args = parser.parse_args()
    console = Console()
    with console.status("a 100-broker cluster at each size..."):
        result = run(
            sizes=[int(s) for s in args.sizes.split(",")],
            profiles=args.profiles.split(","),
            brokers=args.brokers,
            sidecars=args.sidecars,
            idle_s=args.idle_s,
            lookups=args.lookups,
        )
    console.print(measurements_table("100 brokers: lookups, memory, idle CPU, catch-up", result))
    console.print(figures_table("figures against their baselines", figures(result)))


if __name__ == "__main__":
    main()
