"""The history sink: load samples and decisions buffered in memory, flushed as Parquet by a thread.

The ``record_*`` methods are called from the event loop. They only append to a bounded buffer
under a lock that the flush thread holds for a swap, never during I/O, so they never block on the
filesystem. A background thread writes the buffer every ``flush_interval_s`` (or early, once half
of ``buffer_max_rows`` is buffered). When the target cannot be written the rows go back into the
buffer for the next attempt; the failure is logged and counted and the daemon keeps serving.
When the buffer is full the oldest rows are dropped and counted.

The counters are plain attributes, read by the metrics exporter.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING

from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BundleLoad
from lbd.core.shedding import LoadSnapshot, SheddingResult
from lbd.history.parquet import Row, open_target, require_pyarrow, write_rows
from lbd.history.rows import broker_load_row, bundle_load_row, common, decision_row
from lbd.history.schema import (
    BROKER_LOAD,
    BUNDLE_LOAD,
    DECISIONS,
    DecisionKind,
    Table,
)

if TYPE_CHECKING:
    import pyarrow.fs as pafs

    from lbd.config import HistorySettings

log = logging.getLogger(__name__)

_TABLES = {t.name: t for t in (BROKER_LOAD, BUNDLE_LOAD, DECISIONS)}


def _wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class HistorySink:
    """Appends broker load samples, bundle load samples and decisions to a history.

    ``start()`` opens the target and starts the flush thread; ``close()`` stops it after a last
    flush (idempotent). Use ``with HistorySink(...) as sink:`` or call both; from asyncio call
    ``close`` through ``asyncio.to_thread`` since the last flush does I/O.
    """

    def __init__(
        self,
        uri: str,
        *,
        cluster: str,
        recorder: str,
        flush_interval_s: float = 60.0,
        buffer_max_rows: int = 10000,
        clock_ms: Callable[[], int] = _wall_clock_ms,
    ) -> None:
        if flush_interval_s <= 0:
            raise InvalidInputError(f"flush_interval_s must be > 0, got {flush_interval_s}")
        if buffer_max_rows < 1:
            raise InvalidInputError(f"buffer_max_rows must be >= 1, got {buffer_max_rows}")
        self.uri = uri
        self.cluster = cluster
        self.recorder = recorder
        self.flush_interval_s = flush_interval_s
        self.buffer_max_rows = buffer_max_rows
        self._clock_ms = clock_ms
        self._buffer: deque[tuple[str, Row]] = deque()
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._fs: pafs.FileSystem | None = None
        self._base = ""
        self._closed = False
        self.rows_recorded = 0
        """Rows handed to a ``record_*`` method."""
        self.rows_written = 0
        """Rows written to the target."""
        self.rows_dropped = 0
        """Oldest rows dropped because the buffer was full (a slow or unwritable target)."""
        self.files_written = 0
        """Parquet files written."""
        self.flushes = 0
        """Successful flushes that wrote at least one row."""
        self.flush_failures = 0
        """Flushes that failed (the rows were kept for the next attempt)."""
        self.last_error: str | None = None
        """The latest flush failure, None once a flush succeeds again."""

    @classmethod
    def from_settings(
        cls, settings: HistorySettings, *, cluster: str, recorder: str
    ) -> HistorySink:
        """A sink configured by the ``[history]`` section."""
        return cls(
            settings.uri,
            cluster=cluster,
            recorder=recorder,
            flush_interval_s=settings.flush_interval_s,
            buffer_max_rows=settings.buffer_max_rows,
        )

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Check pyarrow, resolve the target and start the flush thread.

        Raises :class:`~lbd.history.parquet.HistoryUnavailableError` without pyarrow and
        InvalidInputError for a URI no filesystem accepts; an unwritable target is not an error
        here (it is retried at every flush)."""
        if self._thread is not None:
            return
        require_pyarrow()
        self._fs, self._base = open_target(self.uri)
        self._thread = threading.Thread(target=self._run, name="lbd-history-flush", daemon=True)
        self._thread.start()
        log.info("history: recording to %s every %gs", self.uri, self.flush_interval_s)

    def close(self) -> None:
        """Stop the flush thread after a last flush; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> HistorySink:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- recording -------------------------------------------------------------------------

    def record_broker_load(self, data: BrokerLoadData, *, ts_ms: int | None = None) -> None:
        """A broker's load report; ``ts_ms`` defaults to the report's ``updated_at_ms``."""
        head = self._common(ts_ms if ts_ms is not None else data.updated_at_ms)
        self._append(BROKER_LOAD, broker_load_row(data, head))

    def record_bundle_loads(
        self, broker: BrokerId, bundles: Iterable[BundleLoad], *, ts_ms: int | None = None
    ) -> None:
        """The bundles ``broker`` reported (its top bundles, or all of them)."""
        head = self._common(ts_ms)
        for b in bundles:
            self._append(BUNDLE_LOAD, bundle_load_row(broker, b, head))

    def record_decision(
        self,
        kind: DecisionKind | str,
        bundle: BundleId,
        *,
        reason: str,
        src: BrokerId | None = None,
        dst: BrokerId | None = None,
        strategy: str | None = None,
        cluster_avg: float | None = None,
        cluster_std: float | None = None,
        src_load: float | None = None,
        dst_load: float | None = None,
        bundle_throughput: float | None = None,
        ts_ms: int | None = None,
    ) -> None:
        """One assignment, transfer, unload or split, with the load stats it was made on.

        An unknown ``kind`` is a bug of the caller: it is logged and the row dropped (recording
        never raises into the decision it records).
        """
        try:
            kind = DecisionKind(kind)
        except ValueError:
            log.error("history: unknown decision kind %r for %s (row dropped)", kind, bundle)
            return
        row = decision_row(
            self._common(ts_ms),
            kind,
            bundle,
            reason=reason,
            src=src,
            dst=dst,
            strategy=strategy,
            cluster_avg=cluster_avg,
            cluster_std=cluster_std,
            src_load=src_load,
            dst_load=dst_load,
            bundle_throughput=bundle_throughput,
        )
        self._append(DECISIONS, row)

    def record_shedding(
        self,
        result: SheddingResult,
        snapshot: LoadSnapshot,
        *,
        strategy: str,
        ts_ms: int | None = None,
    ) -> None:
        """Every decision of one shedder cycle, with the loads of ``snapshot`` it ran over."""
        throughput = {
            b.bundle: b.msg_throughput for loads in snapshot.top_bundles.values() for b in loads
        }

        def load_of(broker: BrokerId | None) -> float | None:
            data = snapshot.brokers.get(broker) if broker is not None else None
            return None if data is None else data.weighted_max_ema

        for d in result.decisions:
            self.record_decision(
                DecisionKind.TRANSFER if d.dst is not None else DecisionKind.UNLOAD,
                d.bundle,
                reason=str(d.reason),
                src=d.src,
                dst=d.dst,
                strategy=strategy,
                cluster_avg=result.avg,
                cluster_std=result.std,
                src_load=load_of(d.src),
                dst_load=load_of(d.dst),
                bundle_throughput=throughput.get(d.bundle),
                ts_ms=ts_ms,
            )

    def buffered(self) -> int:
        """Rows waiting for the next flush."""
        with self._lock:
            return len(self._buffer)

    # -- flushing --------------------------------------------------------------------------

    def flush(self) -> bool:
        """Write every buffered row now, in the calling thread; whether it succeeded.

        On failure the rows go back into the buffer (within its bound) and the failure is
        logged and counted; nothing is raised."""
        if self._fs is None:
            raise RuntimeError("HistorySink.flush() before start()")
        with self._flush_lock:
            with self._lock:
                taken = list(self._buffer)
                self._buffer.clear()
            if not taken:
                return True
            by_table: dict[str, list[Row]] = {}
            for name, row in taken:
                by_table.setdefault(name, []).append(row)
            written: set[str] = set()
            try:
                for name, rows in by_table.items():
                    self.files_written += write_rows(
                        self._fs, self._base, _TABLES[name], rows, self.recorder
                    )
                    self.rows_written += len(rows)
                    written.add(name)
            except Exception as e:  # any filesystem error: the daemon must keep serving
                self.flush_failures += 1
                self.last_error = f"{type(e).__name__}: {e}"
                log.warning("history: cannot write to %s: %s", self.uri, self.last_error)
                self._requeue([(n, r) for n, r in taken if n not in written])
                return False
            self.flushes += 1
            self.last_error = None
            return True

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            if not self.flush():
                # A failing target is retried at the flush interval, not at every new row.
                self._stopping.wait(self.flush_interval_s)
        self.flush()

    # -- buffer ----------------------------------------------------------------------------

    def _common(self, ts_ms: int | None) -> dict[str, object]:
        return common(self._clock_ms() if ts_ms is None else ts_ms, self.cluster, self.recorder)

    def _append(self, table: Table, row: Row) -> None:
        with self._lock:
            self.rows_recorded += 1
            if len(self._buffer) >= self.buffer_max_rows:
                self._buffer.popleft()
                self.rows_dropped += 1
            self._buffer.append((table.name, row))
            half_full = len(self._buffer) * 2 >= self.buffer_max_rows
        if half_full:
            self._wake.set()

    def _requeue(self, rows: list[tuple[str, Row]]) -> None:
        """Put rows that failed to be written back in front of the newer ones, oldest dropped."""
        with self._lock:
            merged = rows + list(self._buffer)
            excess = max(0, len(merged) - self.buffer_max_rows)
            self.rows_dropped += excess
            self._buffer = deque(merged[excess:])
