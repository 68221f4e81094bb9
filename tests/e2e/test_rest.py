"""Pulsar's REST API on a dev cluster's brokers (plain, and TLS with ``LBD_TEST_SECURE``), with
the fixtures written from Pulsar's documented API: what ``pulsar-admin`` and a client with an
``http://`` service URL send, and what Pulsar answers.

The sidecars authenticate with tokens (``auth.tokens_file``): a reader's and an admin's, the
same tokens the gRPC API takes.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from lbd.devcluster.processes import client_tls_context
from lbd.traffic.clients import ClientTls, ClientTraffic, TrafficSpec
from lbd.traffic.records import summarize
from tests.e2e.clusters import (
    Cluster,
    lbd,
    own_topics,
    start_cluster,
    stop_cluster,
    wait_for,
)

pytestmark = [pytest.mark.servers, pytest.mark.timeout(240)]

NAMESPACE = "e2e/rest"
BUNDLES = 4
READER = "reader-token-e2e-rest"
ADMIN = "admin-token-e2e-rest"
OPERATOR = "operator-token-e2e-rest"


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def reason(self) -> str:
        value = self.json()
        assert isinstance(value, dict) and isinstance(value.get("reason"), str), self.body
        return str(value["reason"])


@dataclass
class Rest:
    """HTTP calls to the brokers' web services, as ``curl`` makes them (no redirect followed)."""

    cluster: Cluster
    context: ssl.SSLContext | None

    def url(self, broker: str | None = None) -> str:
        nodes = {n.broker_id: n for n in self.cluster.record.nodes}
        return nodes[broker or self.cluster.broker_ids[0]].web_url

    def call(
        self,
        method: str,
        path: str,
        *,
        token: str | None = ADMIN,
        body: Any = None,
        broker: str | None = None,
        timeout_s: float = 40,
    ) -> Answer:
        base = urlsplit(self.url(broker))
        if base.scheme == "https":
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                base.netloc, timeout=timeout_s, context=self.context
            )
        else:
            conn = http.client.HTTPConnection(base.netloc, timeout=timeout_s)
        headers = {"Accept": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            return Answer(
                response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
            )
        finally:
            conn.close()

    def client_tls(self) -> ClientTls | None:
        files = self.cluster.record.pulsar_client
        if not files:
            return None
        return ClientTls(files["ca_file"], files.get("cert_file"), files.get("key_file"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("rest")
    tokens = base / "tokens"
    tokens.write_text(f"reader ops-reader {READER}\nadmin ops-admin {ADMIN}\n")
    running = start_cluster(
        base / "cluster",
        3,
        f"auth.tokens_file={tokens}",
        f"grpc.admin_token={OPERATOR}",
        "shedding.interval_s=3600",
        "split.interval_s=3600",
    )
    try:
        own_topics(running, NAMESPACE, BUNDLES)
        yield running
    finally:
        stop_cluster(running)


@pytest.fixture(scope="module")
def rest(cluster: Cluster) -> Rest:
    files = cluster.record.pulsar_client
    return Rest(cluster, client_tls_context(files) if files else None)


def topic(n: int) -> str:
    return f"persistent://{NAMESPACE}/rest-{n}"


def bundle_of(rest: Rest, name: str) -> str:
    answer = rest.call("GET", f"/lookup/v2/topic/{name.replace('://', '/')}/bundle")
    assert answer.status == 200, answer.body
    return answer.body.decode()


# -- lookups --------------------------------------------------------------------------------


def test_an_http_lookup_names_the_owner_the_sidecars_name(rest: Rest, cluster: Cluster) -> None:
    urls = {n.broker_id: (n.service_url, n.web_url) for n in cluster.record.nodes}
    for n in range(6):
        for broker in cluster.broker_ids:
            answer = rest.call(
                "GET", f"/lookup/v2/topic/{topic(n).replace('://', '/')}", broker=broker
            )
            assert answer.status == 200, answer.body
            data = answer.json()
            owner = cluster.client().lookup(topic(n)).owner_broker_id
            service_url, web_url = urls[owner]
            if service_url.startswith("pulsar+ssl"):
                expected = {"brokerUrl": "", "brokerUrlTls": service_url, "httpUrlTls": web_url}
            else:
                expected = {"brokerUrl": service_url, "httpUrl": web_url, "nativeUrl": service_url}
            assert data == {**expected, "brokerUrlSsl": ""}


def test_the_bundle_of_a_topic_is_its_range(rest: Rest, cluster: Cluster) -> None:
    looked = cluster.client().lookup(topic(0))
    assert f"{NAMESPACE}/{bundle_of(rest, topic(0))}" == looked.bundle


def test_every_topic_is_non_partitioned(rest: Rest) -> None:
    answer = rest.call("GET", f"/admin/v2/persistent/{NAMESPACE}/rest-0/partitions")
    assert answer.status == 200
    assert answer.json()["partitions"] == 0


def test_the_official_client_with_an_http_url_produces_and_consumes_through_every_broker(
    rest: Rest, cluster: Cluster
) -> None:
    for i, broker in enumerate(cluster.broker_ids):
        traffic = ClientTraffic(
            TrafficSpec(
                service_url=rest.url(broker),
                topics=tuple(topic(10 + 4 * i + k) for k in range(4)),
                rate=20.0,
                subscription=f"rest-{broker}",
                tls=rest.client_tls(),
                token=READER,
            )
        )
        traffic.start()
        time.sleep(2.0)
        traffic.stop()
        figures = summarize(traffic.record)
        assert figures.acknowledged >= 4 * 20, figures.line()
        assert (figures.failed, figures.lost, figures.pending) == (0, 0, 0), figures.line()
        assert not traffic.errors


def test_the_official_client_with_an_http_url_follows_a_transfer_made_over_http(
    rest: Rest, cluster: Cluster
) -> None:
    name = topic(40)
    traffic = ClientTraffic(
        TrafficSpec(
            service_url=rest.url(),
            topics=(name,),
            rate=100.0,
            subscription="rest-transfer",
            tls=rest.client_tls(),
            token=READER,
        )
    )
    traffic.start()
    try:
        time.sleep(1.0)
        bundle = bundle_of(rest, name)
        owner = cluster.client().lookup(name).owner_broker_id
        target = next(b for b in cluster.broker_ids if b != owner)
        moved = rest.call(
            "PUT",
            f"/admin/v2/namespaces/{NAMESPACE}/{bundle}/unload?destinationBroker={target}",
        )
        assert moved.status == 204, moved.body
        assert cluster.client().lookup(name).owner_broker_id == target
        time.sleep(1.5)
    finally:
        traffic.stop()
    figures = summarize(traffic.record)
    assert (figures.failed, figures.lost, figures.pending) == (0, 0, 0), figures.line()
    assert figures.acknowledged >= 150, figures.line()


# -- brokers ----------------------------------------------------------------------------------


def test_brokers_leader_health_and_ready(rest: Rest, cluster: Cluster) -> None:
    listed = rest.call("GET", f"/admin/v2/brokers/{cluster.record.cluster}")
    assert listed.status == 200
    assert sorted(listed.json()) == sorted(cluster.broker_ids)
    leader = rest.call("GET", "/admin/v2/brokers/leaderBroker").json()
    assert leader["brokerId"] == cluster.client().leader().broker_id
    assert leader["serviceUrl"] == rest.url(leader["brokerId"])
    for broker in cluster.broker_ids:
        for path in ("/admin/v2/brokers/health", "/admin/v2/brokers/ready"):
            answer = rest.call("GET", path, broker=broker)
            assert (answer.status, answer.body) == (200, b"ok")
    assert rest.call("GET", "/admin/v2/brokers/elsewhere").status == 404


def test_owned_namespaces_are_the_channel_s_owned_bundles(rest: Rest, cluster: Cluster) -> None:
    owners = cluster.owners(NAMESPACE)
    brokers = f"/admin/v2/brokers/{cluster.record.cluster}"
    for broker in cluster.broker_ids:
        answer = rest.call("GET", f"{brokers}/{broker}/ownedNamespaces")
        assert answer.status == 200
        owned = {b for b in answer.json() if b.startswith(NAMESPACE + "/")}
        assert owned == {b for b, o in owners.items() if o == broker}
        for status in answer.json().values():
            assert status == {"broker_assignment": "shared", "is_controlled": False,
                              "is_active": True}  # fmt: skip
    assert rest.call("GET", f"{brokers}/nobody/ownedNamespaces").status == 404


def test_the_load_report_is_the_broker_s_own(rest: Rest, cluster: Cluster) -> None:
    for broker in cluster.broker_ids:
        answer = rest.call("GET", "/admin/v2/broker-stats/load-report", broker=broker)
        assert answer.status == 200, answer.body
        data = answer.json()
        assert data["webServiceUrl" if rest.context is None else "webServiceUrlTls"] == rest.url(
            broker
        )
        for resource in ("cpu", "memory", "directMemory", "bandwidthIn", "bandwidthOut"):
            assert set(data[resource]) == {"usage", "limit"}
        assert data["numBundles"] == len(data["bundles"]) == len(data["lastStats"])


# -- namespaces and bundles -------------------------------------------------------------------


def test_namespaces_are_created_listed_and_described(rest: Rest) -> None:
    created = rest.call(
        "PUT", "/admin/v2/namespaces/e2e/created", body={"bundles": {"numBundles": 8}}
    )
    assert created.status == 204, created.body
    again = rest.call("PUT", "/admin/v2/namespaces/e2e/created")
    assert again.status == 409 and "already exists" in again.reason
    assert {"e2e/rest", "e2e/created"} <= set(rest.call("GET", "/admin/v2/namespaces/e2e").json())
    bundles = rest.call("GET", "/admin/v2/namespaces/e2e/created/bundles").json()
    assert bundles["numBundles"] == 8
    assert bundles["boundaries"][0] == "0x00000000" and bundles["boundaries"][-1] == "0xffffffff"
    assert len(bundles["boundaries"]) == 9
    policies = rest.call("GET", "/admin/v2/namespaces/e2e/created").json()
    assert policies["bundles"] == bundles
    equal = rest.call(
        "PUT",
        "/admin/v2/namespaces/e2e/by-boundaries",
        body={"bundles": {"boundaries": ["0x00000000", "0x80000000", "0xffffffff"]}},
    )
    assert equal.status == 204, equal.body
    assert (
        rest.call("GET", "/admin/v2/namespaces/e2e/by-boundaries/bundles").json()["numBundles"] == 2
    )


def test_a_split_over_http_splits_and_unloads_the_children(rest: Rest, cluster: Cluster) -> None:
    own_topics(cluster, "e2e/splits", 4)
    first = "0x00000000_0x40000000"
    assert f"e2e/splits/{first}" in cluster.owners("e2e/splits")
    split = rest.call(
        "PUT",
        f"/admin/v2/namespaces/e2e/splits/{first}/split"
        "?unload=true&splitAlgorithmName=range_equally_divide",
    )
    assert split.status == 204, split.body
    bundles = rest.call("GET", "/admin/v2/namespaces/e2e/splits/bundles").json()
    assert bundles["boundaries"][:3] == ["0x00000000", "0x20000000", "0x40000000"]
    owners = cluster.owners("e2e/splits")
    for child in ("0x00000000_0x20000000", "0x20000000_0x40000000"):
        assert f"e2e/splits/{child}" not in owners  # unloaded: assigned again by lookup


def test_a_namespace_unload_frees_every_owned_bundle(rest: Rest, cluster: Cluster) -> None:
    assert rest.call("PUT", "/admin/v2/namespaces/e2e/unloads", body={}).status == 204
    for n in range(8):
        cluster.client().lookup(f"persistent://e2e/unloads/t-{n}")
    assert cluster.owners("e2e/unloads")
    assert rest.call("PUT", "/admin/v2/namespaces/e2e/unloads/unload").status == 204
    assert cluster.owners("e2e/unloads") == {}


def test_anti_affinity_and_isolation_under_pulsar_s_paths(rest: Rest, cluster: Cluster) -> None:
    base = "/admin/v2/namespaces/e2e/rest/antiAffinity"
    assert rest.call("POST", base, body=b"spread").status == 204
    got = rest.call("GET", base)
    assert (got.status, got.body) == (200, b"spread")
    assert rest.call("DELETE", base).status == 204
    assert rest.call("GET", base).status == 204
    policy = {
        "namespaces": ["e2e/created"],
        "primary": [cluster.broker_ids[0]],
        "secondary": ["broker-.*"],
        "auto_failover_policy": {
            "policy_type": "min_available",
            "parameters": {"min_limit": "1", "usage_threshold": "80"},
        },
    }
    path = f"/admin/v2/clusters/{cluster.record.cluster}/namespaceIsolationPolicies"
    assert rest.call("POST", f"{path}/e2e.created", body=policy).status == 204
    listed = rest.call("GET", path).json()
    assert listed["e2e.created"]["primary"] == [cluster.broker_ids[0]]
    assert listed["e2e.created"]["namespaces"] == ["e2e/created"]
    assert rest.call("GET", f"{path}/e2e.created").json()["secondary"] == ["broker-.*"]
    assert rest.call("DELETE", f"{path}/e2e.created").status == 204
    assert rest.call("GET", f"{path}/e2e.created").status == 404


# -- auth and bad input -----------------------------------------------------------------------


def test_a_refused_call_gets_pulsar_s_status_and_names_the_role(
    rest: Rest, cluster: Cluster
) -> None:
    lookup = f"/lookup/v2/topic/{topic(0).replace('://', '/')}"
    anonymous = rest.call("GET", lookup, token=None)
    assert anonymous.status == 401 and "reader role" in anonymous.reason
    forged = rest.call("GET", lookup, token="not-a-token")
    assert forged.status == 401 and "not valid" in forged.reason
    assert rest.call("GET", lookup, token=READER).status == 200
    bundle = bundle_of(rest, topic(0))
    before = cluster.owners(NAMESPACE)
    reader = rest.call("PUT", f"/admin/v2/namespaces/{NAMESPACE}/{bundle}/unload", token=READER)
    assert reader.status == 403 and "admin role" in reader.reason, reader.body
    assert rest.call("PUT", "/admin/v2/namespaces/e2e/nope", token=None).status == 401
    assert cluster.owners(NAMESPACE) == before


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "words"),
    [
        ("GET", "/lookup/v2/topic/persistent/e2e/rest/a%01b", None, 412, "Invalid topic name"),
        ("GET", "/lookup/v2/topic/queue/e2e/rest/t", None, 404, "Not Found"),
        ("PUT", "/admin/v2/namespaces/e2e/rest/0x0_0x1/unload", None, 412, "Invalid bundle"),
        ("PUT", "/admin/v2/namespaces/e2e/rest/0x00000000_0x30000000/unload",
         None, 412, "Cannot find"),
        ("PUT", "/admin/v2/namespaces/e2e/none/0x00000000_0x40000000/unload", None, 404,
         "Namespace does not exist"),
        ("PUT", "/admin/v2/namespaces/e2e/rest/0x00000000_0x40000000/unload?destinationBroker=x",
         None, 409, "inactive destination broker"),
        ("PUT", "/admin/v2/namespaces/e2e/rest/0x00000000_0x40000000/split?splitAlgorithmName=x",
         None, 412, "unknown split algorithm"),
        ("PUT", "/admin/v2/namespaces/e2e/rest/0x00000000_0x40000000/split",
         b"[1,", 400, "not JSON"),
        ("PUT", "/admin/v2/namespaces/e2e/bad",
         {"bundles": {"numBundles": 0}}, 400, "Invalid number"),
        ("PUT", "/admin/v2/namespaces/e2e/bad",
         {"bundles": {"boundaries": ["0x00000000", "0x10000000", "0xffffffff"]}}, 412, "equally"),
        ("PUT", "/admin/v2/namespaces/e2e/bad", b"[]", 400, "Policies"),
        ("GET", "/admin/v2/namespaces/e2e/none/bundles", None, 404, "does not exist"),
        ("DELETE", "/admin/v2/brokers/health", None, 405, "Method Not Allowed"),
    ],
)  # fmt: skip
def test_bad_input_gets_pulsar_s_status_and_changes_nothing(
    rest: Rest,
    cluster: Cluster,
    method: str,
    path: str,
    body: Any,
    status: int,
    words: str,
) -> None:
    before = cluster.client().bundles().bundles
    answer = rest.call(method, path, body=body)
    assert answer.status == status, answer.body
    assert words in answer.reason
    assert cluster.client().bundles().bundles == before


# -- a sidecar that does not answer -----------------------------------------------------------


def test_a_lookup_at_a_broker_whose_sidecar_is_stopped_is_redirected(
    rest: Rest, cluster: Cluster
) -> None:
    victim = cluster.broker_ids[-1]
    node = next(n for n in cluster.record.nodes if n.broker_id == victim)
    path = f"/lookup/v2/topic/{topic(0).replace('://', '/')}"
    os.kill(node.sidecar.pid, signal.SIGSTOP)
    try:
        redirected = rest.call("GET", path, broker=victim)
        assert redirected.status == 307, redirected.body
        location = urlsplit(redirected.headers["location"])
        assert f"{location.scheme}://{location.netloc}" in {
            rest.url(b) for b in cluster.broker_ids if b != victim
        }
        assert location.path == path and location.query == "authoritative=true"
        again = rest.call("GET", f"{path}?authoritative=true", broker=victim)
        assert again.status == 503, again.body
    finally:
        os.kill(node.sidecar.pid, signal.SIGCONT)
    wait_for(
        f"{victim}'s REST lookups answer again",
        lambda: rest.call("GET", path, broker=victim).status == 200 or None,
        timeout_s=30,
    )


# -- the README's lines ---------------------------------------------------------------------

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_rest_lines() -> list[str]:
    """The curl and python lines of the README's block that starts with ``lbd dev web``."""
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S)
    block = next(b for b in blocks if "lbd dev web" in b)
    return [
        line.strip() for line in block.splitlines() if line.strip().startswith(("curl ", "python "))
    ]


