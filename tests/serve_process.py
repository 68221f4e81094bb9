"""``lbd serve`` as a child process on free loopback ports, for tests that need the real daemon."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest

from lbd.devcluster import EtcdServer, PulsarLiteServer
from lbd.devcluster.ports import LOOPBACK, free_ports
from lbd.devcluster.processes import health_serving

STARTUP_TIMEOUT_S = 45.0


class Sidecar:
    """A running ``lbd serve`` child and where it listens."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        grpc_addr: str,
        metrics_addr: str,
        log: Path,
        cluster: str,
    ) -> None:
        self.process = process
        self.grpc_addr = grpc_addr
        self.metrics_addr = metrics_addr
        self.log = log
        self.cluster = cluster

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def serve_process(
    etcd_server: EtcdServer,
    pulsar_server: PulsarLiteServer,
    workdir: Path,
    broker: str,
    env: Mapping[str, str] = {},
) -> Iterator[Sidecar]:
    """``lbd serve`` (auto-ack) on free ports in a cluster and channel topics of its own;
    ``env`` adds or overrides ``LBD_*`` settings. Killed on exit if still running."""
    grpc_port, metrics_port = free_ports(2)
    cluster = f"serve-{uuid.uuid4().hex[:12]}"
    topic_base = f"public/default/{cluster}"
    env = {
        **os.environ,
        "LBD_BROKER__AUTO_ACK": "true",
        "LBD_BROKER__ADVERTISED_SERVICE_URL": "pulsar://127.0.0.1:6650",
        "LBD_BROKER__ADVERTISED_WEB_URL": "http://127.0.0.1:8080",
        "LBD_GRPC__SHUTDOWN_GRACE_S": "2",
        "LBD_PULSAR__STATE_CHANNEL_TOPIC": f"persistent://{topic_base}-channel",
        "LBD_PULSAR__BROKER_LOAD_TOPIC": f"non-persistent://{topic_base}-broker-load",
        "LBD_PULSAR__TOP_BUNDLES_TOPIC": f"non-persistent://{topic_base}-top-bundles",
        **env,
    }
    grpc_addr = f"{LOOPBACK}:{grpc_port}"
    metrics_addr = f"{LOOPBACK}:{metrics_port}"
    log = workdir / f"serve-{broker}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lbd.cli.main",
                "serve",
                "--broker-id",
                broker,
                "--grpc-addr",
                grpc_addr,
                "--metrics-addr",
                metrics_addr,
                "--etcd-endpoints",
                etcd_server.client_url,
                "--pulsar-url",
                pulsar_server.service_url,
                "--cluster",
                cluster,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        yield Sidecar(process, grpc_addr, metrics_addr, log, cluster)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def wait_serving(sidecar: Sidecar) -> None:
    """Poll the health service until SERVING; fail with the sidecar's log otherwise."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if sidecar.process.poll() is not None:
            pytest.fail(
                f"lbd serve exited with {sidecar.process.returncode}:\n{sidecar.log_text()}"
            )
        if health_serving(sidecar.grpc_addr, timeout_s=1.0):
            return
        time.sleep(0.1)
    pytest.fail(f"lbd serve was not SERVING after {STARTUP_TIMEOUT_S}s:\n{sidecar.log_text()}")
