"""The history port: where a sidecar records load samples and decisions for later analysis.

The implementation is :class:`lbd.history.HistorySink` (Parquet through pyarrow). Every method
returns at once and never raises: recording is best effort and must never slow down or break the
decision it records (a full buffer drops its oldest rows and counts them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BundleLoad
from lbd.core.shedding import LoadSnapshot, SheddingResult


class HistoryRecorder(Protocol):
    """Records samples and decisions (DESIGN §10's decisions, with their reason)."""

    def record_broker_load(self, data: BrokerLoadData, *, ts_ms: int | None = None) -> None:
        """One broker load sample."""
        ...

    def record_bundle_loads(
        self, broker: BrokerId, bundles: Iterable[BundleLoad], *, ts_ms: int | None = None
    ) -> None:
        """The load of each bundle a broker reported."""
        ...

    def record_decision(
        self,
        kind: str,
        bundle: BundleId,
        *,
        reason: str,
        src: BrokerId | None = None,
        dst: BrokerId | None = None,
    ) -> None:
        """One assign / transfer / unload / split (``kind``) of ``bundle``, and why."""
        ...

    def record_shedding(
        self, result: SheddingResult, snapshot: LoadSnapshot, *, strategy: str
    ) -> None:
        """A shedding cycle's decisions with the load statistics they were made on."""
        ...


class NoHistory:
    """The recorder of a sidecar without ``[history] enabled``: records nothing."""

    def record_broker_load(self, data: BrokerLoadData, *, ts_ms: int | None = None) -> None:
        """Nothing to record."""

    def record_bundle_loads(
        self, broker: BrokerId, bundles: Iterable[BundleLoad], *, ts_ms: int | None = None
    ) -> None:
        """Nothing to record."""

    def record_decision(
        self,
        kind: str,
        bundle: BundleId,
        *,
        reason: str,
        src: BrokerId | None = None,
        dst: BrokerId | None = None,
    ) -> None:
        """Nothing to record."""

    def record_shedding(
        self, result: SheddingResult, snapshot: LoadSnapshot, *, strategy: str
    ) -> None:
        """Nothing to record."""
