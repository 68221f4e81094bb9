"""The broker's resource usage for its load reports: CPU and memory of the host or of the front's
own process, and the bandwidth its clients use.

In production one broker runs per host, and the host's CPU and memory are its load (``host``).
On a dev cluster every broker shares one host, whose CPU says nothing about any one of them:
there each front reports its own process (``process``): its CPU time over the interval as a
share of all cores, its resident memory against the host's. Bandwidth is always the clients'
traffic through this front (messages in and out, in Mbit/s) against the configured link
capacity: on loopback the host's interfaces see none of it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from lbd.core.load import ResourceUsage
from lbd.gen.v1 import lbd_pb2
from lbd.services.sidecar.hostload import HostLoadSampler, parse_meminfo

UsageSource = Literal["host", "process"]


def _usage(u: ResourceUsage) -> lbd_pb2.ResourceUsage:
    return lbd_pb2.ResourceUsage(usage=u.usage, limit=u.limit)


class UsageSampler:
    """Samples usage at each load report; rates are over the time since the previous one."""

    def __init__(
        self,
        source: UsageSource,
        bandwidth_limit_mbit: float,
        *,
        proc: Path = Path("/proc"),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._source = source
        self._limit_mbit = bandwidth_limit_mbit
        self._proc = proc
        self._clock = clock
        self._host = HostLoadSampler(proc)
        self._cpus = os.cpu_count() or 1
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._last: tuple[float, float, int, int] | None = None
        """Time, process CPU seconds, bytes in and bytes out at the previous sample."""

    def sample(self, bytes_in: int, bytes_out: int) -> lbd_pb2.LoadReport:
        """A load report with usage only (the caller adds the bundles); ``bytes_in`` and
        ``bytes_out``: the front's running totals of client traffic."""
        now = self._clock()
        times = os.times()
        cpu_s = times.user + times.system
        last, self._last = self._last, (now, cpu_s, bytes_in, bytes_out)
        elapsed = max(now - last[0], 1e-3) if last is not None else 0.0
        rx = (bytes_in - last[2]) * 8 / 1e6 / elapsed if last is not None else 0.0
        tx = (bytes_out - last[3]) * 8 / 1e6 / elapsed if last is not None else 0.0
        report = lbd_pb2.LoadReport(
            bandwidth_in=lbd_pb2.ResourceUsage(usage=max(rx, 0.0), limit=self._limit_mbit),
            bandwidth_out=lbd_pb2.ResourceUsage(usage=max(tx, 0.0), limit=self._limit_mbit),
        )
        if self._source == "host":
            host = self._host.sample(now)
            report.cpu.CopyFrom(_usage(host.cpu))
            report.memory.CopyFrom(_usage(host.memory))
        else:
            busy = (cpu_s - last[1]) / elapsed / self._cpus * 100 if last is not None else 0.0
            report.cpu.CopyFrom(lbd_pb2.ResourceUsage(usage=max(busy, 0.0), limit=100.0))
            total = parse_meminfo((self._proc / "meminfo").read_text())
            rss_pages = int((self._proc / "self" / "statm").read_text().split()[1])
            report.memory.CopyFrom(
                lbd_pb2.ResourceUsage(usage=rss_pages * self._page / 2**20, limit=total.limit)
            )
        return report
