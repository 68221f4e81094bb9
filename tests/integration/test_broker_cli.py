"""``lbd broker`` as an operator starts it: what stops it from starting is one line, not a
traceback, and a usage error is told apart from a failure."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_process import Sidecar, serve_process

from lbd.devcluster import EtcdServer, PulsarLiteServer

pytestmark = [pytest.mark.servers, pytest.mark.timeout(90)]


def broker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "lbd.cli.main",
            "broker",
            "--set",
            "front.metrics_addr=",
            "--set",
            "front.web_addr=",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def sidecar(
    etcd_server: EtcdServer, pulsar_server: PulsarLiteServer, tmp_path: Path
) -> Iterator[Sidecar]:
    with serve_process(etcd_server, pulsar_server, tmp_path, "broker-cli-1") as process:
        yield process


def test_a_sidecar_that_cannot_be_reached_is_one_line_and_exit_1() -> None:
    done = broker(
        "--broker-id", "b1", "--sidecar", "127.0.0.1:1", "--set", "cluster.startup_timeout_s=1"
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "the sidecar at 127.0.0.1:1 cannot be reached" in lines[0]


def test_a_port_in_use_is_one_line_and_exit_1(sidecar: Sidecar) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = broker(
            "--broker-id",
            "broker-cli-1",
            "--sidecar",
            sidecar.grpc_addr,
            "--addr",
            f"127.0.0.1:{port}",
        )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"lbd: error: cannot listen on 127.0.0.1:{port}: the port is in use"
    )


def test_settings_that_break_a_rule_are_a_usage_error_naming_the_keys() -> None:
    done = broker("--broker-id", "b1", "--set", "front.drain_timeout_s=60")
    assert done.returncode == 2
    assert "front.drain_timeout_s: must be < broker.release_ack_timeout_s" in done.stderr


def test_a_broker_id_is_required() -> None:
    done = broker("--sidecar", "127.0.0.1:1")
    assert done.returncode == 2
    assert "broker.broker_id is not set" in done.stderr
