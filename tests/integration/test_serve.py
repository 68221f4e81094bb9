"""``lbd serve`` as operators run it: a subprocess against real etcd and pulsar-lite.

The sidecar stands alone (``broker.auto_ack = true``) on free ports; the test waits for its health
to say SERVING, looks a topic up and lists the brokers with a gRPC client and with ``grpcurl``
(through server reflection), reads ``/metrics``, then stops it with SIGTERM and checks that it
exits cleanly within the grace and that its registration left etcd.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aetcd
import grpc
import pytest
from serve_process import Sidecar, serve_process, wait_serving

from lbd.devcluster import EtcdServer, PulsarLiteServer
from lbd.devcluster.ports import free_ports
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc

pytestmark = [pytest.mark.servers, pytest.mark.timeout(90)]

GRPCURL = Path(sys.executable).parent / "grpcurl"
BROKER = "broker-serve-1"
GRACE_S = 2.0
CALL_TIMEOUT_S = 15.0
TOPIC = "persistent://public/default/serve-test"


@pytest.fixture
def sidecar(
    etcd_server: EtcdServer, pulsar_server: PulsarLiteServer, tmp_path: Path
) -> Iterator[Sidecar]:
    """``lbd serve`` on free ports in a cluster (and channel topics) of this test's own."""
    with serve_process(etcd_server, pulsar_server, tmp_path, BROKER) as process:
        yield process


def grpcurl(*args: str) -> str:
    """Run grpcurl (plaintext, through reflection) and return its stdout."""
    done = subprocess.run(
        [str(GRPCURL), "-plaintext", *args],
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"grpcurl {' '.join(args)} failed: {done.stderr}"
    return done.stdout


def registration(etcd: EtcdServer, cluster: str) -> bytes | None:
    """The broker's registration in etcd, or None."""
    import asyncio

    async def get() -> bytes | None:
        client = aetcd.Client(etcd.host, etcd.port, timeout=5)
        try:
            kv = await client.get(f"/lbd/{cluster}/brokers/{BROKER}".encode())
            return None if kv is None else bytes(kv.value)
        finally:
            await client.close()

    return asyncio.run(get())


def test_serve_answers_then_stops_cleanly(sidecar: Sidecar, etcd_server: EtcdServer) -> None:
    wait_serving(sidecar)

    with grpc.insecure_channel(sidecar.grpc_addr) as channel:
        lookup = lbd_pb2_grpc.LoadBalancerStub(channel).Lookup(
            lbd_pb2.LookupRequest(topic=TOPIC), timeout=CALL_TIMEOUT_S
        )
        brokers = lbd_pb2_grpc.AdminStub(channel).ListBrokers(
            lbd_pb2.ListBrokersRequest(), timeout=CALL_TIMEOUT_S
        )
    assert lookup.owner_broker_id == BROKER
    assert lookup.state == lbd_pb2.BUNDLE_STATE_OWNED
    assert lookup.bundle.startswith("public/default/0x")
    assert lookup.owner.service_url == "pulsar://127.0.0.1:6650"
    assert [b.info.broker_id for b in brokers.brokers] == [BROKER]
    assert brokers.brokers[0].info.sidecar_grpc_addr == sidecar.grpc_addr

    services = grpcurl(sidecar.grpc_addr, "list").split()
    assert {"lbd.v1.LoadBalancer", "lbd.v1.Admin", "grpc.health.v1.Health"} <= set(services)
    again = json.loads(
        grpcurl("-d", json.dumps({"topic": TOPIC}), sidecar.grpc_addr, "lbd.v1.LoadBalancer/Lookup")
    )
    assert again["bundle"] == lookup.bundle, again
    assert again["owner_broker_id"] == BROKER, again  # grpcurl keeps the proto names
    listed = json.loads(grpcurl(sidecar.grpc_addr, "lbd.v1.Admin/ListBrokers"))
    assert [b["info"]["broker_id"] for b in listed["brokers"]] == [BROKER]

    with urllib.request.urlopen(f"http://{sidecar.metrics_addr}/metrics", timeout=5) as reply:
        metrics = reply.read().decode()
    assert 'lbd_assign_total{reason="Lookup",result="Success"} 1.0' in metrics
    assert "lbd_assign_latency_seconds_count 1.0" in metrics
    assert 'lbd_channel_publish_ops_total{result="Success",state="Assigning"} 1.0' in metrics
    assert 'lbd_channel_publish_ops_total{result="Success",state="Owned"} 1.0' in metrics

    with grpc.insecure_channel(sidecar.grpc_addr) as channel:
        unloaded = lbd_pb2_grpc.AdminStub(channel).Unload(
            lbd_pb2.UnloadRequest(bundle=lookup.bundle), timeout=CALL_TIMEOUT_S
        )
    assert unloaded.src_broker_id == BROKER
    with urllib.request.urlopen(f"http://{sidecar.metrics_addr}/metrics", timeout=5) as reply:
        after = reply.read().decode()
    assert 'lbd_unload_total{reason="Admin",result="Success"} 1.0' in after
    assert "lbd_unload_latency_seconds_count 1.0" in after
    assert "lbd_release_latency_seconds_count 1.0" in after
    assert 'lbd_channel_publish_ops_total{result="Success",state="Free"} 1.0' in after
    assert "lbd_owned_bundles 1.0" in metrics

    assert registration(etcd_server, sidecar.cluster) is not None
    started = time.monotonic()
    sidecar.process.send_signal(signal.SIGTERM)
    try:
        code = sidecar.process.wait(timeout=GRACE_S + 10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"lbd serve did not stop after SIGTERM:\n{sidecar.log_text()}")
    assert code == 0, sidecar.log_text()
    assert time.monotonic() - started < GRACE_S + 10
    assert "Traceback" not in sidecar.log_text()
    assert registration(etcd_server, sidecar.cluster) is None


def test_serve_without_broker_id_is_a_usage_error(etcd_server: EtcdServer) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lbd.cli.main", "serve", "--etcd-endpoints", etcd_server.client_url],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("LBD_")},
    )
    assert done.returncode == 2, done.stderr
    assert "broker" in done.stderr and "--broker-id" in done.stderr
    assert "Traceback" not in done.stderr


