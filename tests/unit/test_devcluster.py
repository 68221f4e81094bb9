"""``lbd dev``'s records and checks that need no server: spec, cluster.json, state dirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lbd.cli.main import main
from lbd.config import Settings, SettingsError, load_settings
from lbd.core.errors import InvalidInputError, LbdError, NotFoundError
from lbd.devcluster.cluster import (
    DEV_SETTINGS,
    MARKER,
    DevCluster,
    DevClusterSpec,
    NodeRecord,
    ProcessRecord,
    add_brokers,
    dev_settings,
    down,
    is_alive,
    load_cluster,
    process_start_ticks,
    up,
)
from lbd.devcluster.processes import settings_env


def test_dev_settings_pass_the_settings_validation() -> None:
    settings = load_settings(None, env=settings_env(DEV_SETTINGS))
    assert settings == dev_settings()
    assert settings.monitor.interval_s == 1
    # Failover takes the defaults.
    assert settings.etcd == Settings().etcd and settings.broker == Settings().broker


def test_settings_become_lbd_env_variables_and_inherited_ones_are_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LBD_GRPC__ADMIN_TOKEN", "from-the-shell")
    env = settings_env({"etcd.lease_ttl_s": "4", "broker.auto_ack": "true"})
    assert env["LBD_ETCD__LEASE_TTL_S"] == "4"
    assert env["LBD_BROKER__AUTO_ACK"] == "true"
    assert "LBD_GRPC__ADMIN_TOKEN" not in env
    assert env["PYTHONUNBUFFERED"] == "1"


def test_set_overrides_add_to_the_dev_settings() -> None:
    spec = DevClusterSpec().with_overrides(["shedding.interval_s=2", "monitor.interval_s = 3"])
    assert spec.settings["shedding.interval_s"] == "2"
    assert spec.settings["monitor.interval_s"] == "3"
    assert spec.settings["split.interval_s"] == DEV_SETTINGS["split.interval_s"]


@pytest.mark.parametrize("bad", ["lease_ttl_s=3", "etcd.lease_ttl_s", "a.b.c=1", ".x=1"])
def test_a_malformed_set_is_refused(bad: str) -> None:
    with pytest.raises(InvalidInputError, match=r"section\.key=value"):
        DevClusterSpec().with_overrides([bad])


@pytest.mark.parametrize("brokers", [0, 33])
def test_the_number_of_brokers_is_bounded(brokers: int) -> None:
    with pytest.raises(InvalidInputError, match="--brokers"):
        DevClusterSpec(brokers=brokers)


def test_bad_settings_are_reported_before_anything_starts(tmp_path: Path) -> None:
    spec = DevClusterSpec().with_overrides(["etcd.fence_after_s=1"])
    with pytest.raises(SettingsError, match="fence_after_s"):
        up(tmp_path / "state", spec)
    assert not (tmp_path / "state").exists()


def test_a_file_or_a_foreign_directory_is_not_a_state_dir(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(InvalidInputError, match="not a directory"):
        up(a_file, DevClusterSpec())
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(InvalidInputError, match="not a dev cluster's"):
        up(foreign, DevClusterSpec())
    assert (foreign / "precious.txt").read_text() == "keep me"


def test_down_of_nothing_is_a_no_op_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert down(tmp_path / "missing") is False
    assert main(["dev", "down", "--state-dir", str(tmp_path / "missing")]) == 0
    assert "no dev cluster running" in capsys.readouterr().out


def test_addr_without_a_cluster_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dev", "addr", "--state-dir", str(tmp_path)]) == 1
    assert "no dev cluster is up in" in capsys.readouterr().err


def record(pid: int) -> ProcessRecord:
    return ProcessRecord(pid=pid, start_ticks=process_start_ticks(pid), log="x.log")


def cluster(state_dir: Path) -> DevCluster:
    nodes = tuple(
        NodeRecord(
            broker_id=f"broker-{i}",
            grpc_addr=f"127.0.0.1:{7000 + i}",
            metrics_addr=f"127.0.0.1:{9000 + i}",
            sidecar=record(os.getpid()),
            broker=record(os.getpid()),
            events_file=f"broker-{i}/events.jsonl",
        )
        for i in (1, 2)
    )
    me = record(os.getpid())
    return DevCluster("dev", str(state_dir), "http://e", "pulsar://p", me, me, me, nodes, {})


def test_cluster_json_round_trips_and_names_nodes(tmp_path: Path) -> None:
    original = cluster(tmp_path)
    (tmp_path / "cluster.json").write_text(original.to_json())
    loaded = load_cluster(tmp_path)
    assert loaded == original
    assert loaded.node().broker_id == "broker-1"
    assert loaded.node("broker-2").grpc_addr == "127.0.0.1:7002"
    with pytest.raises(NotFoundError, match="broker-9"):
        loaded.node("broker-9")


def test_addr_prints_a_sidecar_address(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "cluster.json").write_text(cluster(tmp_path).to_json())
    assert main(["dev", "addr", "--state-dir", str(tmp_path), "--broker", "broker-2"]) == 0
    assert capsys.readouterr().out == "127.0.0.1:7002\n"


def test_adding_brokers_needs_a_running_cluster(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="no dev cluster is up"):
        add_brokers(tmp_path, 1)


@pytest.mark.parametrize("count", [0, -1, 31])
def test_adding_brokers_is_bounded_and_asks_nothing_of_the_supervisor(
    tmp_path: Path, count: int
) -> None:
    (tmp_path / "cluster.json").write_text(cluster(tmp_path).to_json())
    with pytest.raises(InvalidInputError, match=f"can add 1 to 30 brokers .* not {count}"):
        add_brokers(tmp_path, count)
    assert not (tmp_path / "add-brokers.json").exists()


def test_a_refused_addition_raises_the_supervisors_error(tmp_path: Path) -> None:
    # The "supervisor" is this process: it answers any request at once, with an error.
    (tmp_path / "cluster.json").write_text(cluster(tmp_path).to_json())
    (tmp_path / "supervisor.pid").write_text(f"{os.getpid()}\n")

    def answer() -> None:
        request = tmp_path / "add-brokers.json"
        while not request.exists():
            time.sleep(0.01)
        ident = json.loads(request.read_text())["id"]
        (tmp_path / "add-brokers.result.json").write_text(
            json.dumps({"id": ident, "error": "no room"})
        )

    supervisor = threading.Thread(target=answer)
    supervisor.start()
    try:
        with pytest.raises(LbdError, match="cannot add brokers: no room"):
            add_brokers(tmp_path, 2, timeout_s=10)
    finally:
        supervisor.join()


def test_a_corrupt_record_is_an_invalid_input_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "cluster.json").write_text('{"cluster": "dev"}')
    with pytest.raises(InvalidInputError, match=r"cluster\.json"):
        load_cluster(tmp_path)


def test_a_reused_pid_is_not_taken_for_the_recorded_process() -> None:
    mine = record(os.getpid())
    assert is_alive(mine)
    if mine.start_ticks is None:
        pytest.skip("no /proc: start times are unknown here")
    assert not is_alive(ProcessRecord(os.getpid(), mine.start_ticks + 1, "x.log"))


_MAIN_THREAD_EXITS = """
import ctypes, sys, threading, time
threading.Thread(target=time.sleep, args=(60,)).start()
print("ready", flush=True)
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_process_whose_main_thread_exited_is_alive_while_another_thread_runs() -> None:
    """A process exiting shows its main thread as a zombie while its other threads still run
    and hold its files: a storage server's lock, which a restart must wait for."""
    if not Path("/proc/self/task").is_dir():
        pytest.skip("no /proc: threads are not listed here")
    child = subprocess.Popen(
        [sys.executable, "-c", _MAIN_THREAD_EXITS], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        stat = Path(f"/proc/{child.pid}/stat")
        deadline = time.monotonic() + 10
        while stat.read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline, "the main thread did not exit"
            time.sleep(0.01)
        assert is_alive(record(child.pid))
    finally:
        child.kill()
        child.communicate()
    assert not is_alive(ProcessRecord(child.pid, None, "x.log"))


def test_down_on_a_marked_dir_with_a_stale_record_cleans_it(tmp_path: Path) -> None:
    (tmp_path / MARKER).write_text("")
    (tmp_path / "supervisor.pid").write_text("999999999\n")
    stale = cluster(tmp_path)
    dead = ProcessRecord(pid=999_999_999, start_ticks=None, log="x")
    nodes = tuple(
        NodeRecord(n.broker_id, n.grpc_addr, n.metrics_addr, dead, dead, n.events_file)
        for n in stale.nodes
    )
    gone = DevCluster("dev", str(tmp_path), "e", "p", dead, dead, dead, nodes, {})
    (tmp_path / "cluster.json").write_text(gone.to_json())
    assert down(tmp_path) is False
    assert not (tmp_path / "cluster.json").exists()
    assert not (tmp_path / "supervisor.pid").exists()