def test_the_readme_rest_examples_work_as_written(rest: Rest, cluster: Cluster) -> None:
    lines = readme_rest_lines()
    assert len(lines) == 4, lines
    bundle = "public/default/0x00000000_0x40000000"
    cluster.client().lookup("persistent://public/default/my-topic")
    if cluster.owners("public/default").get(bundle) == "broker-2":
        cluster.client().transfer(bundle, "broker-1")
    files = cluster.record.pulsar_client
    curl = f"curl --fail-with-body -H 'Authorization: Bearer {ADMIN}'"
    client = f"authentication=pulsar.AuthenticationToken('{READER}')"
    if files:
        curl += (
            f" --cacert {files['ca_file']} --cert {files['cert_file']} --key {files['key_file']}"
        )
        client += (
            f", tls_trust_certs_file_path='{files['ca_file']}'"
            f", tls_certificate_file_path='{files['cert_file']}'"
            f", tls_private_key_file_path='{files['key_file']}'"
        )
    web = lbd("dev", "web", "--state-dir", str(cluster.state_dir))
    assert (web.returncode, web.stdout.strip()) == (0, rest.url("broker-1")), web.stderr
    outputs = []
    for line in lines:
        command = line.replace("curl ", f"{curl} ", 1).replace("python ", f"{sys.executable} ", 1)
        command = command.replace("pulsar.Client('$W')", f"pulsar.Client('$W', {client})")
        done = subprocess.run(
            ["bash", "-c", command],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "W": rest.url("broker-1")},
        )
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        outputs.append(done.stdout)
    before, after = json.loads(outputs[0]), json.loads(outputs[2])
    assert before != after
    nodes = {n.broker_id: n for n in cluster.record.nodes}
    assert nodes["broker-2"].service_url in after.values()
    assert cluster.owners("public/default")[bundle] == "broker-2"
