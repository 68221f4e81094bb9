"""Pulsar's REST API on the broker's web port: the lookups and admin calls of ownership and load.

Paths, parameters, JSON shapes and status codes are Apache Pulsar's (``LookupResource``,
``admin/v2`` ``Brokers``, ``Namespaces``, ``Clusters``, ``BrokerStats``), so a client with an
``http://`` service URL and the scripts that call ``pulsar-admin``'s endpoints work against an
lbd cluster. docs/operating.md lists what is served and where lbd differs.

Every call but the broker's own (``health``, ``ready``, ``load-report``'s data) is a call of the
sidecar's gRPC API, made with the caller's ``Authorization`` header as its metadata (or, without
one, as an anonymous caller, :data:`~lbd.api.auth.ANONYMOUS_CALLER`): roles, audit and the
leader's forwarding are the gRPC API's own, there is one home for each, and this module only
translates. gRPC statuses become Pulsar's: UNAUTHENTICATED 401, PERMISSION_DENIED 403 on a
namespace and 401 on a topic or broker (as Pulsar refuses them), NOT_FOUND 404, ALREADY_EXISTS
409, INVALID_ARGUMENT and FAILED_PRECONDITION 412, UNAVAILABLE and DEADLINE_EXCEEDED 503, the rest
500, each with ``{"reason": ...}``. Fields without a value are left out of the JSON, as Pulsar's
Jackson writes them.

A topic lookup whose sidecar cannot answer is redirected (307, as Pulsar redirects a lookup it
cannot serve) to another broker's web service with ``authoritative=true``; a broker asked
authoritatively answers itself or fails with 503, so a redirect never loops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lbd.api.auth import ANONYMOUS_CALLER, AUTHORIZATION
from lbd.core.bundles import default_boundaries, parse_bundle_id
from lbd.core.errors import InvalidInputError
from lbd.core.names import NamespaceName, TopicName
from lbd.front.http import Request, Response
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc

_log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0
"""A call of the sidecar's API not answered within this fails with 503 (Pulsar's lookup and
admin operations time out at 30 s)."""
LOOKUP_HOLD_S = 25.0
"""A lookup of a topic whose owner is not registered (gone, not yet replaced) is answered once
it has one, waiting at most this long (``front.lookup_hold_s`` for binary lookups)."""
LOOKUP_RETRY_S = 0.25
LOOKUP_CALL_S = 5.0
"""A sidecar that has not answered a lookup within this is taken as down: the lookup is
redirected to another broker (a 307), well within the client's 30 s operation timeout."""

_STATUS = {
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.INVALID_ARGUMENT: 412,
    grpc.StatusCode.FAILED_PRECONDITION: 412,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 503,
}
_DOMAINS = "(persistent|non-persistent)"
_NAME = r"([^/]+)"
_SPLIT_KEYS = ("unload", "splitAlgorithmName")


