"""``lbd analytics report`` against a real Spark standalone master and worker on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lbd.devcluster.ports import free_ports
from tests.analytics.histories import BROKER_LOAD, T0, broker_row, write_history

pytestmark = pytest.mark.timeout(180)

START_TIMEOUT_S = 60


def _spark_class() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent / "bin" / "spark-class"


def _start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [str(_spark_class()), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _wait_for(log: Path, text: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"{log.name}: no {text!r} in time:\n{log.read_text(errors='replace')}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def standalone(tmp_path: Path) -> Iterator[str]:
    """A master and a one-core worker; yields the master URL."""
    env = {
        **os.environ,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOG_DIR": str(tmp_path),
        "SPARK_WORKER_DIR": str(tmp_path / "work"),
    }
    port, master_ui, worker_ui = free_ports(3)
    url = f"spark://127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        master = _start(
            [
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--webui-port",
                str(master_ui),
            ],
            tmp_path / "master.log",
            env,
        )
        procs.append(master)
        _wait_for(tmp_path / "master.log", "I have been elected leader", master)
        worker = _start(
            [
                "org.apache.spark.deploy.worker.Worker",
                "--host",
                "127.0.0.1",
                "--cores",
                "1",
                "--memory",
                "1g",
                "--webui-port",
                str(worker_ui),
                url,
            ],
            tmp_path / "worker.log",
            env,
        )
        procs.append(worker)
        _wait_for(tmp_path / "worker.log", "Successfully registered with master", worker)
        yield url
    finally:
        for proc in reversed(procs):
            _stop(proc)


def test_report_on_a_standalone_cluster(standalone: str, tmp_path: Path) -> None:
    rows = []
    for i in range(10):
        load = 0.9 if i < 4 else 0.5
        rows += [broker_row(T0 + i * 60_000, "a", load), broker_row(T0 + i * 60_000, "b", 1 - load)]
    history = write_history(str(tmp_path / "h"), {BROKER_LOAD: rows})
    out = tmp_path / "report"
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lbd.cli.main",
            "analytics",
            "report",
            "--history",
            history,
            "--out",
            str(out),
            "--master",
            standalone,
            "--spark-conf",
            "spark.ui.enabled=false",
            "--spark-conf",
            "spark.executor.memory=512m",
            "--spark-conf",
            "spark.cores.max=1",
            "--spark-conf",
            "spark.sql.shuffle.partitions=2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=150,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "20 rows" in done.stdout
    assert "slowest back under target in 240 s" in done.stdout
    assert (out / "report.html").is_file()
    # The job ran on the cluster's executor, not in the driver.
    app_dirs = list((tmp_path / "work").glob("app-*"))
    assert app_dirs, "no application ran on the worker"
