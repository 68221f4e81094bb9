"""The history sink: rows land in Parquet with the documented schema; failures never raise."""

from __future__ import annotations

import os
import sys

import pyarrow.dataset as ds
import pytest

from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BrokerUsage, BundleLoad, ResourceUsage
from lbd.core.shedding import DecisionReason, LoadSnapshot, SheddingResult, UnloadDecision
from lbd.history import DecisionKind, HistorySink, HistoryUnavailableError
from lbd.history.schema import BROKER_LOAD, BUNDLE_LOAD, DECISIONS, SCHEMA_VERSION, arrow_schema

T0 = 1_714_521_600_000 + 13 * 3_600_000  # 2024-05-01T13:00Z


def _load(broker: str, load: float, ts: int) -> BrokerLoadData:
    usage = BrokerUsage(
        bandwidth_in=ResourceUsage(100 * load, 100),
        msg_throughput_in=1e6,
        msg_throughput_out=2e6,
        bundle_count=2,
    )
    return BrokerLoadData(
        BrokerId(broker),
        usage=usage,
        max_resource_usage=load,
        weighted_max_ema=load,
        msg_throughput_ema=3e6,
        updated_at_ms=ts,
    )


def _read(root: str, table: str) -> list[dict[str, object]]:
    dataset = ds.dataset(os.path.join(root, table), format="parquet", partitioning="hive")
    return sorted(dataset.to_table().to_pylist(), key=lambda r: (r["ts_ms"], str(r.get("bundle"))))


def test_samples_and_decisions_appear_in_parquet_with_the_schema(tmp_path):
    root = str(tmp_path / "history")
    a, b = BrokerId("a"), BrokerId("b")
    with HistorySink(root, cluster="c1", recorder="a", flush_interval_s=3600) as sink:
        sink.record_broker_load(_load("a", 0.7, T0))
        sink.record_broker_load(_load("a", 0.6, T0 + 3_600_000))  # the next hour partition
        sink.record_bundle_loads(
            a,
            [
                BundleLoad(
                    BundleId("t/n/0x00000000_0xffffffff"),
                    5.0,
                    7.0,
                    topics=3,
                    producer_count=1,
                    consumer_count=2,
                )
            ],
            ts_ms=T0,
        )
        snapshot = LoadSnapshot(brokers={a: _load("a", 0.9, T0), b: _load("b", 0.1, T0)})
        result = SheddingResult(
            (
                UnloadDecision(
                    BundleId("t/n/0x00000000_0xffffffff"), a, b, DecisionReason.OVERLOADED
                ),
            ),
            None,
            0.5,
            0.4,
        )
        sink.record_shedding(result, snapshot, strategy="transfer_shedder", ts_ms=T0)
        sink.record_decision(
            DecisionKind.SPLIT,
            BundleId("t/n/0x00000000_0xffffffff"),
            reason="Bandwidth",
            src=a,
            ts_ms=T0,
        )
    assert sink.rows_written == 5 and sink.rows_dropped == 0 and sink.flush_failures == 0
    hours = sorted(os.listdir(tmp_path / "history" / "broker_load" / "date=2024-05-01"))
    assert hours == ["hour=13", "hour=14"]
    for table in (BROKER_LOAD, BUNDLE_LOAD, DECISIONS):
        files = list((tmp_path / "history" / table.name).rglob("*.parquet"))
        assert ds.dataset([str(f) for f in files]).schema.remove_metadata() == (
            arrow_schema(table).remove_metadata()
        )
    loads = _read(root, "broker_load")
    assert [(r["broker"], r["load"], r["hour"]) for r in loads] == [("a", 0.7, 13), ("a", 0.6, 14)]
    assert loads[0]["schema_version"] == SCHEMA_VERSION
    assert loads[0]["msg_throughput_in"] == 1e6 and loads[0]["bundle_count"] == 2
    (bundle,) = _read(root, "bundle_load")
    assert (bundle["msg_throughput_out"], bundle["topics"], bundle["sessions"]) == (7.0, 3, 3)
    transfer, split = _read(root, "decisions")
    assert (transfer["kind"], transfer["src"], transfer["dst"], transfer["reason"]) == (
        "transfer",
        "a",
        "b",
        "Overloaded",
    )
    assert (transfer["cluster_std"], transfer["src_load"], transfer["dst_load"]) == (0.4, 0.9, 0.1)
    assert transfer["bundle_throughput"] is None  # not in the snapshot's top bundles
    assert (split["kind"], split["dst"], split["reason"]) == ("split", None, "Bandwidth")


def test_unwritable_target_is_counted_and_recording_goes_on(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    sink = HistorySink(
        str(blocker / "history"),
        cluster="c",
        recorder="x",
        flush_interval_s=3600,
        buffer_max_rows=100,
    )
    sink.start()
    try:
        sink.record_broker_load(_load("a", 0.5, T0))
        assert sink.flush() is False
        assert sink.flush_failures >= 1 and sink.last_error
        sink.record_broker_load(_load("a", 0.5, T0 + 1))  # still accepted
        assert sink.buffered() == 2  # the failed row was kept for the next attempt
    finally:
        sink.close()
    assert sink.rows_written == 0


def test_buffer_is_bounded_and_drops_the_oldest(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    sink = HistorySink(
        str(blocker / "h"), cluster="c", recorder="x", flush_interval_s=3600, buffer_max_rows=5
    )
    sink.start()
    for i in range(20):
        sink.record_broker_load(_load("a", 0.5, T0 + i))
    sink.close()
    assert sink.buffered() <= 5
    assert sink.rows_recorded == 20
    assert sink.rows_dropped + sink.buffered() == 20
    assert sink.rows_dropped >= 15


def test_a_full_buffer_triggers_an_early_flush(tmp_path):
    sink = HistorySink(
        str(tmp_path / "h"), cluster="c", recorder="x", flush_interval_s=3600, buffer_max_rows=4
    )
    sink.start()
    try:
        for i in range(2):
            sink.record_broker_load(_load("a", 0.5, T0 + i))
        for _ in range(200):  # the flush thread is woken at half full, not after an hour
            if sink.rows_written == 2:
                break
            import time

            time.sleep(0.01)
        assert sink.rows_written == 2
    finally:
        sink.close()


def test_missing_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    sink = HistorySink(str(tmp_path), cluster="c", recorder="x")
    with pytest.raises(HistoryUnavailableError, match=r"analytics extra"):
        sink.start()
