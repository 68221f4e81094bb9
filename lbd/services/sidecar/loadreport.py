"""The load reporter: publishes this broker's load and its busiest bundles (DESIGN §3).

Every ``load_report.interval_s`` it takes the broker's usage — from the broker's latest
``LoadReport`` while a broker is attached, else from the host
(:mod:`lbd.services.sidecar.hostload`) — folds it into the broker's
:class:`~lbd.core.load.BrokerLoadData` (the EMAs) and publishes that on the broker-load topic,
keyed by broker id. Alongside, the ``load_report.top_bundles`` busiest
bundles of the report go on the top-bundles store, which the leader's shedder reads. Readers apply
a TTL, so a sidecar that stops reporting drops out of their view on its own; on close it also
deletes its keys so that they do not wait for the TTL. Each load data also carries what the
leader's safety auditor compares (the table's position and digest, the dead-owner lookups).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from lbd.core.audit import AuditData
from lbd.core.broker_info import LoadReport
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId
from lbd.core.load import (
    BrokerLoadData,
    BrokerUsage,
    BundleLoad,
    ResourceWeights,
    TopBundlesLoadData,
    top_bundles,
)
from lbd.metrics import Metrics
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.ports.history import HistoryRecorder
from lbd.services.cluster.loads import LoadView
from lbd.services.sidecar.broker_link import BrokerLink
from lbd.services.sidecar.hostload import HostLoadSampler
from lbd.tasks import Component, Tasks

_log = logging.getLogger(__name__)


class StaleReportError(Exception):
    """The attached broker has not reported for too long: nothing fresh to publish."""


class UsageSampler(Protocol):
    """Measures the host when no broker reports (:class:`HostLoadSampler`)."""

    def sample(self, now_s: float) -> BrokerUsage:
        """The usage now (``now_s``: monotonic seconds); OSError/InvalidInputError on failure."""
        ...


class LoadReporter(Component):
    """Publishes ``me``'s BrokerLoadData and TopBundlesLoadData periodically."""

    def __init__(
        self,
        me: BrokerId,
        link: BrokerLink,
        loads: LoadView,
        clock: Clock,
        *,
        interval_s: float,
        top_bundles: int,
        metrics: Metrics,
        history: HistoryRecorder,
        weights: ResourceWeights | None = None,
        host: UsageSampler | None = None,
        on_death: Callable[[str, BaseException], None] | None = None,
        stale_after_s: float = 30.0,
        audit: Callable[[], AuditData] | None = None,
    ) -> None:
        """Every ``interval_s`` publish the load and the ``top_bundles`` busiest bundles;
        ``host`` measures the host while no broker reports (default: this machine's /proc);
        ``audit`` gives what each report carries for the safety auditor (None: nothing)."""
        self._me = me
        self._history = history
        self._link = link
        self._loads = loads
        self._clock = clock
        self._interval_s = interval_s
        self._stale_after_s = stale_after_s
        self._top_count = top_bundles
        self._weights = weights or ResourceWeights()
        self._host = host if host is not None else HostLoadSampler()
        self._metrics = metrics
        self._on_death = on_death
        self._audit = audit
        self._data: BrokerLoadData | None = None
        self._tasks = Tasks(f"the load reporter of {me}")
        self._published = False

    @property
    def latest(self) -> BrokerLoadData | None:
        """The load data last computed (None before the first report)."""
        return self._data

    async def start(self) -> None:
        """Report now and then every interval, in a guarded task; returns at once."""
        if not self._tasks:
            self._tasks.spawn(self._run(), name="load-reporter", on_death=self._on_death)

    async def close(self) -> None:
        """Stop reporting and delete this broker's keys (best effort). Idempotent."""
        await self._tasks.close()
        if self._published:
            self._published = False
            with contextlib.suppress(UnavailableError):
                await self._loads.delete(self._me)

    async def report_once(self) -> BrokerLoadData:
        """Measure, update the EMAs and publish both values; the new load data.

        Raises UnavailableError when a store cannot be reached (the EMAs are updated anyway), and
        OSError or InvalidInputError when the host cannot be measured.
        """
        usage, bundles = self._measure()
        now = self._clock.now_ms()
        previous = self._data if self._data is not None else BrokerLoadData(self._me)
        audit = None if self._audit is None else self._audit()
        data = replace(previous.update(usage, self._weights, now), reported_at_ms=now, audit=audit)
        self._data = data
        self._metrics.observe_broker_load(data)
        self._history.record_broker_load(data)
        self._history.record_bundle_loads(self._me, bundles, ts_ms=now)
        top = TopBundlesLoadData(self._me, top_bundles(bundles, self._top_count))
        self._published = True
        await self._loads.publish(data, top)
        return data

    def _measure(self) -> tuple[BrokerUsage, tuple[BundleLoad, ...]]:
        report: LoadReport | None = self._link.latest_report if self._link.attached else None
        if report is not None:
            received = self._link.latest_report_at
            if received is None or self._clock.monotonic() - received > self._stale_after_s:
                raise StaleReportError(
                    f"the broker's latest load report is older than {self._stale_after_s:g}s"
                )
            return report.usage, report.bundles
        # Three small files served from kernel memory: cheaper to read here than to hand to a
        # thread.
        usage = self._host.sample(self._clock.monotonic())
        return replace(usage, bundle_count=self._link.served_count()), ()

    async def _run(self) -> None:
        while True:
            try:
                data = await self.report_once()
            except UnavailableError as e:
                _log.warning("load report not published: %s", e)
            except StaleReportError as e:
                # Not republished as fresh: readers let the old value expire with its TTL.
                _log.warning("load report skipped: %s", e)
            except (OSError, InvalidInputError) as e:
                _log.warning("load report skipped: cannot measure the host: %s", e)
            else:
                _log.debug(
                    "load report: max_ema %.3f, throughput_ema %.0f B/s",
                    data.weighted_max_ema,
                    data.msg_throughput_ema,
                )
            await self._clock.sleep(self._interval_s)
