"""A simulated broker: holds a ``BrokerSession`` with its sidecar and does what it is told.

It says Hello with a synthetic :class:`BrokerInfo`, serves the bundles it is told to ``Own``,
stops serving them on ``Release`` and ``Close`` (acknowledging every command), and sends a load
report every ``report_interval_s`` computed by a :class:`~lbd.sim.workload.Workload` from the
bundles it serves. It holds the serving lease of the broker contract (:mod:`lbd.core.lease`):
it asks right after Hello and then every quarter of the duration granted, serves only while the
lease is valid, and when the lease runs out it stops serving everything and forgets it, like a
broker whose session dropped -- a broker cut off from its sidecar cannot know whether its bundles
were handed to someone else. It reconnects with a capped exponential backoff; on the new session
the sidecar sends ``Own`` again for what the broker still owns.

With an :class:`EventLog` every change of what it serves is appended as one JSON line stamped
with ``time.monotonic_ns()``, the same clock for every process on a host, so tests can check that
no two brokers ever served a bundle at the same time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import grpc

from lbd import __version__
from lbd.core.broker import ServingLease
from lbd.core.bundles import parse_bundle_id
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BundleId
from lbd.core.lease import BrokerLease
from lbd.core.load import ResourceUsage
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from lbd.sim.workload import BrokerSample, Workload
from lbd.tasks import cancel_and_wait, guard

_log = logging.getLogger(__name__)

FIRST_LEASE_RETRY_S = 0.25
"""How often the broker asks for a lease while it has been granted none in this session."""

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

    def __post_init__(self) -> None:
        host, sep, port = self.sidecar.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise InvalidInputError(f"sidecar address must be HOST:PORT, got {self.sidecar!r}")
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


class EventLog:
    """Appends ``{"t_ns", "event", "bundle", "broker", ...}`` JSON lines to a file.

    Events: ``own``, ``release`` and ``close`` (the broker was told to serve ``bundle``, or
    stopped), ``session`` (``detail`` ``open`` or ``lost``, ``bundle`` null), ``lease`` (a grant:
    the lease is valid until ``until_ns``, same clock; ``bundle`` null). A broker serves a bundle
    from its ``own`` until the earlier of its ``close`` and the end of its lease. Each line is
    flushed at once so another process reads it as soon as the broker acted.
    """

    def __init__(self, path: Path, broker_id: str) -> None:
        self._broker_id = broker_id
        self._file: IO[str] = path.open("a", encoding="utf-8")

    def record(self, event: str, bundle: str | None, **detail: str) -> None:
        """Append one event, stamped now."""
        line = {
            "t_ns": time.monotonic_ns(),
            "event": event,
            "bundle": bundle,
            "broker": self._broker_id,
            **detail,
        }
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file; idempotent."""
        self._file.close()


