"""End to end on a ``lbd dev up --secure`` cluster: mutual TLS, roles and the hijack refused.

An outsider holding a certificate of the cluster's CA for another broker id tries what an
anonymous caller could do before roles existed: hold broker-2's BrokerSession. It is refused, and
the real broker-2 keeps its session and its bundles; lookups keep answering with its URL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from lbd.broker.credentials import ClientCredentials
from lbd.devcluster.pki import DevPki
from lbd.devcluster.secure import PKI_DIR
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from tests.e2e.clusters import Cluster, lbd, own_topics, start_cluster, stop_cluster, wait_for

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]

NAMESPACE = "e2e/secure"
BUNDLES = 6
VICTIM = "broker-2"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    running = start_cluster(
        tmp_path_factory.mktemp("secure"), 3, "shedding.interval_s=3600", secure=True
    )
    try:
        own_topics(running, NAMESPACE, BUNDLES)
        yield running
    finally:
        stop_cluster(running)


def issued(cluster: Cluster, stem: str, name: str, role: str) -> ClientCredentials:
    """A certificate of the cluster's own CA (what a stolen or mis-issued one looks like)."""
    pki = DevPki(cluster.state_dir / PKI_DIR)
    files = pki.issue(stem, name, role=role)
    return ClientCredentials(ca_file=pki.ca_file, cert_file=files.cert, key_file=files.key)


def hijack(addr: str, credentials: ClientCredentials) -> grpc.RpcError:
    """Open a BrokerSession claiming VICTIM at ``addr``; the error that ends it."""
    hello = lbd_pb2.BrokerMessage(
        hello=lbd_pb2.BrokerInfo(broker_id=VICTIM, service_url="pulsar://attacker.example:6650")
    )
    stop = threading.Event()

    def messages() -> Iterator[lbd_pb2.BrokerMessage]:
        yield hello
        stop.wait(10)

    with credentials.channel(addr) as channel:
        call = lbd_pb2_grpc.LoadBalancerStub(channel).BrokerSession(messages(), timeout=10)
        try:
            for _ in call:
                pass
        except grpc.RpcError as e:
            return e
        finally:
            stop.set()
    raise AssertionError("the hijacking session ended without an error")


def victim_events(cluster: Cluster) -> list[dict[str, object]]:
    return [e for e in cluster.events() if e["broker"] == VICTIM]


def test_a_broker_session_for_another_broker_id_is_refused_and_the_real_one_undisturbed(
    cluster: Cluster,
) -> None:
    owners = cluster.owners(NAMESPACE)
    if VICTIM not in owners.values():
        bundle = sorted(owners)[0]
        cluster.client().transfer(bundle, VICTIM)
        wait_for(
            "the victim owns a bundle",
            lambda: VICTIM in cluster.owners(NAMESPACE).values() or None,
            20,
        )
    before = victim_events(cluster)
    outsider = issued(cluster, "outsider", "broker-9", "broker")
    for node in cluster.record.nodes:  # its own sidecar and the others: all refuse
        error = hijack(node.grpc_addr, outsider)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error
        assert "may open a BrokerSession only for broker broker-9" in (error.details() or "")
    time.sleep(1)
    after = victim_events(cluster)[len(before) :]
    assert [e for e in after if e["event"] in ("session", "close")] == []
    victim_bundles = sorted(b for b, o in cluster.owners(NAMESPACE).items() if o == VICTIM)
    assert victim_bundles
    for node in cluster.record.nodes:
        with cluster.channel(node.grpc_addr) as channel:
            stub = lbd_pb2_grpc.AdminStub(channel)
            listed = stub.ListBrokers(lbd_pb2.ListBrokersRequest(), timeout=10)
        urls = {
            b.info.broker_id: b.info.service_url or b.info.service_url_tls for b in listed.brokers
        }
        assert urls[VICTIM] == cluster.record.node(VICTIM).service_url  # the real broker's


def test_roles_are_enforced_by_certificate(cluster: Cluster) -> None:
    reader = issued(cluster, "reader-e2e", "dash", "reader")
    addr = cluster.addr()
    with reader.channel(addr) as channel:
        admin = lbd_pb2_grpc.AdminStub(channel)
        assert admin.GetLeader(lbd_pb2.GetLeaderRequest(), timeout=10).broker_id
        with pytest.raises(grpc.RpcError) as refused:
            admin.Unload(lbd_pb2.UnloadRequest(bundle=f"{NAMESPACE}/0x0_0x1"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "needs the admin role" in (refused.value.details() or "")
    foreign = DevPki(Path(cluster.state_dir) / "foreign-ca")
    files = foreign.issue("admin", "mallory", role="admin")
    ca = cluster.credentials.ca_file
    for creds in (
        ClientCredentials(ca_file=ca),  # no client certificate
        ClientCredentials(ca_file=ca, cert_file=files.cert, key_file=files.key),  # foreign CA
        ClientCredentials(),  # plaintext
    ):
        with creds.channel(addr) as channel, pytest.raises(grpc.RpcError) as failed:
            lbd_pb2_grpc.AdminStub(channel).GetLeader(lbd_pb2.GetLeaderRequest(), timeout=5)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE


def test_lbd_ctl_works_with_the_dev_env_and_not_without(cluster: Cluster) -> None:
    done = cluster.ctl("--output", "json", "leader")
    assert done.returncode == 0, done.stderr
    probe = cluster.ctl("health")  # the readiness probe of deploy/kubernetes, over TLS
    assert (probe.returncode, probe.stdout.strip()) == (0, "SERVING"), probe.stderr
    bare = lbd("ctl", "--server", cluster.addr(), "leader", env={}, timeout_s=60)
    assert bare.returncode != 0
    assert bare.stderr.startswith("lbd: error: UNAVAILABLE"), bare.stderr
