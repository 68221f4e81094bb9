"""History tables written for the analytics tests: broker-load and decision rows, and a writer."""

from __future__ import annotations

from collections.abc import Sequence

from lbd.history.parquet import open_target, write_rows
from lbd.history.schema import BROKER_LOAD, DECISIONS, SCHEMA_VERSION, Table

T0 = 1_714_521_600_000
"""2024-05-01T00:00:00Z."""


def broker_row(ts_ms: int, broker: str, load: float, **overrides: object) -> dict[str, object]:
    """A broker_load row with the given load and plausible other columns."""
    row: dict[str, object] = {
        "schema_version": SCHEMA_VERSION,
        "ts_ms": ts_ms,
        "cluster": "c1",
        "recorder": "test",
        "broker": broker,
        "load": load,
        "max_usage": load,
        "cpu_pct": 0.0,
        "memory_pct": 0.0,
        "direct_memory_pct": 0.0,
        "bandwidth_in_pct": 100 * load,
        "bandwidth_out_pct": 100 * load,
        "msg_throughput_in": load * 1e8,
        "msg_throughput_out": load * 1e8,
        "msg_throughput_ema": 2 * load * 1e8,
        "msg_rate_in": 0.0,
        "msg_rate_out": 0.0,
        "bundle_count": 1,
        "topics": 1,
    }
    row.update(overrides)
    return row


def decision(
    ts_ms: int, kind: str, bundle: str, src: str | None, dst: str | None, reason: str
) -> dict[str, object]:
    """A decisions row."""
    return {
        "schema_version": SCHEMA_VERSION,
        "ts_ms": ts_ms,
        "cluster": "c1",
        "recorder": "test",
        "kind": kind,
        "bundle": bundle,
        "src": src,
        "dst": dst,
        "reason": reason,
        "strategy": "transfer_shedder",
        "cluster_avg": None,
        "cluster_std": None,
        "src_load": None,
        "dst_load": None,
        "bundle_throughput": None,
    }


def write_history(path: str, tables: dict[Table, Sequence[dict[str, object]]]) -> str:
    """Write rows as a history at ``path`` with the sink's writer; returns ``path``."""
    fs, base = open_target(path)
    for table, rows in tables.items():
        write_rows(fs, base, table, list(rows), "test")
    return path


__all__ = ["BROKER_LOAD", "DECISIONS", "T0", "broker_row", "decision", "write_history"]