class SimBroker:
    """The simulated broker's state (what it serves) and its session loop (:meth:`run`)."""

    def __init__(
        self, config: SimBrokerConfig, workload: Workload, events: EventLog | None = None
    ) -> None:
        self._config = config
        self._workload = workload
        self._events = events
        self._served: set[BundleId] = set()
        self._start_time_ms = int(time.time() * 1000)
        self._sessions = 0
        self._reports = 0
        self._lease_duration_s = 0.0
        self.connected = asyncio.Event()
        """Set while a session is open."""

    @property
    def served(self) -> frozenset[BundleId]:
        """The bundles this broker serves now."""
        return frozenset(self._served)

    @property
    def sessions(self) -> int:
        """How many sessions were opened so far."""
        return self._sessions

    async def run(self) -> None:
        """Hold a session with the sidecar, reconnecting whenever it drops, until cancelled."""
        delay = self._config.reconnect_min_s
        async with grpc.aio.insecure_channel(self._config.sidecar) as channel:
            stub = lbd_pb2_grpc.LoadBalancerStub(channel)
            try:
                while True:
                    started = time.monotonic()
                    opened = await self._session(stub)
                    # Only a session that lasted resets the backoff: one the sidecar drops at
                    # once must not turn into a tight reconnect loop.
                    if opened and time.monotonic() - started >= self._config.reconnect_max_s:
                        delay = self._config.reconnect_min_s
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self._config.reconnect_max_s)
            finally:
                self._stop_serving("broker stopping")

    async def _session(self, stub: lbd_pb2_grpc.LoadBalancerStub) -> bool:
        """One session, until it ends; True when it was opened at all."""
        outbox: asyncio.Queue[lbd_pb2.BrokerMessage | None] = asyncio.Queue()
        outbox.put_nowait(lbd_pb2.BrokerMessage(hello=self._config.info(self._start_time_ms)))
        call = stub.BrokerSession(_drain(outbox))
        reporter: asyncio.Task[None] | None = None
        leasing: asyncio.Task[None] | None = None
        lease = BrokerLease()
        opened = False
        try:
            await call.wait_for_connection()
            opened = True
            self._sessions += 1
            self.connected.set()
            _log.info("session %d with sidecar %s open", self._sessions, self._config.sidecar)
            self._record("session", None, detail="open")
            reporter = guard(self._report_loop(outbox), name="sim-broker-load-reports")
            granted = asyncio.Event()
            leasing = guard(self._lease_loop(lease, granted, outbox), name="sim-broker-lease")
            async for command in call:
                if command.WhichOneof("kind") == "lease":
                    self._granted(lease, command.lease, granted)
                    continue
                outbox.put_nowait(lbd_pb2.BrokerMessage(ack=self._apply(command)))
            _log.warning("sidecar %s ended the session", self._config.sidecar)
        except grpc.aio.AioRpcError as e:
            if opened:
                _log.warning(
                    "session with sidecar %s lost: %s %s",
                    self._config.sidecar,
                    e.code().name,
                    e.details(),
                )
            else:
                _log.debug("sidecar %s unreachable: %s", self._config.sidecar, e.code().name)
        finally:
            for task in (leasing, reporter):
                if task is not None:
                    task.cancel()  # both at once: the first wait may be cut short by our own
            await cancel_and_wait(leasing)
            await cancel_and_wait(reporter)
            # Ends the request stream: grpc's task writing it would otherwise wait forever when
            # the server ended the call first (cancel() does not stop it then).
            outbox.put_nowait(None)
            call.cancel()
            if opened:
                self.connected.clear()
                self._record("session", None, detail="lost")
                self._stop_serving("session lost")
        return opened

    def _granted(
        self, lease: BrokerLease, msg: lbd_pb2.ServingLease, granted: asyncio.Event
    ) -> None:
        """Take a lease grant; a stale one (its request was sent too long ago) extends nothing."""
        grant = ServingLease(msg.sequence, msg.duration_ms)
        if lease.grant(grant, time.monotonic()) and lease.valid_until is not None:
            self._lease_duration_s = grant.duration_ms / 1000
            self._record("lease", None, until_ns=str(round(lease.valid_until * 1e9)))
            granted.set()

    async def _lease_loop(
        self,
        lease: BrokerLease,
        granted: asyncio.Event,
        outbox: asyncio.Queue[lbd_pb2.BrokerMessage | None],
    ) -> None:
        """Ask for the lease now and every quarter of its duration; stop serving when it runs
        out before a renewal arrived."""
        while True:
            request = lease.request(time.monotonic())
            outbox.put_nowait(
                lbd_pb2.BrokerMessage(
                    lease_request=lbd_pb2.LeaseRequest(
                        sequence=request.sequence, lapses=request.lapses
                    )
                )
            )
            pause = self._lease_duration_s / 4 if self._lease_duration_s else FIRST_LEASE_RETRY_S
            granted.clear()
            deadline = time.monotonic() + pause
            while (now := time.monotonic()) < deadline:
                until = lease.valid_until
                wait = deadline - now if until is None else min(deadline, until) - now
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(granted.wait(), timeout=max(wait, 0.0))
                granted.clear()
                if lease.lapse_if_due(time.monotonic()):
                    _log.warning("serving lease ran out; stopping every bundle")
                    self._stop_serving("serving lease ran out")

    def _apply(self, command: lbd_pb2.SidecarMessage) -> lbd_pb2.CommandAck:
        kind = command.WhichOneof("kind")
        ack = lbd_pb2.CommandAck(command_id=command.command_id, ok=True)
        if kind is None:
            ack.ok, ack.error = False, "empty command"
            return ack
        bundle_text: str = getattr(command, kind).bundle
        try:
            bundle = parse_bundle_id(bundle_text).id
        except InvalidInputError as e:
            ack.ok, ack.error = False, str(e)
            return ack
        if kind == "own":
            if bundle not in self._served:
                self._served.add(bundle)
                self._record("own", bundle)
        elif bundle in self._served:
            self._served.discard(bundle)
            if kind == "release":
                self._record("release", bundle, new_owner=command.release.new_owner_broker_id)
            else:
                self._record("close", bundle, reason=command.close.reason)
        _log.info("%s %s (serving %d bundles)", kind, bundle, len(self._served))
        return ack

    def _stop_serving(self, reason: str) -> None:
        for bundle in sorted(self._served):
            self._record("close", bundle, reason=reason)
        if self._served:
            _log.info("stopped serving %d bundles: %s", len(self._served), reason)
        self._served.clear()

    def _record(self, event: str, bundle: str | None, **detail: str) -> None:
        if self._events is not None:
            self._events.record(event, bundle, **detail)

    async def _report_loop(self, outbox: asyncio.Queue[lbd_pb2.BrokerMessage | None]) -> None:
        while True:
            self._reports += 1
            sample = self._workload.sample(self._served, self._reports)
            outbox.put_nowait(lbd_pb2.BrokerMessage(load=load_report(sample)))
            await asyncio.sleep(self._config.report_interval_s)


