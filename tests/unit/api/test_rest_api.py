"""Pulsar's REST API (:mod:`lbd.front.rest`) in front of a real gRPC API of in-memory sidecars:
the translation of paths, bodies, roles and statuses, without a dev cluster (the e2e suite runs
the same on real processes, with the official client)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from lbd.api.auth import AuthConfig
from lbd.front.http import Request, Response
from lbd.front.rest import (
    BrokerView,
    RestApi,
    WebUrls,
    bundles_data,
    local_broker_data,
    lookup_data,
)
from lbd.gen.v1 import lbd_pb2
from tests.unit.api.served import Api, serve_api, until
from tests.unit.services.harness import Harness

READER = "tok-reader"
ADMIN = "tok-admin"
NS = "public/rest"
TOPIC = f"persistent://{NS}/t"


def view(**changes: Any) -> BrokerView:
    fields: dict[str, Any] = {
        "broker_id": "broker-a",
        "cluster": "test",
        "web": WebUrls("http://broker-a:8080"),
        "service_url": "pulsar://broker-a:6650",
        "service_url_tls": "",
        "version": "lbd-front/test",
        "serving": lambda: None,
        "load_report": lambda: None,
    }
    return BrokerView(**{**fields, **changes})


def request(
    method: str, path: str, *, token: str | None = ADMIN, body: Any = None, query: str = ""
) -> Request:
    data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {} if token is None else {"authorization": f"Bearer {token}"}
    params: dict[str, list[str]] = {}
    for pair in filter(None, query.split("&")):
        key, _, value = pair.partition("=")
        params.setdefault(key, []).append(value)
    return Request(method, path, params, headers, data, "127.0.0.1:1", False)


def reason(response: Response) -> str:
    value = json.loads(response.body)
    assert isinstance(value["reason"], str)
    return str(value["reason"])


@dataclass
class Served:
    api: Api
    rest: RestApi

    async def __call__(self, method: str, path: str, **kwargs: Any) -> Response:
        return await self.rest(request(method, path, **kwargs))


@pytest.fixture
async def served(harness: Harness, tmp_path: Path) -> AsyncIterator[Served]:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"reader ops-reader {READER}\nadmin ops {ADMIN}\n")
    sidecar = await harness.add("broker-a")
    await harness.ready()
    async with serve_api(harness, sidecar, auth=AuthConfig(tokens_file=tokens)) as api:
        await until(lambda: api.elector.is_leader)
        yield Served(api, RestApi(api.channel, view()))


def admin_md() -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {ADMIN}"),)


async def test_a_lookup_answers_the_owner_s_urls_as_lookup_data(served: Served) -> None:
    await served.api.admin.CreateNamespace(
        lbd_pb2.CreateNamespaceRequest(namespace=NS, bundles=4), metadata=admin_md()
    )
    answer = await served("GET", f"/lookup/v2/topic/persistent/{NS}/t", token=READER)
    assert answer.status == 200, answer.body
    assert json.loads(answer.body) == {
        "brokerUrl": "pulsar://broker-a:6650",
        "httpUrl": "http://broker-a:8080",
        "nativeUrl": "pulsar://broker-a:6650",
        "brokerUrlSsl": "",
    }
    bundle = await served("GET", f"/lookup/v2/topic/persistent/{NS}/t/bundle", token=READER)
    looked = await served.api.lb.Lookup(lbd_pb2.LookupRequest(topic=TOPIC), metadata=admin_md())
    assert (bundle.status, f"{NS}/{bundle.body.decode()}") == (200, looked.bundle)


async def test_refusals_name_the_role_with_pulsar_s_status(served: Served) -> None:
    lookup = f"/lookup/v2/topic/persistent/{NS}/t"
    anonymous = await served("GET", lookup, token=None)
    assert anonymous.status == 401 and "reader role" in reason(anonymous)
    unload = f"/admin/v2/namespaces/{NS}/0x00000000_0x40000000/unload"
    await served("PUT", f"/admin/v2/namespaces/{NS}")
    by_reader = await served("PUT", unload, token=READER)
    assert by_reader.status == 403 and "admin role" in reason(by_reader)  # a namespace operation
    brokers = await served("GET", "/admin/v2/brokers/test", token=None)
    assert brokers.status == 401


async def test_unknown_paths_and_methods(served: Served) -> None:
    missing = await served("GET", "/admin/v2/nothing/here")
    assert missing.status == 404 and "Not Found" in reason(missing)
    wrong = await served("POST", "/admin/v2/brokers/health")
    assert wrong.status == 405 and wrong.headers["Allow"] == "GET"


async def test_a_namespace_s_life_under_pulsar_s_paths(served: Served) -> None:
    created = await served("PUT", f"/admin/v2/namespaces/{NS}", body={"bundles": {"numBundles": 2}})
    assert created.status == 204
    assert (await served("PUT", f"/admin/v2/namespaces/{NS}")).status == 409
    assert NS in json.loads((await served("GET", "/admin/v2/namespaces/public")).body)
    assert (await served("GET", "/admin/v2/namespaces/nobody")).status == 404
    bundles = json.loads((await served("GET", f"/admin/v2/namespaces/{NS}/bundles")).body)
    assert bundles == {"boundaries": ["0x00000000", "0x80000000", "0xffffffff"], "numBundles": 2}
    group = f"/admin/v2/namespaces/{NS}/antiAffinity"
    assert (await served("GET", group)).status == 204
    assert (await served("POST", group, body=b"spread")).status == 204
    assert (await served("GET", group)).body == b"spread"
    assert (await served("POST", group, body=b"  ")).status == 412
    policy = {"namespaces": [NS], "primary": ["broker-a"], "secondary": []}
    isolation = "/admin/v2/clusters/test/namespaceIsolationPolicies"
    assert (await served("GET", isolation)).status == 404
    assert (await served("POST", f"{isolation}/anything", body=policy)).status == 204
    listed = json.loads((await served("GET", isolation)).body)
    assert listed["public.rest"]["primary"] == ["broker-a"]
    assert listed["public.rest"]["auto_failover_policy"]["parameters"]["min_limit"] == "1"
    info = await served.api.admin.GetNamespace(
        lbd_pb2.GetNamespaceRequest(namespace=NS), metadata=admin_md()
    )
    assert list(info.policies.isolation_primary) == ["broker-a"]
    assert info.policies.anti_affinity_group == "spread"  # kept beside the isolation
    assert (await served("POST", f"{isolation}/x", body={"namespaces": [NS]})).status == 400
    assert (await served("POST", "/admin/v2/clusters/other/namespaceIsolationPolicies/p",
                         body=policy)).status == 412  # fmt: skip
    assert (await served("DELETE", f"{isolation}/public.rest")).status == 204
    assert (await served("GET", f"{isolation}/public.rest")).status == 404


async def test_bad_input_is_refused_before_anything_changes(served: Served) -> None:
    await served("PUT", f"/admin/v2/namespaces/{NS}")
    before = await served.api.admin.ListBundles(lbd_pb2.ListBundlesRequest(), metadata=admin_md())
    for method, path, body, status in [
        ("GET", f"/lookup/v2/topic/persistent/{NS}/a\x01b", None, 412),
        ("PUT", f"/admin/v2/namespaces/{NS}/0xzz_0x1/unload", None, 412),
        ("PUT", f"/admin/v2/namespaces/{NS}/0x00000000_0x30000000/unload", None, 412),
        ("PUT", f"/admin/v2/namespaces/{NS}/0x00000000_0x40000000/split", b"[1,", 400),
        ("PUT", f"/admin/v2/namespaces/{NS}/0x00000000_0x40000000/split", [-1], 412),
        ("PUT", "/admin/v2/namespaces/public/x", {"bundles": {"numBundles": 0}}, 400),
        ("PUT", "/admin/v2/namespaces/public/x", {"bundles": {"boundaries": ["0x0", "0x1"]}}, 412),
        ("PUT", "/admin/v2/namespaces/public/x", b"[]", 400),
    ]:
        answer = await served(method, path, body=body)
        assert answer.status == status, (path, answer.body)
        assert reason(answer)
    unknown = await served(
        "PUT",
        f"/admin/v2/namespaces/{NS}/0x00000000_0x40000000/unload",
        query="destinationBroker=nobody",
    )
    assert unknown.status == 409 and "inactive destination broker" in reason(unknown)
    after = await served.api.admin.ListBundles(lbd_pb2.ListBundlesRequest(), metadata=admin_md())
    assert after == before


async def test_a_lookup_whose_sidecar_does_not_answer_is_redirected_once(
    unused_tcp_port: int,
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{unused_tcp_port}") as channel:
        rest = RestApi(channel, view())
        rest.learn_brokers({"broker-b": WebUrls("http://broker-b:8080")})
        path = "/lookup/v2/topic/persistent/public/default/t"
        moved = await rest(request("GET", path, query="listenerName=x"))
        assert moved.status == 307
        assert moved.headers["Location"] == (
            f"http://broker-b:8080{path}?listenerName=x&authoritative=true"
        )
        asked = await rest(request("GET", path, query="authoritative=true"))
        assert asked.status == 503


async def test_health_says_why_the_broker_does_not_serve(served: Served) -> None:
    rest = RestApi(served.api.channel, view(serving=lambda: "no session with its sidecar"))
    sick = await rest(request("GET", "/admin/v2/brokers/health"))
    assert sick.status == 503 and "no session with its sidecar" in reason(sick)
    well = await served("GET", "/admin/v2/brokers/health")
    assert (well.status, well.body) == (200, b"ok")


def test_lookup_data_always_carries_broker_url_and_broker_url_ssl() -> None:
    tls_only = lbd_pb2.OwnerUrls(
        service_url_tls="pulsar+ssl://b:6651", web_service_url_tls="https://b:8443"
    )
    assert lookup_data(tls_only) == {
        "brokerUrl": "",
        "brokerUrlTls": "pulsar+ssl://b:6651",
        "httpUrlTls": "https://b:8443",
        "brokerUrlSsl": "",
    }


def test_bundles_data_lists_every_boundary() -> None:
    ids = ["p/n/0x00000000_0x20000000", "p/n/0x20000000_0x80000000", "p/n/0x80000000_0xffffffff"]
    assert bundles_data(ids) == {
        "boundaries": ["0x00000000", "0x20000000", "0x80000000", "0xffffffff"],
        "numBundles": 3,
    }


def test_the_load_report_sums_its_bundles_as_local_broker_data() -> None:
    report = lbd_pb2.LoadReport(
        cpu=lbd_pb2.ResourceUsage(usage=50, limit=200),
        bandwidth_in=lbd_pb2.ResourceUsage(usage=10, limit=100),
        bundles=[
            lbd_pb2.BundleStats(bundle="p/n/a", msg_rate_in=3, topics=2, producer_count=1),
            lbd_pb2.BundleStats(bundle="p/n/b", msg_rate_in=4, topics=1, consumer_count=5),
        ],
    )
    data = local_broker_data(view(), report)
    assert (data["msgRateIn"], data["numTopics"], data["numProducers"]) == (7, 3, 1)
    assert data["numConsumers"] == 5 and data["numBundles"] == 2
    assert data["bundles"] == ["p/n/a", "p/n/b"] and data["lastStats"] == data["bundleStats"]
    assert data["cpu"] == {"usage": 50, "limit": 200} and data["maxResourceUsage"] == 0.25
    assert "webServiceUrlTls" not in data and data["webServiceUrl"] == "http://broker-a:8080"
