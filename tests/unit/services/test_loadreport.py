"""The load reporter: EMAs, top bundles, the TTL of readers, and the host fallback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from rig import turns

from lbd.adapters.clock import ManualClock
from lbd.adapters.memory.loadstore import MemoryLoadStore, MemoryLoadTopic
from lbd.core.broker_info import BrokerInfo, BrokerMessage, Hello, LoadReport
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import (
    BrokerLoadData,
    BrokerUsage,
    BundleLoad,
    ResourceUsage,
    TopBundlesLoadData,
    top_bundles,
)
from lbd.core.settings import SidecarConfig
from lbd.metrics import Metrics
from lbd.ports.history import NoHistory
from lbd.services.cluster.loads import LoadView
from lbd.services.sidecar.broker_link import BrokerLink
from lbd.services.sidecar.hostload import HostLoadSampler, parse_cpu, parse_meminfo, parse_net_dev
from lbd.services.sidecar.loadreport import LoadReporter, StaleReportError

ME = BrokerId("broker-a")
TTL_MS = 30_000
SETTINGS = SidecarConfig(load_report_interval_s=10.0, top_bundles_per_report=2)


def bundle(i: int) -> BundleId:
    return BundleId(f"public/default/0x{i:08x}_0x{i + 1:08x}")


def cpu(percent: float, bundles: tuple[BundleLoad, ...] = ()) -> LoadReport:
    return LoadReport(usage=BrokerUsage(cpu=ResourceUsage(percent, 100.0)), bundles=bundles)


class FakeSampler:
    """A host that reports what the test says."""

    def __init__(self, usage: BrokerUsage) -> None:
        self.usage = usage
        self.calls = 0

    def sample(self, now_s: float) -> BrokerUsage:
        self.calls += 1
        return self.usage


@contextlib.asynccontextmanager
async def attached_broker(link: BrokerLink) -> AsyncIterator[asyncio.Queue[BrokerMessage]]:
    """A broker session on ``link``; put LoadReports on the yielded queue."""
    inbox: asyncio.Queue[BrokerMessage] = asyncio.Queue()
    inbox.put_nowait(Hello(BrokerInfo(ME)))

    async def incoming() -> AsyncIterator[BrokerMessage]:
        while True:
            yield await inbox.get()

    async def run() -> None:
        async for _ in link.session(incoming()):
            pass

    task = asyncio.create_task(run())
    await turns(lambda: link.attached)
    try:
        yield inbox
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def delivered(inbox: asyncio.Queue[BrokerMessage], link: BrokerLink, report: LoadReport):
    inbox.put_nowait(report)
    await turns(lambda: link.latest_report is report)


class Rig:
    def __init__(self, clock: ManualClock, sampler: FakeSampler | None = None) -> None:
        self.clock = clock
        self.loads, self.tops = MemoryLoadTopic(), MemoryLoadTopic()
        self.link = BrokerLink(
            ME, auto_ack=False, own_ack_timeout_s=1.0, release_ack_timeout_s=1.0, clock=clock
        )
        self.metrics = Metrics()
        self.sampler = sampler or FakeSampler(BrokerUsage())
        self.reporter = LoadReporter(
            ME,
            self.link,
            LoadView(
                MemoryLoadStore(self.loads, clock),
                MemoryLoadStore(self.tops, clock),
                clock,
                ttl_s=1800,
            ),
            clock,
            interval_s=SETTINGS.load_report_interval_s,
            top_bundles=SETTINGS.top_bundles_per_report,
            host=self.sampler,
            metrics=self.metrics,
            history=NoHistory(),
        )
        # What another sidecar (the leader) reads.
        self.load_reader = MemoryLoadStore(self.loads, clock)
        self.top_reader = MemoryLoadStore(self.tops, clock)

    async def start_readers(self) -> None:
        await self.load_reader.start()
        await self.top_reader.start()

    def seen_load(self) -> BrokerLoadData | None:
        raw = self.load_reader.latest(self.clock.now_ms(), TTL_MS).get(ME)
        return None if raw is None else BrokerLoadData.from_json(raw)

    def seen_top(self) -> TopBundlesLoadData | None:
        raw = self.top_reader.latest(self.clock.now_ms(), TTL_MS).get(ME)
        return None if raw is None else TopBundlesLoadData.from_json(raw)


async def test_broker_reports_are_smoothed_and_published_with_the_busiest_bundles() -> None:
    clock = ManualClock()
    rig = Rig(clock)
    await rig.start_readers()
    loads = (
        BundleLoad(bundle(1), msg_throughput_in=10),
        BundleLoad(bundle(2), msg_throughput_in=300),
        BundleLoad(bundle(3), msg_throughput_in=20, msg_throughput_out=200),
    )
    async with attached_broker(rig.link) as inbox:
        await delivered(inbox, rig.link, cpu(50.0, loads))
        first = await rig.reporter.report_once()
        assert first.weighted_max_ema == pytest.approx(0.5)  # the first sample as is
        clock.advance(10)
        await delivered(inbox, rig.link, cpu(100.0))
        second = await rig.reporter.report_once()

    assert second.weighted_max_ema == pytest.approx(0.9 * 0.5 + 0.1 * 1.0)
    assert second.max_resource_usage == pytest.approx(1.0)
    assert rig.sampler.calls == 0
    seen = rig.seen_load()
    assert seen is not None and seen == second
    assert seen.updated_at_ms == seen.reported_at_ms == clock.now_ms()
    top = rig.seen_top()
    assert top is not None and top.bundles == ()  # the second report had no bundles
    assert rig.metrics.resource_usage.labels(feature="max_ema")._value.get() == pytest.approx(
        second.weighted_max_ema
    )


def test_top_bundles_are_the_busiest_first() -> None:
    loads = (
        BundleLoad(bundle(1), msg_throughput_in=10),
        BundleLoad(bundle(2), msg_throughput_in=300),
        BundleLoad(bundle(3), msg_throughput_in=20, msg_throughput_out=200),
    )
    assert [b.bundle for b in top_bundles(loads, 2)] == [bundle(2), bundle(3)]


async def test_readers_drop_a_broker_that_stopped_reporting_after_the_ttl() -> None:
    clock = ManualClock()
    rig = Rig(clock, FakeSampler(BrokerUsage(cpu=ResourceUsage(30.0, 100.0))))
    await rig.start_readers()
    async with rig.reporter:
        await clock.run_for(0.1)
        first = rig.seen_load()
        assert first is not None and first.weighted_max_ema == pytest.approx(0.3)
        await clock.run_for(SETTINGS.load_report_interval_s)
        again = rig.seen_load()
        assert again is not None and again.updated_at_ms > first.updated_at_ms

        rig.loads.go_down()  # publishing fails from now on; the reporter keeps trying
        await clock.run_for(TTL_MS / 1000 - 1)
        assert rig.seen_load() is not None
        await clock.run_for(2)
        assert rig.seen_load() is None
        rig.loads.come_back()
        await clock.run_for(SETTINGS.load_report_interval_s)
        assert rig.seen_load() is not None


async def test_without_a_broker_the_host_is_measured_and_close_deletes_the_keys() -> None:
    clock = ManualClock()
    usage = BrokerUsage(memory=ResourceUsage(700.0, 1000.0))
    rig = Rig(clock, FakeSampler(usage))
    await rig.start_readers()
    # A report from a broker that has since gone is not used.
    rig.link.latest_report = cpu(99.0)
    data = await rig.reporter.report_once()
    assert rig.sampler.calls == 1
    assert data.weighted_max_ema == pytest.approx(0.7)
    assert rig.seen_load() is not None and rig.seen_top() is not None
    await rig.reporter.close()
    assert rig.seen_load() is None and rig.seen_top() is None


def test_host_files_are_parsed(tmp_path: Path) -> None:
    stat = "cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 50 0 50 350 50 0 0 0 0 0\n"
    assert parse_cpu(stat).busy == 200 and parse_cpu(stat).total == 1000
    meminfo = "MemTotal:       2048000 kB\nMemFree:  100 kB\nMemAvailable:   1024000 kB\n"
    memory = parse_meminfo(meminfo)
    assert memory.limit == pytest.approx(2000.0) and memory.usage == pytest.approx(1000.0)
    net = (
        "Inter-|   Receive |  Transmit\n face |bytes packets ...\n"
        "    lo: 999 1 0 0 0 0 0 0 999 1 0 0 0 0 0 0\n"
        "  eth0: 1000 1 0 0 0 0 0 0 2000 1 0 0 0 0 0 0\n"
    )
    assert parse_net_dev(net).received == 1000 and parse_net_dev(net).sent == 2000

    proc, sys_net = tmp_path / "proc", tmp_path / "net"
    (proc / "net").mkdir(parents=True)
    (sys_net / "eth0").mkdir(parents=True)
    (sys_net / "eth0" / "speed").write_text("1000\n")
    (proc / "stat").write_text(stat)
    (proc / "meminfo").write_text(meminfo)
    (proc / "net" / "dev").write_text(net)
    sampler = HostLoadSampler(proc, sys_net)
    assert sampler.sample(0.0).cpu.usage == pytest.approx(20.0)
    (proc / "stat").write_text("cpu  400 0 100 1200 100 0 0 0 0 0\n")  # +300 busy of +800
    net_later = net.replace("eth0: 1000", "eth0: 1250001000")  # +1.25 GB in 10 s = 1000 Mbit/s
    (proc / "net" / "dev").write_text(net_later)
    later = sampler.sample(10.0)
    assert later.cpu.usage == pytest.approx(300 / 800 * 100)
    assert later.bandwidth_in.usage == pytest.approx(1000.0)
    assert later.bandwidth_in.percent() == pytest.approx(100.0)


def test_a_malformed_host_file_is_named() -> None:
    with pytest.raises(InvalidInputError, match="MemAvailable"):
        parse_meminfo("MemTotal: 10 kB\n")
    with pytest.raises(InvalidInputError, match="cpu"):
        parse_cpu("intr 1 2 3\n")


async def test_a_silent_brokers_last_report_is_not_published_as_fresh() -> None:
    clock = ManualClock()
    rig = Rig(clock)
    await rig.start_readers()
    async with attached_broker(rig.link) as inbox:
        await delivered(inbox, rig.link, cpu(50.0, ()))
        await rig.reporter.report_once()
        published = rig.seen_load()
        assert published is not None
        await clock.run_for(31)  # the broker says nothing more (paused, stuck)
        with pytest.raises(StaleReportError, match="older than 30s"):
            await rig.reporter.report_once()
        # Nothing new was published: the old value stands, and readers let it expire.
        raw = rig.load_reader.latest(clock.now_ms(), 10**9)[ME]
        assert BrokerLoadData.from_json(raw) == published
        assert rig.seen_load() is None
