"""Writing history rows as Parquet files, partitioned by date and hour, through ``pyarrow.fs``.

pyarrow is imported when a function here runs, not when the module is imported, so that the
daemon starts without the ``analytics`` extra as long as history stays disabled.
"""

from __future__ import annotations

import datetime as dt
import os
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from lbd.core.errors import InvalidInputError, LbdError
from lbd.history.schema import Table, arrow_schema

if TYPE_CHECKING:
    import pyarrow.fs as pafs

Row = Mapping[str, object]
"""One row: column name -> value, as :mod:`lbd.history.schema` defines the columns."""


class HistoryUnavailableError(LbdError):
    """History is enabled but pyarrow (the ``analytics`` extra) is not installed."""


def require_pyarrow() -> None:
    """Raise :class:`HistoryUnavailableError` with the fix when pyarrow cannot be imported."""
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        raise HistoryUnavailableError(
            f"history is enabled but pyarrow is missing ({e}); install the analytics extra "
            "(pip install 'lbd[analytics]') or set history.enabled = false"
        ) from None


def open_target(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and base path of ``uri``: a local path (relative to the working directory)
    or any URI ``pyarrow.fs`` opens (``file://``, ``s3://``, ``hdfs://``, ...)."""
    require_pyarrow()
    import pyarrow.fs as pafs

    if not uri:
        raise InvalidInputError("history uri must not be empty")
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError/ValueError by scheme
        raise InvalidInputError(f"history uri {uri!r} cannot be opened: {e}") from None
    return fs, path.rstrip("/")


def partition_of(ts_ms: int) -> tuple[str, int]:
    """The UTC ``(date, hour)`` partition of a timestamp in epoch milliseconds."""
    when = dt.datetime.fromtimestamp(ts_ms / 1000, tz=dt.UTC)
    return when.date().isoformat(), when.hour


def write_rows(fs: pafs.FileSystem, base: str, table: Table, rows: Sequence[Row], tag: str) -> int:
    """Write ``rows`` of ``table`` under ``base``, one new file per (date, hour) partition they
    fall in; return the number of files written. ``tag`` goes into the file names (e.g. the
    recorder) so that writers sharing a directory never collide."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    by_partition: dict[tuple[str, int], list[Row]] = defaultdict(list)
    for row in rows:
        ts = row["ts_ms"]
        if not isinstance(ts, int):
            raise InvalidInputError(f"{table.name}: ts_ms must be an integer, got {ts!r}")
        by_partition[partition_of(ts)].append(row)
    schema = arrow_schema(table)
    safe_tag = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in tag)
    for (date, hour), part in sorted(by_partition.items()):
        directory = f"{base}/{table.name}/date={date}/hour={hour}"
        fs.create_dir(directory, recursive=True)
        name = f"part-{safe_tag}-{uuid.uuid4().hex}.parquet"
        arrow_table = pa.Table.from_pylist(list(part), schema=schema)
        # Written under a hidden name and moved into place: a reader listing the directory (a
        # dataset, Spark) never meets a half-written file.
        in_progress = f"{directory}/.{name}.inprogress"
        pq.write_table(arrow_table, in_progress, filesystem=fs)
        fs.move(in_progress, f"{directory}/{name}")
    return len(by_partition)
