"""Reading a history into Spark DataFrames, refusing what is not a history of this version."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lbd.core.errors import InvalidInputError
from lbd.history.schema import (
    BROKER_LOAD,
    BUNDLE_LOAD,
    DECISIONS,
    SCHEMA_VERSION,
    ColumnType,
    Table,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

_SPARK_TYPES = {
    ColumnType.INT32: "int",
    ColumnType.INT64: "bigint",
    ColumnType.FLOAT64: "double",
    ColumnType.STRING: "string",
}


@dataclass(frozen=True)
class HistoryFrames:
    """The three tables of one history (columns exactly as :mod:`lbd.history.schema` says)."""

    path: str
    broker_load: DataFrame
    bundle_load: DataFrame
    decisions: DataFrame


def spark_schema(table: Table) -> StructType:
    """The Spark schema of ``table``."""
    from pyspark.sql.types import StructType, _parse_datatype_string

    schema = StructType()
    for c in table.columns:
        schema = schema.add(c.name, _parse_datatype_string(_SPARK_TYPES[c.type]), c.nullable)
    return schema


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def read_history(spark: SparkSession, path: str) -> HistoryFrames:
    """Read the history at ``path`` (a directory or any URI Spark reads).

    InvalidInputError, naming the path, for: a missing path, a directory that is not a history,
    a table with another schema version or with missing or mistyped columns, and a history with
    no broker load sample."""
    if _is_local(path):
        local = path.removeprefix("file://")
        if not os.path.isdir(local):
            raise InvalidInputError(f"history {path}: no such directory")
    frames = {t.name: _read_table(spark, path, t) for t in (BROKER_LOAD, BUNDLE_LOAD, DECISIONS)}
    if frames[BROKER_LOAD.name].limit(1).count() == 0:
        raise InvalidInputError(f"history {path} is empty: it has no broker load samples")
    return HistoryFrames(
        path,
        frames[BROKER_LOAD.name],
        frames[BUNDLE_LOAD.name],
        frames[DECISIONS.name],
    )


def _read_table(spark: SparkSession, path: str, table: Table) -> DataFrame:
    from pyspark.errors import AnalysisException

    where = f"{path.rstrip('/')}/{table.name}"
    if _is_local(where) and not os.path.isdir(where.removeprefix("file://")):
        if table is BROKER_LOAD:
            raise InvalidInputError(
                f"history {path}: not an lbd history (no {table.name}/ directory in it)"
            )
        return spark.createDataFrame([], spark_schema(table))
    try:
        df = spark.read.parquet(where)
    except AnalysisException as e:
        if table is BROKER_LOAD:
            raise InvalidInputError(f"history {path}: cannot read {table.name}: {e}") from None
        return spark.createDataFrame([], spark_schema(table))
    if "schema_version" in df.columns:
        versions = sorted(r[0] for r in df.select("schema_version").distinct().limit(10).collect())
        wrong = [v for v in versions if v != SCHEMA_VERSION]
        if wrong:
            raise InvalidInputError(
                f"history {path}: {table.name} has schema version "
                f"{', '.join(map(str, wrong))}; this lbd reads version {SCHEMA_VERSION}"
            )
    types = dict(df.dtypes)
    problems = [
        f"{c.name} is missing" if c.name not in types else f"{c.name} is {types[c.name]}"
        for c in table.columns
        if types.get(c.name) != _SPARK_TYPES[c.type]
    ]
    if problems:
        expected = ", ".join(f"{c.name} {_SPARK_TYPES[c.type]}" for c in table.columns)
        raise InvalidInputError(
            f"history {path}: {table.name} does not have schema version {SCHEMA_VERSION}: "
            f"{'; '.join(problems)} (expected columns: {expected})"
        )
    return df.select(*table.column_names)
