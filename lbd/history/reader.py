"""Reading a history's decisions back with pyarrow, for ``lbd ctl decisions --history``.

The analytics pipeline reads whole histories with Spark (:mod:`lbd.analytics.history_io`); this
reads one table, filtered on time, in the operator's process. Only the date partitions that can
hold a row at or after ``since_ms`` are opened.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, fields

from lbd.core.errors import InvalidInputError
from lbd.history.parquet import open_target
from lbd.history.schema import DECISIONS, PARTITION_COLUMNS, SCHEMA_VERSION, arrow_schema


@dataclass(frozen=True, slots=True)
class HistoryDecision:
    """One row of the ``decisions`` table (the columns ``lbd ctl decisions`` shows)."""

    ts_ms: int
    kind: str
    bundle: str
    src: str | None
    dst: str | None
    reason: str
    strategy: str | None
    recorder: str


def read_decisions(uri: str, *, since_ms: int = 0) -> list[HistoryDecision]:
    """The decisions of the history at ``uri`` made at or after ``since_ms``, oldest first.

    A history without a ``decisions`` table yet has none. InvalidInputError, naming the history,
    for a local path that does not exist, unreadable files, and rows of another schema version.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    import pyarrow.fs as pafs

    fs, base = open_target(uri)
    if fs.get_file_info(base).type is not pafs.FileType.Directory:
        raise InvalidInputError(f"history {uri}: no such directory")
    where = f"{base}/{DECISIONS.name}"
    if fs.get_file_info(where).type is not pafs.FileType.Directory:
        return []
    date, hour = PARTITION_COLUMNS
    partitioning = ds.partitioning(
        pa.schema([(date, pa.string()), (hour, pa.int32())]), flavor="hive"
    )
    since_date = dt.datetime.fromtimestamp(max(since_ms, 0) / 1000, tz=dt.UTC).date()
    wanted = (pc.field(date) >= since_date.isoformat()) & (pc.field("ts_ms") >= since_ms)
    columns = ["schema_version", *(f.name for f in fields(HistoryDecision))]
    try:
        dataset = ds.dataset(
            where,
            schema=pa.unify_schemas([arrow_schema(DECISIONS), partitioning.schema]),
            format="parquet",
            filesystem=fs,
            partitioning=partitioning,
        )
        rows = dataset.to_table(columns=columns, filter=wanted).to_pylist()
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as e:
        raise InvalidInputError(f"history {uri}: cannot read {DECISIONS.name}: {e}") from None
    versions = sorted({row.pop("schema_version") for row in rows} - {SCHEMA_VERSION})
    if versions:
        raise InvalidInputError(
            f"history {uri}: {DECISIONS.name} has schema version "
            f"{', '.join(map(str, versions))}; this lbd reads version {SCHEMA_VERSION}"
        )
    return sorted((HistoryDecision(**row) for row in rows), key=lambda d: d.ts_ms)
