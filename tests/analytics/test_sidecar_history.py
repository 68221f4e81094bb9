"""History of a running sidecar: samples and decisions land in Parquet; a bad target is harmless."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pyarrow.dataset as ds
import pytest
from serve_process import serve_process, wait_serving

from lbd.devcluster import EtcdServer, PulsarLiteServer
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from lbd.history.schema import SCHEMA_VERSION

pytestmark = [pytest.mark.servers, pytest.mark.timeout(120)]

FAST = {
    "LBD_HISTORY__ENABLED": "true",
    "LBD_HISTORY__FLUSH_INTERVAL_S": "0.5",
    "LBD_LOAD_REPORT__INTERVAL_S": "0.5",
}


def lookup_topics(addr: str, count: int) -> set[str]:
    with grpc.insecure_channel(addr) as channel:
        stub = lbd_pb2_grpc.LoadBalancerStub(channel)
        owners = {
            stub.Lookup(
                lbd_pb2.LookupRequest(topic=f"persistent://public/default/t-{i}"), timeout=15
            ).owner_broker_id
            for i in range(count)
        }
    return owners


def read_table(root: Path, name: str) -> ds.Dataset | None:
    path = root / name
    if not path.is_dir() or not any(path.rglob("*.parquet")):
        return None
    return ds.dataset(str(path), format="parquet", partitioning="hive")


def eventually(check, timeout_s: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_samples_and_decisions_of_a_running_sidecar_reach_parquet(
    etcd_server: EtcdServer, pulsar_server: PulsarLiteServer, tmp_path: Path
) -> None:
    history = tmp_path / "history"
    env = {**FAST, "LBD_HISTORY__URI": str(history)}
    with serve_process(etcd_server, pulsar_server, tmp_path, "broker-h1", env) as sidecar:
        wait_serving(sidecar)
        assert lookup_topics(sidecar.grpc_addr, 20) == {"broker-h1"}
        loads = eventually(lambda: read_table(history, "broker_load"))
        decisions = eventually(lambda: read_table(history, "decisions"))
        assert loads is not None, sidecar.log_text()
        assert decisions is not None, sidecar.log_text()
        rows = loads.to_table().to_pylist()
        assert rows and {r["broker"] for r in rows} == {"broker-h1"}
        assert {r["schema_version"] for r in rows} == {SCHEMA_VERSION}
        assert {"date", "hour"} <= set(loads.schema.names)
        made = decisions.to_table().to_pylist()
        assert {r["kind"] for r in made} == {"assign"}
        assert {r["dst"] for r in made} == {"broker-h1"}
        assert {r["reason"] for r in made} == {"Lookup"}
        assert all(r["bundle"].startswith("public/default/0x") for r in made)


def test_an_unwritable_history_target_does_not_disturb_lookups(
    etcd_server: EtcdServer, pulsar_server: PulsarLiteServer, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the history directory should be")
    env = {**FAST, "LBD_HISTORY__URI": str(blocker / "history")}
    with serve_process(etcd_server, pulsar_server, tmp_path, "broker-h2", env) as sidecar:
        wait_serving(sidecar)
        assert lookup_topics(sidecar.grpc_addr, 10) == {"broker-h2"}
        time.sleep(1.5)  # a few flush intervals: every one of them fails
        assert lookup_topics(sidecar.grpc_addr, 10) == {"broker-h2"}
        assert sidecar.process.poll() is None, sidecar.log_text()
        assert "history: cannot write to" in sidecar.log_text()