def load_report(sample: BrokerSample) -> lbd_pb2.LoadReport:
    """The protobuf LoadReport of a workload sample."""
    return lbd_pb2.LoadReport(
        cpu=_usage(sample.cpu),
        memory=_usage(sample.memory),
        direct_memory=_usage(sample.direct_memory),
        bandwidth_in=_usage(sample.bandwidth_in),
        bandwidth_out=_usage(sample.bandwidth_out),
        bundles=[
            lbd_pb2.BundleStats(
                bundle=b.bundle,
                msg_rate_in=b.msg_rate_in,
                msg_rate_out=b.msg_rate_out,
                msg_throughput_in=b.throughput_in,
                msg_throughput_out=b.throughput_out,
                topics=len(b.topics),
                producer_count=b.producers,
                consumer_count=b.consumers,
                topic_stats=[
                    lbd_pb2.TopicStats(
                        topic=t.topic, msg_rate=t.msg_rate, msg_throughput=t.throughput
                    )
                    for t in b.topics[:TOP_TOPICS_PER_BUNDLE]
                ],
            )
            for b in sample.bundles
        ],
    )


def _usage(u: ResourceUsage) -> lbd_pb2.ResourceUsage:
    return lbd_pb2.ResourceUsage(usage=u.usage, limit=u.limit)


async def _drain(
    outbox: asyncio.Queue[lbd_pb2.BrokerMessage | None],
) -> AsyncIterator[lbd_pb2.BrokerMessage]:
    """The request stream of a session: whatever is put in the outbox, in order, until None."""
    while (message := await outbox.get()) is not None:
        yield message


async def run_sim_broker(config: SimBrokerConfig, workload: Workload, events: Path | None) -> None:
    """Run a simulated broker until cancelled, logging its events to ``events`` if given."""
    log = EventLog(events, config.broker_id) if events is not None else None
    try:
        await SimBroker(config, workload, log).run()
    finally:
        if log is not None:
            with contextlib.suppress(OSError):
                log.close()