class Refusal(Exception):
    """A call answered with an error status: what the caller sees."""

    def __init__(self, status: int, reason: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.code = code
        """The sidecar's status code, when the sidecar refused."""


@dataclass(frozen=True, slots=True)
class WebUrls:
    """A broker's web service URLs (either may be empty)."""

    http: str = ""
    https: str = ""


@dataclass(frozen=True, slots=True)
class BrokerView:
    """What the REST API reads of its own broker: who it is, whether it may serve now, and its
    latest load report (the one its sidecar got; none before the first)."""

    broker_id: str
    cluster: str
    web: WebUrls
    service_url: str
    service_url_tls: str
    version: str
    serving: Callable[[], str | None]
    """None when the broker serves (session open, lease valid), else why not."""
    load_report: Callable[[], lbd_pb2.LoadReport | None]


Route = tuple[str, re.Pattern[str], Callable[..., Awaitable[Response]]]


class RestApi:
    """Answers one :class:`~lbd.front.http.Request` (the module docstring)."""

    def __init__(self, channel: grpc.aio.Channel, broker: BrokerView) -> None:
        self._lb = lbd_pb2_grpc.LoadBalancerStub(channel)
        self._admin = lbd_pb2_grpc.AdminStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        self._me = broker
        self._others: dict[str, WebUrls] = {}
        self._turn = 0
        lookup = rf"/lookup/v2/topic/{_DOMAINS}/{_NAME}/{_NAME}/{_NAME}"
        ns = rf"/admin/v2/namespaces/{_NAME}/{_NAME}"
        policies = rf"/admin/v2/clusters/{_NAME}/namespaceIsolationPolicies"
        self._routes: list[Route] = [
            ("GET", re.compile(lookup), self._lookup),
            ("GET", re.compile(lookup + "/bundle"), self._lookup_bundle),
            (
                "GET",
                re.compile(rf"/admin/v2/{_DOMAINS}/{_NAME}/{_NAME}/{_NAME}/partitions"),
                self._partitions,
            ),
            ("GET", re.compile("/admin/v2/brokers/leaderBroker"), self._leader),
            ("GET", re.compile("/admin/v2/brokers/health"), self._broker_health),
            ("GET", re.compile("/admin/v2/brokers/ready"), self._ready),
            ("GET", re.compile(r"/admin/v2/brokers/([^/]+)/([^/]+)/ownedNamespaces"), self._owned),
            ("GET", re.compile(r"/admin/v2/brokers/([^/]+)"), self._brokers),
            ("GET", re.compile("/admin/v2/clusters"), self._clusters),
            ("GET", re.compile(policies), self._isolation_list),
            ("GET", re.compile(policies + rf"/{_NAME}"), self._isolation_get),
            ("POST", re.compile(policies + rf"/{_NAME}"), self._isolation_set),
            ("DELETE", re.compile(policies + rf"/{_NAME}"), self._isolation_delete),
            ("GET", re.compile("/admin/v2/broker-stats/load-report"), self._load_report),
            ("GET", re.compile(rf"/admin/v2/namespaces/{_NAME}"), self._namespaces),
            ("PUT", re.compile(ns), self._create_namespace),
            ("GET", re.compile(ns), self._policies),
            ("GET", re.compile(ns + "/bundles"), self._bundles),
            ("PUT", re.compile(ns + "/unload"), self._unload_namespace),
            ("GET", re.compile(ns + "/antiAffinity"), self._anti_affinity_get),
            ("POST", re.compile(ns + "/antiAffinity"), self._anti_affinity_set),
            ("DELETE", re.compile(ns + "/antiAffinity"), self._anti_affinity_delete),
            ("PUT", re.compile(ns + rf"/{_NAME}/unload"), self._unload_bundle),
            ("PUT", re.compile(ns + rf"/{_NAME}/split"), self._split_bundle),
        ]

    def learn_brokers(self, web: Mapping[str, WebUrls]) -> None:
        """The other brokers' web services, where a lookup goes when this sidecar cannot
        answer (refreshed from ListBrokers)."""
        self._others = {b: urls for b, urls in web.items() if b != self._me.broker_id}

    async def __call__(self, request: Request) -> Response:
        allowed: list[str] = []
        for method, pattern, handler in self._routes:
            match = pattern.fullmatch(request.path.rstrip("/") or "/")
            if match is None:
                continue
            if method != request.method and not (method == "GET" and request.method == "HEAD"):
                allowed.append(method)
                continue
            try:
                return await handler(request, *match.groups())
            except Refusal as e:
                status = e.status
                if e.code is grpc.StatusCode.PERMISSION_DENIED and not request.path.startswith(
                    "/admin/v2/namespaces/"
                ):
                    status = 401  # Pulsar's status for a topic or broker operation refused
                return Response.error(status, e.reason)
        if allowed:
            methods = ", ".join(sorted(set(allowed)))
            refused = Response.error(405, f"HTTP 405 Method Not Allowed: use {methods}")
            return dataclasses.replace(refused, headers={"Allow": methods})
        return Response.error(404, f"HTTP 404 Not Found: {request.path}")

    # -- lookups ------------------------------------------------------------------------------

    async def _lookup(
        self, request: Request, domain: str, tenant: str, namespace: str, local: str
    ) -> Response:
        """``LookupData`` of the topic's owner, or a 307 to another broker's web service."""
        topic = _topic(domain, tenant, namespace, local)
        authoritative = _flag(request, "authoritative")
        try:
            answer = await self._owned_lookup(request, topic)
        except Refusal as e:
            sidecar_down = e.code in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
            if not sidecar_down or authoritative or not self._others:
                raise
            return self._elsewhere(request, e.reason)
        return Response.json(200, lookup_data(answer.owner))

    async def _lookup_bundle(
        self, request: Request, domain: str, tenant: str, namespace: str, local: str
    ) -> Response:
        """The range of the bundle the topic hashes to (a plain string, as Pulsar answers)."""
        topic = _topic(domain, tenant, namespace, local)
        answer = await self._call(
            self._lb.Lookup, lbd_pb2.LookupRequest(topic=topic, read_only=True), request
        )
        return Response.text(200, answer.bundle.rpartition("/")[2])

    async def _owned_lookup(self, request: Request, topic: str) -> lbd_pb2.LookupResponse:
        """The sidecar's Lookup, repeated while the owner is not registered (a failover under
        way), at most :data:`LOOKUP_HOLD_S`."""
        deadline = time.monotonic() + LOOKUP_HOLD_S
        while True:
            answer: lbd_pb2.LookupResponse = await self._call(
                self._lb.Lookup, lbd_pb2.LookupRequest(topic=topic), request, LOOKUP_CALL_S
            )
            if answer.HasField("owner"):
                return answer
            left = deadline - time.monotonic()
            if left <= 0:
                raise Refusal(
                    503,
                    f"{topic}: its owner {answer.owner_broker_id or '(none)'} is not registered "
                    "(gone, not yet replaced)",
                )
            await asyncio.sleep(min(LOOKUP_RETRY_S, left))

    def _elsewhere(self, request: Request, why: str) -> Response:
        """307 to another broker's web service, asked authoritatively."""
        others = sorted(self._others)
        self._turn = (self._turn + 1) % len(others)
        urls = self._others[others[self._turn]]
        base = urls.https if request.tls and urls.https else (urls.http or urls.https)
        query = "&".join(
            f"{quote(k)}={quote(v)}"
            for k, values in request.query.items()
            if k != "authoritative"
            for v in values
        )
        location = f"{base}{quote(request.path)}?{query + '&' if query else ''}authoritative=true"
        _log.info(
            "HTTP lookup %s: the sidecar cannot answer (%s): sent to %s", request.path, why, base
        )
        return Response(307, b"", headers={"Location": location})

    async def _partitions(
        self, request: Request, domain: str, tenant: str, namespace: str, local: str
    ) -> Response:
        """``PartitionedTopicMetadata``: lbd keeps none, every topic is non-partitioned (a
        partition ``-partition-N`` is a topic of its own, as to the binary protocol)."""
        _topic(domain, tenant, namespace, local)
        await self._call(self._admin.GetLeader, lbd_pb2.GetLeaderRequest(), request)
        return Response.json(200, {"partitions": 0})

    # -- brokers ------------------------------------------------------------------------------

    async def _brokers(self, request: Request, cluster: str) -> Response:
        """The registered brokers' ids."""
        self._check_cluster(cluster, 404)
        listed = await self._list_brokers(request)
        return Response.json(200, [b.info.broker_id for b in listed.brokers])

    async def _leader(self, request: Request) -> Response:
        """``LeaderBroker``: the leader's broker id and web service URL."""
        listed = await self._list_brokers(request)
        for b in listed.brokers:
            if b.leader:
                url = b.info.web_service_url or b.info.web_service_url_tls
                return Response.json(200, {"brokerId": b.info.broker_id, "serviceUrl": url})
        raise Refusal(404, "Couldn't find leader broker: the sidecars are electing one")

    async def _owned(self, request: Request, cluster: str, broker: str) -> Response:
        """``NamespaceOwnershipStatus`` of every bundle Owned by ``broker``."""
        self._check_cluster(cluster, 404)
        listed = await self._list_brokers(request)
        if broker not in {b.info.broker_id for b in listed.brokers}:
            raise Refusal(404, f"Broker id '{broker}' not found in available brokers.")
        bundles = await self._call(self._admin.ListBundles, lbd_pb2.ListBundlesRequest(), request)
        return Response.json(
            200,
            {
                b.bundle: {"broker_assignment": "shared", "is_controlled": False, "is_active": True}
                for b in bundles.bundles
                if b.owner_broker_id == broker and b.state == lbd_pb2.BUNDLE_STATE_OWNED
            },
        )

    async def _broker_health(self, request: Request) -> Response:
        """ "ok" while this broker serves (session with its sidecar, valid serving lease) and its
        sidecar's health is SERVING; 503 naming what is wrong otherwise."""
        why = self._me.serving()
        if why is None:
            try:
                checked = await self._health.Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=5.0
                )
            except grpc.aio.AioRpcError as e:
                why = f"the sidecar does not answer: {e.code().name}"
            else:
                if checked.status != health_pb2.HealthCheckResponse.SERVING:
                    name = health_pb2.HealthCheckResponse.ServingStatus.Name(checked.status)
                    why = f"the sidecar's health is {name}"
        if why is not None:
            raise Refusal(503, f"broker {self._me.broker_id} is not healthy: {why}")
        return Response.text(200, "ok")

    async def _ready(self, request: Request) -> Response:
        """ "ok": the web port is open once the broker has started."""
        return Response.text(200, "ok")

    async def _clusters(self, request: Request) -> Response:
        return Response.json(200, [self._me.cluster])

    async def _load_report(self, request: Request) -> Response:
        """This broker's latest load report, in ``LocalBrokerData``'s fields."""
        await self._call(self._admin.GetLeader, lbd_pb2.GetLeaderRequest(), request)
        report = self._me.load_report()
        if report is None:
            raise Refusal(503, f"broker {self._me.broker_id} has not measured its load yet")
        return Response.json(200, local_broker_data(self._me, report))

    # -- namespaces ---------------------------------------------------------------------------

    async def _namespaces(self, request: Request, tenant: str) -> Response:
        """The tenant's namespaces (``tenant/namespace``)."""
        _check_tenant(tenant)
        listed = await self._call(self._admin.ListBundles, lbd_pb2.ListBundlesRequest(), request)
        names = sorted(
            {
                b.bundle.rpartition("/")[0]
                for b in listed.bundles
                if b.bundle.startswith(tenant + "/")
            }
        )
        if not names:
            raise Refusal(404, f"Tenant not found: {tenant} has no namespace")
        return Response.json(200, names)

    async def _create_namespace(self, request: Request, tenant: str, namespace: str) -> Response:
        """Create the namespace: ``bundles.numBundles`` equal bundles (or boundaries that
        divide the range equally) from a ``Policies`` body; its other policies are not lbd's."""
        name = _namespace(tenant, namespace)
        body = _json_body(request, dict, "a Policies object", optional=True) or {}
        count = _bundle_count(body.get("bundles"))
        try:
            await self._call(
                self._admin.CreateNamespace,
                lbd_pb2.CreateNamespaceRequest(namespace=name, bundles=count),
                request,
            )
        except Refusal as e:
            if e.code is grpc.StatusCode.FAILED_PRECONDITION:
                raise Refusal(409, f"Namespace already exists: {name}") from None
            raise
        return Response(204)

    async def _policies(self, request: Request, tenant: str, namespace: str) -> Response:
        """The namespace's ``Policies``: its bundles (the anti-affinity group is not one of
        them in Pulsar either: ``antiAffinity`` reads it)."""
        info = await self._namespace_info(request, tenant, namespace)
        return Response.json(
            200,
            {
                "bundles": bundles_data(info.bundles),
                "replication_clusters": [self._me.cluster],
                "deleted": False,
            },
        )

    async def _bundles(self, request: Request, tenant: str, namespace: str) -> Response:
        """``BundlesData``: the namespace's boundaries and bundle count."""
        info = await self._namespace_info(request, tenant, namespace)
        return Response.json(200, bundles_data(info.bundles))

    async def _unload_namespace(self, request: Request, tenant: str, namespace: str) -> Response:
        """Unload every Owned bundle of the namespace (each is assigned again by lookup)."""
        name = _namespace(tenant, namespace)
        listed = await self._call(
            self._admin.ListBundles, lbd_pb2.ListBundlesRequest(namespace=name), request
        )
        for b in listed.bundles:
            if b.state == lbd_pb2.BUNDLE_STATE_OWNED:
                await self._call(
                    self._admin.Unload, lbd_pb2.UnloadRequest(bundle=b.bundle), request
                )
        return Response(204)

    async def _unload_bundle(
        self, request: Request, tenant: str, namespace: str, bundle: str
    ) -> Response:
        """Unload the bundle, or with ``destinationBroker`` transfer it there (as the
        extensible load manager does)."""
        bundle_id = await self._existing_bundle(request, tenant, namespace, bundle)
        scheme, sep, rest = (request.param("destinationBroker") or "").partition("://")
        destination = rest if sep else scheme  # Pulsar strips an http(s):// prefix
        if destination:
            listed = await self._list_brokers(request)
            if destination not in {b.info.broker_id for b in listed.brokers}:
                raise Refusal(
                    409,
                    "Not allowed unload namespace bundle to inactive destination broker "
                    f"{destination}",
                )
            await self._call(
                self._admin.Transfer,
                lbd_pb2.TransferRequest(bundle=bundle_id, dst_broker_id=destination),
                request,
            )
        else:
            await self._call(self._admin.Unload, lbd_pb2.UnloadRequest(bundle=bundle_id), request)
        return Response(204)

    async def _split_bundle(
        self, request: Request, tenant: str, namespace: str, bundle: str
    ) -> Response:
        """Split the bundle with ``splitAlgorithmName`` (default range_equally_divide) at the
        body's boundaries (a JSON list of hash positions, for specified_positions_divide);
        with ``unload=true`` unload the children afterwards."""
        bundle_id = await self._existing_bundle(request, tenant, namespace, bundle)
        positions = _json_body(request, list, "a list of split positions", optional=True) or []
        for p in positions:
            if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p <= 0xFFFFFFFF:
                raise Refusal(412, f"split boundary {p!r} is not a hash position 0..0xffffffff")
        algorithm = request.param("splitAlgorithmName") or ""
        split = await self._call(
            self._admin.Split,
            lbd_pb2.SplitRequest(bundle=bundle_id, algorithm=algorithm, boundaries=positions),
            request,
        )
        if _flag(request, "unload"):
            for child in split.children:
                await self._call(self._admin.Unload, lbd_pb2.UnloadRequest(bundle=child), request)
        return Response(204)

    async def _anti_affinity_get(self, request: Request, tenant: str, namespace: str) -> Response:
        info = await self._namespace_info(request, tenant, namespace)
        group = info.policies.anti_affinity_group
        return Response.text(200, group) if group else Response(204)

    async def _anti_affinity_set(self, request: Request, tenant: str, namespace: str) -> Response:
        """Put the namespace in the anti-affinity group the body names (plain text)."""
        group = request.body.decode(errors="replace").strip()
        if group.startswith('"') and group.endswith('"'):
            group = group[1:-1]
        if not group:
            raise Refusal(412, "the body must name the anti-affinity group")
        await self._update_policies(request, tenant, namespace, anti_affinity_group=group)
        return Response(204)

    async def _anti_affinity_delete(
        self, request: Request, tenant: str, namespace: str
    ) -> Response:
        await self._update_policies(request, tenant, namespace, anti_affinity_group="")
        return Response(204)

    # -- isolation policies -------------------------------------------------------------------

    async def _isolation_list(self, request: Request, cluster: str) -> Response:
        """Each isolated namespace's policy, named after the namespace."""
        self._check_cluster(cluster)
        listed = await self._call(self._admin.ListBundles, lbd_pb2.ListBundlesRequest(), request)
        out: dict[str, Any] = {}
        for name in sorted({b.bundle.rpartition("/")[0] for b in listed.bundles}):
            info = await self._call(
                self._admin.GetNamespace, lbd_pb2.GetNamespaceRequest(namespace=name), request
            )
            if info.policies.isolation_primary:
                out[_policy_name(name)] = isolation_data(name, info.policies)
        if not out:
            raise Refusal(404, f"NamespaceIsolationPolicies for cluster {cluster} does not exist")
        return Response.json(200, out)

    async def _isolation_get(self, request: Request, cluster: str, policy: str) -> Response:
        self._check_cluster(cluster)
        name = _policy_namespace(policy)
        info = await self._call(
            self._admin.GetNamespace, lbd_pb2.GetNamespaceRequest(namespace=name), request
        )
        if not info.policies.isolation_primary:
            raise Refusal(
                404, f"Cannot find NamespaceIsolationPolicy {policy} for cluster {cluster}"
            )
        return Response.json(200, isolation_data(name, info.policies))

    async def _isolation_set(self, request: Request, cluster: str, policy: str) -> Response:
        """Apply a ``NamespaceIsolationData`` to each namespace it lists (exact names: lbd
        keeps isolation per namespace, not as a cluster policy matched by regex)."""
        self._check_cluster(cluster)
        data = _json_body(request, dict, "a NamespaceIsolationData object")
        namespaces = data.get("namespaces")
        primary = data.get("primary")
        secondary = data.get("secondary") or []
        if not _strings(namespaces) or not namespaces:
            raise _bad_policy("namespaces must be a non-empty list of tenant/namespace names")
        if not _strings(primary) or not primary:
            raise _bad_policy("primary must be a non-empty list of broker patterns")
        if not _strings(secondary):
            raise _bad_policy("secondary must be a list of broker patterns")
        min_limit = _min_limit(data.get("auto_failover_policy"))
        for name in namespaces:
            tenant, _, namespace = name.partition("/")
            await self._update_policies(
                request,
                tenant,
                namespace,
                isolation=(tuple(primary), tuple(secondary), min_limit),
            )
        return Response(204)

    async def _isolation_delete(self, request: Request, cluster: str, policy: str) -> Response:
        self._check_cluster(cluster)
        tenant, _, namespace = _policy_namespace(policy).partition("/")
        await self._update_policies(request, tenant, namespace, isolation=None)
        return Response(204)

    # -- helpers ------------------------------------------------------------------------------

    async def _call(
        self,
        method: Callable[..., Any],
        message: Any,
        request: Request,
        timeout_s: float = CALL_TIMEOUT_S,
    ) -> Any:
        """One call of the sidecar's API as the HTTP caller."""
        try:
            return await method(message, metadata=_metadata(request), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            status = _STATUS.get(e.code(), 500)
            raise Refusal(status, e.details() or e.code().name, e.code()) from e

    async def _list_brokers(self, request: Request) -> lbd_pb2.ListBrokersResponse:
        listed: lbd_pb2.ListBrokersResponse = await self._call(
            self._admin.ListBrokers, lbd_pb2.ListBrokersRequest(), request
        )
        return listed

    async def _namespace_info(
        self, request: Request, tenant: str, namespace: str
    ) -> lbd_pb2.NamespaceInfo:
        name = _namespace(tenant, namespace)
        try:
            info: lbd_pb2.NamespaceInfo = await self._call(
                self._admin.GetNamespace, lbd_pb2.GetNamespaceRequest(namespace=name), request
            )
        except Refusal as e:
            if e.status == 404:
                raise Refusal(404, f"Namespace does not exist: {name}") from None
            raise
        return info

    async def _existing_bundle(
        self, request: Request, tenant: str, namespace: str, bundle: str
    ) -> str:
        """The id of a bundle the namespace has now: 404 without the namespace, 412 for a
        range that is not one of its bundles (as Pulsar checks them)."""
        bundle_id = _bundle(tenant, namespace, bundle)
        info = await self._namespace_info(request, tenant, namespace)
        if bundle_id not in info.bundles:
            raise Refusal(412, f"Cannot find bundle in the bundles list: {bundle_id}")
        return bundle_id

    async def _update_policies(
        self, request: Request, tenant: str, namespace: str, **change: Any
    ) -> None:
        """Read the namespace's policies, change some, write them back."""
        info = await self._namespace_info(request, tenant, namespace)
        policies = lbd_pb2.NamespacePolicies()
        policies.CopyFrom(info.policies)
        if "anti_affinity_group" in change:
            policies.anti_affinity_group = change["anti_affinity_group"]
        if "isolation" in change:
            del policies.isolation_primary[:]
            del policies.isolation_secondary[:]
            policies.ClearField("isolation_min_primaries")
            if change["isolation"] is not None:
                primary, secondary, min_limit = change["isolation"]
                policies.isolation_primary.extend(primary)
                policies.isolation_secondary.extend(secondary)
                policies.isolation_min_primaries = min_limit
        await self._call(
            self._admin.SetNamespacePolicies,
            lbd_pb2.SetNamespacePoliciesRequest(namespace=info.namespace, policies=policies),
            request,
        )

    def _check_cluster(self, cluster: str, status: int = 412) -> None:
        if cluster != self._me.cluster:
            raise Refusal(status, f"Cluster {cluster} does not exist (this is {self._me.cluster}).")


def _metadata(request: Request) -> tuple[tuple[str, str], ...]:
    """The caller's credentials for the sidecar: its token, or none (anonymous)."""
    token = request.headers.get(AUTHORIZATION)
    if token:
        return ((AUTHORIZATION, token),)
    return ((ANONYMOUS_CALLER, "true"),)


def _flag(request: Request, name: str) -> bool:
    return (request.param(name) or "").lower() == "true"


def _topic(domain: str, tenant: str, namespace: str, local: str) -> str:
    text = f"{domain}://{tenant}/{namespace}/{local}"
    try:
        return str(TopicName.parse(text))
    except InvalidInputError as e:
        raise Refusal(412, f"Invalid topic name: {e}") from None


def _check_tenant(tenant: str) -> None:
    try:
        NamespaceName(tenant, "x")
    except InvalidInputError as e:
        raise Refusal(412, f"Invalid tenant name {tenant!r}: {e}") from None


def _namespace(tenant: str, namespace: str) -> str:
    try:
        return str(NamespaceName(tenant, namespace))
    except InvalidInputError as e:
        raise Refusal(412, f"Invalid namespace name: {e}") from None


def _bundle(tenant: str, namespace: str, bundle: str) -> str:
    name = _namespace(tenant, namespace)
    try:
        return parse_bundle_id(f"{name}/{bundle}").id
    except InvalidInputError as e:
        raise Refusal(412, f"Invalid bundle range {bundle!r}: {e}") from None


def _json_body(request: Request, kind: type, what: str, *, optional: bool = False) -> Any:
    if not request.body.strip():
        if optional:
            return None
        raise Refusal(400, f"the body must be {what}")
    try:
        value = json.loads(request.body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Refusal(400, f"the body is not JSON: {e}") from None
    if not isinstance(value, kind):
        raise Refusal(400, f"the body must be {what}, got {type(value).__name__}")
    return value


def _bundle_count(bundles: Any) -> int:
    """The bundle count a ``BundlesData`` asks for (0: the default)."""
    if bundles is None:
        return 0
    if not isinstance(bundles, dict):
        raise Refusal(412, "bundles must be an object with numBundles or boundaries")
    boundaries = bundles.get("boundaries")
    count = bundles.get("numBundles")
    if boundaries:
        try:
            points = tuple(int(b, 16) if isinstance(b, str) else int(b) for b in boundaries)
        except (TypeError, ValueError):
            raise Refusal(412, f"bundles.boundaries are not hash positions: {boundaries}") from None
        n = len(points) - 1
        if n < 1 or points != default_boundaries(n):
            raise Refusal(
                412,
                "bundles.boundaries must divide the hash range equally (lbd creates namespaces "
                "of equal bundles; split a bundle to change its boundaries)",
            )
        if count is not None and count != n:
            raise Refusal(412, f"bundles.numBundles {count} does not match {n + 1} boundaries")
        count = n
    if count is None:
        return 0
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise Refusal(
            400,
            "Invalid number of bundles. Number of bundles has to be in the range of (0, 2^32]: "
            f"got {count!r}",
        )
    return count


def lookup_data(owner: lbd_pb2.OwnerUrls) -> dict[str, str]:
    """``LookupData`` of an owner: the URLs it has, and ``brokerUrl`` and ``brokerUrlSsl``
    always, empty when the broker has no such port (the C++ client fails on an answer without
    ``brokerUrl``, or with neither ``brokerUrlTls`` nor ``brokerUrlSsl``)."""
    data = {
        "brokerUrl": owner.service_url,
        "brokerUrlTls": owner.service_url_tls,
        "httpUrl": owner.web_service_url,
        "httpUrlTls": owner.web_service_url_tls,
        "nativeUrl": owner.service_url,
    }
    present = {k: v for k, v in data.items() if v}
    return {"brokerUrl": owner.service_url, **present, "brokerUrlSsl": ""}


def bundles_data(bundle_ids: Sequence[str]) -> dict[str, Any]:
    """``BundlesData`` of a namespace's bundles (ids in hash order)."""
    ranges = [parse_bundle_id(b).range for b in bundle_ids]
    bounds = [r.lo for r in ranges] + ([ranges[-1].hi] if ranges else [])
    return {"boundaries": [f"0x{b:08x}" for b in bounds], "numBundles": len(ranges)}


def isolation_data(namespace: str, p: lbd_pb2.NamespacePolicies) -> dict[str, Any]:
    """``NamespaceIsolationData`` of one namespace's isolation policy."""
    return {
        "namespaces": [namespace],
        "primary": list(p.isolation_primary),
        "secondary": list(p.isolation_secondary),
        "auto_failover_policy": {
            "policy_type": "min_available",
            "parameters": {
                "min_limit": str(p.isolation_min_primaries or 1),
                "usage_threshold": "100",
            },
        },
    }


def _policy_name(namespace: str) -> str:
    return namespace.replace("/", ".")


def _policy_namespace(policy: str) -> str:
    """The namespace a policy name stands for (``tenant.namespace`` or ``tenant/namespace``)."""
    tenant, sep, namespace = policy.partition(".")
    if not sep:
        raise Refusal(412, f"policy name {policy!r} must name a namespace: tenant.namespace")
    return _namespace(tenant, namespace)


def _bad_policy(why: str) -> Refusal:
    return Refusal(400, f"Invalid format of input policy data: {why}")


def _min_limit(failover: Any) -> int:
    if failover is None:
        return 1
    if not isinstance(failover, dict) or failover.get("policy_type", "min_available") != (
        "min_available"
    ):
        raise _bad_policy("auto_failover_policy: only policy_type min_available is supported")
    parameters = failover.get("parameters") or {}
    try:
        limit = int(parameters.get("min_limit", 1))
    except (TypeError, ValueError):
        raise _bad_policy("auto_failover_policy.parameters.min_limit is not a number") from None
    if limit < 1:
        raise _bad_policy("auto_failover_policy.parameters.min_limit must be >= 1")
    return limit


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _usage(u: lbd_pb2.ResourceUsage) -> dict[str, float]:
    return {"usage": u.usage, "limit": u.limit}


def local_broker_data(broker: BrokerView, report: lbd_pb2.LoadReport) -> dict[str, Any]:
    """Pulsar's ``LocalBrokerData`` fields that lbd's load report has."""
    bundles: Iterable[lbd_pb2.BundleStats] = report.bundles
    stats = {
        b.bundle: {
            "msgRateIn": b.msg_rate_in,
            "msgThroughputIn": b.msg_throughput_in,
            "msgRateOut": b.msg_rate_out,
            "msgThroughputOut": b.msg_throughput_out,
            "consumerCount": b.consumer_count,
            "producerCount": b.producer_count,
            "topics": b.topics,
        }
        for b in bundles
    }
    values = list(stats.values())
    usages = (
        report.cpu,
        report.memory,
        report.direct_memory,
        report.bandwidth_in,
        report.bandwidth_out,
    )
    data: dict[str, Any] = {
        "webServiceUrl": broker.web.http,
        "webServiceUrlTls": broker.web.https,
        "pulsarServiceUrl": broker.service_url,
        "pulsarServiceUrlTls": broker.service_url_tls,
        "persistentTopicsEnabled": True,
        "nonPersistentTopicsEnabled": False,
        "cpu": _usage(report.cpu),
        "memory": _usage(report.memory),
        "directMemory": _usage(report.direct_memory),
        "bandwidthIn": _usage(report.bandwidth_in),
        "bandwidthOut": _usage(report.bandwidth_out),
        "msgThroughputIn": sum(v["msgThroughputIn"] for v in values),
        "msgThroughputOut": sum(v["msgThroughputOut"] for v in values),
        "msgRateIn": sum(v["msgRateIn"] for v in values),
        "msgRateOut": sum(v["msgRateOut"] for v in values),
        "lastUpdate": int(time.time() * 1000),
        "lastStats": stats,
        "bundleStats": stats,
        "numTopics": sum(v["topics"] for v in values),
        "numBundles": len(values),
        "numConsumers": sum(v["consumerCount"] for v in values),
        "numProducers": sum(v["producerCount"] for v in values),
        "bundles": sorted(stats),
        "lastBundleGains": [],
        "lastBundleLosses": [],
        "brokerVersionString": broker.version,
        "loadReportType": "LocalBrokerData",
        "protocols": {},
        "advertisedListeners": {},
        "maxResourceUsage": max((u.usage / u.limit for u in usages if u.limit > 0), default=0.0),
    }
    return {k: v for k, v in data.items() if v != ""}
