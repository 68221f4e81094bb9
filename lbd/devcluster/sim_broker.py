"""A simulated broker: holds a ``BrokerSession`` with its sidecar and does what it is told.

It runs on the broker-side library (:class:`lbd.broker.BrokerClient`), which keeps the session,
the serving lease and the acks: it says Hello with a synthetic :class:`BrokerInfo`, serves the
bundles it is told to ``Own``, stops serving them on ``Release`` and ``Close``, and sends a load
report every ``report_interval_s`` computed by a :class:`~lbd.workload.traffic.Workload` from the
bundles it serves. When its session ends or its lease runs out it stops serving everything and
forgets it; it reconnects with a capped exponential backoff, and on the new session the sidecar
sends ``Own`` again for what the broker still owns.

With an :class:`~lbd.broker.events.EventLog` every change of what it serves is appended as one
JSON line stamped with ``time.monotonic_ns()``, the same clock for every process on a host, so
tests can check that no two brokers ever served a bundle at the same time.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from lbd import __version__
from lbd.broker import BrokerClient, NewOwner
from lbd.broker.client import check_address
from lbd.broker.credentials import INSECURE, ClientCredentials
from lbd.broker.events import EventLog, RecordingHandler
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BundleId
from lbd.core.load import ResourceUsage
from lbd.gen.v1 import lbd_pb2
from lbd.workload.traffic import BrokerSample, BundleTraffic, Workload

_log = logging.getLogger(__name__)

TOP_TOPICS_PER_BUNDLE = 10
"""Per-topic stats sent per bundle, the busiest first (the proto field is optional detail)."""


@dataclass(frozen=True, slots=True)
class SimBrokerConfig:
    """Who the simulated broker is and how it talks to its sidecar."""

    sidecar: str
    """The sidecar's gRPC address, HOST:PORT."""
    broker_id: str
    report_interval_s: float = 1.0
    reconnect_min_s: float = 0.1
    reconnect_max_s: float = 2.0
    credentials: ClientCredentials = INSECURE
    """TLS files and token; the certificate's or token's name must be ``broker_id``."""

    def __post_init__(self) -> None:
        check_address(self.sidecar)
        if not self.broker_id:
            raise InvalidInputError("broker id must not be empty")
        if self.report_interval_s <= 0:
            raise InvalidInputError(
                f"report interval must be > 0 seconds, got {self.report_interval_s}"
            )

    def info(self, start_time_ms: int) -> lbd_pb2.BrokerInfo:
        """The Hello of this broker: synthetic URLs that name the broker and resolve nowhere."""
        host = f"{self.broker_id}.sim.invalid"
        return lbd_pb2.BrokerInfo(
            broker_id=self.broker_id,
            service_url=f"pulsar://{host}:6650",
            service_url_tls=f"pulsar+ssl://{host}:6651",
            web_service_url=f"http://{host}:8080",
            version=f"lbd-sim/{__version__}",
            start_time_ms=start_time_ms,
            sidecar_grpc_addr=self.sidecar,
        )


