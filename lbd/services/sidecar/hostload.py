"""This host's resource usage from Linux's ``/proc`` and ``/sys``, for a sidecar with no broker.

When no broker is attached (``broker.auto_ack`` demos, benchmarks) the load reporter still needs a
:class:`~lbd.core.load.BrokerUsage`; this module measures the host instead: CPU as a percentage of
all cores, memory in MB, and network traffic in Mbit/s against the links' speeds. Rates come from
the difference between two samples, so the first sample reports no traffic and the CPU average
since boot. Linux only. The files are small and served from kernel memory, so a sample is cheap
enough to take on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lbd.core.errors import InvalidInputError
from lbd.core.load import BrokerUsage, ResourceUsage

_IDLE_FIELDS = (3, 4)
"""Indexes of ``idle`` and ``iowait`` among the jiffy counters of a ``cpu`` line."""
_COUNTED_FIELDS = 8
"""user nice system idle iowait irq softirq steal: guest time is already inside user/nice."""


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Jiffies spent busy and in total, summed over every core since boot."""

    busy: int
    total: int


@dataclass(frozen=True, slots=True)
class NetBytes:
    """Bytes received and sent by every interface but loopback since boot."""

    received: int
    sent: int


def parse_cpu(stat_text: str) -> CpuTimes:
    """The aggregate ``cpu`` line of ``/proc/stat``."""
    for line in stat_text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            try:
                values = [int(v) for v in parts[1 : 1 + _COUNTED_FIELDS]]
            except ValueError:
                raise InvalidInputError(f"/proc/stat: bad cpu line {line!r}") from None
            idle = sum(values[i] for i in _IDLE_FIELDS if i < len(values))
            total = sum(values)
            return CpuTimes(busy=total - idle, total=total)
    raise InvalidInputError("/proc/stat: no aggregate 'cpu' line")


def parse_meminfo(meminfo_text: str) -> ResourceUsage:
    """Memory in use and in total, in MB, from ``/proc/meminfo`` (in use = total - available)."""
    kb: dict[str, int] = {}
    for line in meminfo_text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            kb[name.strip()] = int(fields[0])
    for required in ("MemTotal", "MemAvailable"):
        if required not in kb:
            raise InvalidInputError(f"/proc/meminfo: no {required} line")
    used = kb["MemTotal"] - kb["MemAvailable"]
    return ResourceUsage(usage=used / 1024.0, limit=kb["MemTotal"] / 1024.0)


def parse_net_dev(net_dev_text: str) -> NetBytes:
    """Bytes received and sent by every interface of ``/proc/net/dev`` except ``lo``."""
    received = sent = 0
    for line in net_dev_text.splitlines()[2:]:  # two header lines
        name, sep, rest = line.partition(":")
        fields = rest.split()
        if not sep or name.strip() == "lo":
            continue
        if len(fields) < 9:
            raise InvalidInputError(f"/proc/net/dev: short line for {name.strip()!r}")
        received += int(fields[0])
        sent += int(fields[8])
    return NetBytes(received, sent)


class HostLoadSampler:
    """Measures the host's usage; keeps the previous counters to turn them into rates."""

    def __init__(self, proc: Path = Path("/proc"), sys_net: Path = Path("/sys/class/net")) -> None:
        self._proc = proc
        self._sys_net = sys_net
        self._last: tuple[float, CpuTimes, NetBytes] | None = None

    def sample(self, now_s: float) -> BrokerUsage:
        """The host's usage now (``now_s``: a monotonic time, to compute rates).

        Raises OSError when a file cannot be read and InvalidInputError when one is malformed.
        """
        cpu = parse_cpu((self._proc / "stat").read_text())
        memory = parse_meminfo((self._proc / "meminfo").read_text())
        net = parse_net_dev((self._proc / "net" / "dev").read_text())
        link_mbit = self._link_speed_mbit()
        last, self._last = self._last, (now_s, cpu, net)
        if last is None:
            busy, total, rx_mbit, tx_mbit = cpu.busy, cpu.total, 0.0, 0.0
        else:
            last_s, last_cpu, last_net = last
            busy, total = cpu.busy - last_cpu.busy, cpu.total - last_cpu.total
            elapsed = max(now_s - last_s, 1e-9)
            rx_mbit = max(net.received - last_net.received, 0) * 8 / 1e6 / elapsed
            tx_mbit = max(net.sent - last_net.sent, 0) * 8 / 1e6 / elapsed
        cpu_percent = 100.0 * busy / total if total > 0 else 0.0
        return BrokerUsage(
            cpu=ResourceUsage(usage=cpu_percent, limit=100.0),
            memory=memory,
            bandwidth_in=ResourceUsage(usage=rx_mbit, limit=link_mbit),
            bandwidth_out=ResourceUsage(usage=tx_mbit, limit=link_mbit),
        )

    def _link_speed_mbit(self) -> float:
        """Sum of the known link speeds (virtual links report none: their usage is unbounded)."""
        total = 0.0
        try:
            links = [p for p in self._sys_net.iterdir() if p.name != "lo"]
        except OSError:
            return 0.0
        for link in links:
            try:
                speed = int((link / "speed").read_text().strip())
            except (OSError, ValueError):
                continue
            if speed > 0:
                total += speed
        return total
