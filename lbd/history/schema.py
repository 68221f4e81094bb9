"""The history's on-disk schema: three Parquet tables, partitioned by date and hour.

A history is a directory (or filesystem URI) holding one sub-directory per table, each
partitioned Hive-style by the UTC date and hour of its rows' ``ts_ms``::

    <history>/broker_load/date=2024-05-01/hour=13/part-....parquet
    <history>/bundle_load/date=.../hour=.../part-....parquet
    <history>/decisions/date=.../hour=.../part-....parquet

Every row carries ``schema_version`` (:data:`SCHEMA_VERSION`); readers refuse any other version.
A change that renames, retypes or re-means a column bumps it; adding a nullable column does not.

- ``broker_load``: one row per load report of a broker (what the sidecar publishes on the
  broker-load topic). ``load`` is the weighted max resource usage EMA the shedders compare
  (DESIGN §7), ``max_usage`` the raw (unweighted) max usage of the sample, both 0..1+.
- ``bundle_load``: one row per bundle per report: the bundles a broker reported (its top
  bundles, or all of them), with the broker that reported them as their owner at ``ts_ms``.
- ``decisions``: one row per decision: ``assign``, ``transfer``, ``unload`` or ``split``, with
  its reason (``Overloaded``/``Underloaded``/``Admin`` for moves, Pulsar's split reasons such as
  ``Bandwidth``, ``Lookup``/``Orphan``/``Admin`` for assignments), the source and destination
  brokers, the strategy that made it, and the load statistics it was made on (the cluster's
  mean and std of ``load``, and the source's and destination's ``load``).

The column lists below are the reference; :func:`arrow_schema` turns them into pyarrow schemas
and :mod:`lbd.analytics` into Spark schemas. This module imports neither, so the daemon can
import it without the ``analytics`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa

SCHEMA_VERSION = 1
"""The version written in every row's ``schema_version`` column."""


class ColumnType(StrEnum):
    """Column types, named as in Arrow."""

    INT32 = "int32"
    INT64 = "int64"
    FLOAT64 = "float64"
    STRING = "string"


@dataclass(frozen=True, slots=True)
class Column:
    """One column: name, type, whether it may be null, and what it means."""

    name: str
    type: ColumnType
    nullable: bool
    doc: str


@dataclass(frozen=True, slots=True)
class Table:
    """One table of the history: its directory name and columns."""

    name: str
    columns: tuple[Column, ...]
    doc: str

    @property
    def column_names(self) -> tuple[str, ...]:
        """The column names, in order."""
        return tuple(c.name for c in self.columns)


class DecisionKind(StrEnum):
    """What a decision did to its bundle (the ``kind`` column)."""

    ASSIGN = "assign"
    TRANSFER = "transfer"
    UNLOAD = "unload"
    SPLIT = "split"


_I32, _I64, _F64, _STR = ColumnType.INT32, ColumnType.INT64, ColumnType.FLOAT64, ColumnType.STRING

_COMMON = (
    Column("schema_version", _I32, False, "SCHEMA_VERSION of the writer"),
    Column("ts_ms", _I64, False, "when the sample was taken or the decision made, epoch ms"),
    Column("cluster", _STR, False, "cluster name"),
    Column("recorder", _STR, False, "the sidecar (its broker id) or tool that wrote the row"),
)

BROKER_LOAD = Table(
    "broker_load",
    (
        *_COMMON,
        Column("broker", _STR, False, "the broker the report is about"),
        Column("load", _F64, False, "weighted max resource usage EMA, 0..1+ (what shedders see)"),
        Column("max_usage", _F64, False, "max resource usage of this sample, 0..1+"),
        Column("cpu_pct", _F64, False, "CPU usage, percent of the limit"),
        Column("memory_pct", _F64, False, "heap memory usage, percent"),
        Column("direct_memory_pct", _F64, False, "direct memory usage, percent"),
        Column("bandwidth_in_pct", _F64, False, "inbound bandwidth usage, percent"),
        Column("bandwidth_out_pct", _F64, False, "outbound bandwidth usage, percent"),
        Column("msg_throughput_in", _F64, False, "bytes/s in"),
        Column("msg_throughput_out", _F64, False, "bytes/s out"),
        Column("msg_throughput_ema", _F64, False, "EMA of bytes/s in plus out"),
        Column("msg_rate_in", _F64, False, "messages/s in"),
        Column("msg_rate_out", _F64, False, "messages/s out"),
        Column("bundle_count", _I32, False, "bundles the broker owns"),
        Column("topics", _I32, False, "topics the broker serves"),
    ),
    "one row per broker load report",
)

BUNDLE_LOAD = Table(
    "bundle_load",
    (
        *_COMMON,
        Column("broker", _STR, False, "the reporting broker, the bundle's owner at ts_ms"),
        Column("bundle", _STR, False, "bundle id, tenant/namespace/0xLLLLLLLL_0xHHHHHHHH"),
        Column("msg_throughput_in", _F64, False, "bytes/s in"),
        Column("msg_throughput_out", _F64, False, "bytes/s out"),
        Column("msg_rate_in", _F64, False, "messages/s in"),
        Column("msg_rate_out", _F64, False, "messages/s out"),
        Column("topics", _I32, False, "topics in the bundle"),
        Column("sessions", _I32, False, "producers plus consumers"),
    ),
    "one row per reported bundle per load report",
)

DECISIONS = Table(
    "decisions",
    (
        *_COMMON,
        Column("kind", _STR, False, "assign, transfer, unload or split"),
        Column("bundle", _STR, False, "the bundle decided on (the parent, for a split)"),
        Column("src", _STR, True, "broker the bundle leaves (null for an assignment)"),
        Column("dst", _STR, True, "broker it goes to (null for a plain unload or a split)"),
        Column("reason", _STR, False, "why, e.g. Overloaded, Underloaded, Admin, Bandwidth"),
        Column("strategy", _STR, True, "the strategy that decided, e.g. transfer_shedder"),
        Column("cluster_avg", _F64, True, "mean broker load when decided"),
        Column("cluster_std", _F64, True, "std of broker loads when decided"),
        Column("src_load", _F64, True, "the source broker's load when decided"),
        Column("dst_load", _F64, True, "the destination broker's load when decided"),
        Column("bundle_throughput", _F64, True, "the bundle's bytes/s in plus out"),
    ),
    "one row per assignment, transfer, unload or split",
)

TABLES: tuple[Table, ...] = (BROKER_LOAD, BUNDLE_LOAD, DECISIONS)
"""Every table of a history."""

PARTITION_COLUMNS = ("date", "hour")
"""Directory partition keys (``date=YYYY-MM-DD``, ``hour=0..23``, UTC), not stored in files."""


def table(name: str) -> Table:
    """The table called ``name``; KeyError for an unknown one."""
    for t in TABLES:
        if t.name == name:
            return t
    raise KeyError(name)


def arrow_schema(t: Table) -> pa.Schema:
    """The pyarrow schema of ``t``, with the schema version in its metadata."""
    import pyarrow as pa

    types = {
        ColumnType.INT32: pa.int32(),
        ColumnType.INT64: pa.int64(),
        ColumnType.FLOAT64: pa.float64(),
        ColumnType.STRING: pa.string(),
    }
    return pa.schema(
        [pa.field(c.name, types[c.type], nullable=c.nullable) for c in t.columns],
        metadata={"lbd.table": t.name, "lbd.schema_version": str(SCHEMA_VERSION)},
    )