def registered_lease(etcd: EtcdServer, cluster: str) -> int:
    """The lease the broker's registration lives under."""
    import asyncio

    async def get() -> int:
        client = aetcd.Client(etcd.host, etcd.port, timeout=5)
        try:
            kv = await client.get(f"/lbd/{cluster}/brokers/{BROKER}".encode())
            assert kv is not None, "the broker is not registered"
            return int(kv.lease)
        finally:
            await client.close()

    return asyncio.run(get())


def revoke(etcd: EtcdServer, lease: int) -> None:
    """Revoke ``lease`` as an operator (or an etcd that expired it) would."""
    import asyncio

    async def run() -> None:
        client = aetcd.Client(etcd.host, etcd.port, timeout=5)
        try:
            await client.revoke_lease(lease)
        finally:
            await client.close()

    asyncio.run(run())


def test_the_shutdown_policy_ends_serve_when_the_lease_is_lost(
    etcd_server: EtcdServer, pulsar_server: PulsarLiteServer, tmp_path: Path
) -> None:
    env = {
        "LBD_ETCD__SESSION_EXPIRED_POLICY": "shutdown",
        "LBD_ETCD__RECONNECT_RETRIES": "0",
        "LBD_ETCD__LEASE_TTL_S": "6",
        "LBD_ETCD__KEEPALIVE_INTERVAL_S": "1",
        "LBD_ETCD__REQUEST_TIMEOUT_S": "1",
        "LBD_ETCD__FENCE_AFTER_S": "6",
        "LBD_MONITOR__ORPHAN_CLEANUP_GRACE_S": "25",
    }
    with serve_process(etcd_server, pulsar_server, tmp_path, BROKER, env) as sidecar:
        wait_serving(sidecar)
        revoke(etcd_server, registered_lease(etcd_server, sidecar.cluster))
        try:
            code = sidecar.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"lbd serve kept running without its session:\n{sidecar.log_text()}")
        log = sidecar.log_text()
    assert code == 3, log
    assert "etcd.session_expired_policy = shutdown" in log, log
    assert "Traceback" not in log, log


def test_serve_against_an_unreachable_pulsar_exits_soon_with_one_line(
    etcd_server: EtcdServer,
) -> None:
    (port,) = free_ports(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LBD_")}
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lbd.cli.main",
            "serve",
            "--broker-id",
            BROKER,
            "--grpc-addr",
            f"127.0.0.1:{free_ports(1)[0]}",
            "--etcd-endpoints",
            etcd_server.client_url,
            "--pulsar-url",
            f"pulsar://127.0.0.1:{port}",  # nothing listens there
            "--cluster",
            "unreachable-pulsar",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**env, "LBD_BROKER__AUTO_ACK": "true"},
    )
    took = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    # Soon: well inside the Pulsar operation timeout (30 s) a client still retrying would wait
    # out. The rest is the interpreter's start and lbd's imports, which a busy machine stretches
    # to several seconds.
    assert took < 20, f"took {took:.1f}s"
    ours = [line for line in done.stderr.splitlines() if line.startswith("lbd: error:")]
    assert len(ours) == 1 and "reading the state channel from Pulsar" in ours[0], done.stderr
    assert "Traceback" not in done.stderr