class SimBroker(RecordingHandler):
    """The simulated broker's state (what it was told to serve) and its event log; the
    :class:`BrokerClient` it runs on calls it back."""

    def __init__(
        self, config: SimBrokerConfig, workload: Workload, events: EventLog | None = None
    ) -> None:
        super().__init__(events)
        self._workload = workload
        self._served: set[BundleId] = set()
        self._reports = 0
        self._made: dict[BundleId, tuple[BundleTraffic, lbd_pb2.BundleStats]] = {}
        """Each served bundle's stats in the last report (reused while its traffic is steady)."""
        self._client = BrokerClient(
            config.sidecar,
            config.info(int(time.time() * 1000)),
            self,
            report_interval_s=config.report_interval_s,
            reconnect_min_s=config.reconnect_min_s,
            reconnect_max_s=config.reconnect_max_s,
            credentials=config.credentials,
        )

    @property
    def served(self) -> frozenset[BundleId]:
        """The bundles this broker was told to serve (it serves them while its lease is valid)."""
        return frozenset(self._served)

    @property
    def sessions(self) -> int:
        """How many sessions were opened so far."""
        return self._client.sessions

    async def run(self) -> None:
        """Hold a session with the sidecar, reconnecting whenever it drops, until cancelled."""
        await self._client.run()

    async def own(self, bundle: BundleId) -> str | None:
        """Serve ``bundle`` from now (while the lease is valid)."""
        if bundle not in self._served:
            self._workload.prepare(bundle)
            self._served.add(bundle)
            self.record("own", bundle)
        return None

    async def release(self, bundle: BundleId, new_owner: NewOwner | None) -> str | None:
        """Stop serving ``bundle``; it went to ``new_owner``."""
        if bundle in self._served:
            self._served.discard(bundle)
            owner = new_owner.broker_id if new_owner is not None else ""
            self.record("release", bundle, new_owner=owner)
        return None

    async def close(self, bundle: BundleId, reason: str) -> str | None:
        """Stop serving ``bundle``."""
        if bundle in self._served:
            self._served.discard(bundle)
            self.record("close", bundle, reason=reason)
        return None

    def stop_all(self, reason: str) -> None:
        """Stop serving everything, one ``close`` event per bundle."""
        for bundle in sorted(self._served):
            self.record("close", bundle, reason=reason)
        if self._served:
            _log.info("stopped serving %d bundles: %s", len(self._served), reason)
        self._served.clear()

    def load_report(self) -> lbd_pb2.LoadReport:
        """The workload's sample of the bundles served."""
        self._reports += 1
        return load_report(self._workload.sample(self._served, self._reports), self._made)


def load_report(
    sample: BrokerSample,
    made: dict[BundleId, tuple[BundleTraffic, lbd_pb2.BundleStats]] | None = None,
) -> lbd_pb2.LoadReport:
    """The protobuf LoadReport of a workload sample.

    ``made``: the stats made for the previous report, reused for each bundle whose traffic is
    the very same object (the workload's steady bundles); replaced by this report's.
    """
    previous = made.copy() if made is not None else {}
    if made is not None:
        made.clear()
    stats = []
    for b in sample.bundles:
        hit = previous.get(b.bundle)
        one = hit[1] if hit is not None and hit[0] is b else _bundle_stats(b)
        if made is not None:
            made[b.bundle] = (b, one)
        stats.append(one)
    return lbd_pb2.LoadReport(
        cpu=_usage(sample.cpu),
        memory=_usage(sample.memory),
        direct_memory=_usage(sample.direct_memory),
        bandwidth_in=_usage(sample.bandwidth_in),
        bandwidth_out=_usage(sample.bandwidth_out),
        bundles=stats,
    )


def _bundle_stats(b: BundleTraffic) -> lbd_pb2.BundleStats:
    return lbd_pb2.BundleStats(
        bundle=b.bundle,
        msg_rate_in=b.msg_rate_in,
        msg_rate_out=b.msg_rate_out,
        msg_throughput_in=b.throughput_in,
        msg_throughput_out=b.throughput_out,
        topics=len(b.topics),
        producer_count=b.producers,
        consumer_count=b.consumers,
        topic_stats=[
            lbd_pb2.TopicStats(topic=t.topic, msg_rate=t.msg_rate, msg_throughput=t.throughput)
            for t in b.topics[:TOP_TOPICS_PER_BUNDLE]
        ],
    )


def _usage(u: ResourceUsage) -> lbd_pb2.ResourceUsage:
    return lbd_pb2.ResourceUsage(usage=u.usage, limit=u.limit)


async def run_sim_broker(config: SimBrokerConfig, workload: Workload, events: Path | None) -> None:
    """Run a simulated broker until cancelled, logging its events to ``events`` if given."""
    log = EventLog(events, config.broker_id) if events is not None else None
    try:
        await SimBroker(config, workload, log).run()
    finally:
        if log is not None:
            with contextlib.suppress(OSError):
                log.close()
