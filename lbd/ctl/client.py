"""A blocking client of one sidecar's ``LoadBalancer`` and ``Admin`` services.

Every failed call raises :class:`RpcFailure`, whose message is ``<STATUS>: <details>``, so the
command line can print it as one line; a call never hangs longer than its deadline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lbd.broker.credentials import INSECURE, ClientCredentials
from lbd.core.errors import LbdError
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc

DEFAULT_TIMEOUT_S = 15.0
"""Deadline of one call: above the sidecar's own assignment deadline, so that it answers first."""

_CONNECT_FAILURE = "failed to connect"
"""How grpc's own details begin when no connection could be made (not the server's message)."""

_Response = TypeVar("_Response", bound=Message)


class RpcFailure(LbdError):
    """A call ended with a non-OK status; ``code`` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        self.details = details
        super().__init__(f"{code.name}: {details}" if details else code.name)


class SidecarClient:
    """Calls to the sidecar at ``server`` (HOST:PORT) with ``credentials`` (TLS, a token), or
    with a bare bearer ``token``."""

    def __init__(
        self,
        server: str,
        *,
        token: str | None = None,
        credentials: ClientCredentials = INSECURE,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.server = server
        self._timeout_s = timeout_s
        if token:
            credentials = dataclasses.replace(credentials, token=token, token_file=None)
        self._metadata = credentials.metadata()
        self._channel = credentials.channel(server)
        self._lb = lbd_pb2_grpc.LoadBalancerStub(self._channel)
        self._admin = lbd_pb2_grpc.AdminStub(self._channel)

    def lookup(self, topic: str, *, read_only: bool = False) -> lbd_pb2.LookupResponse:
        """The topic's bundle and owner, assigning the bundle unless ``read_only``."""
        return self._call(self._lb.Lookup, lbd_pb2.LookupRequest(topic=topic, read_only=read_only))

    def lookup_many(
        self, topics: Sequence[str], *, read_only: bool = False
    ) -> lbd_pb2.LookupManyResponse:
        """Each topic's bundle and owner, in one ``LookupMany``: a result per topic, in order,
        each an answer or the failure its own lookup would have ended with."""
        request = lbd_pb2.LookupManyRequest(
            lookups=[lbd_pb2.LookupRequest(topic=t, read_only=read_only) for t in topics]
        )
        return self._call(self._lb.LookupMany, request)

    def assign(self, target: str, dst: str | None) -> lbd_pb2.AssignResponse:
        """Assign a bundle (an id) or a topic's bundle (a name with ``://``), to ``dst`` if set."""
        request = lbd_pb2.AssignRequest(dst_broker_id=dst or "")
        if "://" in target:
            request.topic = target
        else:
            request.bundle = target
        return self._call(self._admin.Assign, request)

    def transfer(self, bundle: str, dst: str) -> lbd_pb2.TransferResponse:
        """Move an owned bundle to ``dst``."""
        request = lbd_pb2.TransferRequest(bundle=bundle, dst_broker_id=dst)
        return self._call(self._admin.Transfer, request)

    def unload(self, bundle: str) -> lbd_pb2.UnloadResponse:
        """Free an owned bundle; the next lookup assigns it again."""
        return self._call(self._admin.Unload, lbd_pb2.UnloadRequest(bundle=bundle))

    def split(
        self, bundle: str, algorithm: str, boundaries: Sequence[int]
    ) -> lbd_pb2.SplitResponse:
        """Split an owned bundle."""
        request = lbd_pb2.SplitRequest(bundle=bundle, algorithm=algorithm, boundaries=boundaries)
        return self._call(self._admin.Split, request)

    def brokers(self) -> lbd_pb2.ListBrokersResponse:
        """Registered brokers, with the leader and their owned-bundle counts."""
        return self._call(self._admin.ListBrokers, lbd_pb2.ListBrokersRequest())

    def health(self) -> str:
        """The sidecar's overall ``grpc.health.v1`` status name (``SERVING``, ``NOT_SERVING``)."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        reply = self._call(stub.Check, health_pb2.HealthCheckRequest(service=""))
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    def leader(self) -> lbd_pb2.GetLeaderResponse:
        """The leader and its term."""
        return self._call(self._admin.GetLeader, lbd_pb2.GetLeaderRequest())

    def bundles(self, namespace: str = "") -> lbd_pb2.ListBundlesResponse:
        """Bundles of one namespace, or of all when ``namespace`` is empty."""
        request = lbd_pb2.ListBundlesRequest(namespace=namespace)
        return self._call(self._admin.ListBundles, request)

    def create_namespace(self, namespace: str, bundles: int) -> lbd_pb2.CreateNamespaceResponse:
        """Create a namespace with ``bundles`` equal bundles (0: the sidecar's default)."""
        request = lbd_pb2.CreateNamespaceRequest(namespace=namespace, bundles=bundles)
        return self._call(self._admin.CreateNamespace, request)

    def load(self) -> lbd_pb2.GetLoadResponse:
        """Per-broker load, average and standard deviation."""
        return self._call(self._admin.GetLoad, lbd_pb2.GetLoadRequest())

    def rebalance(self, *, dry_run: bool) -> lbd_pb2.RebalanceResponse:
        """Run the shedder now (only propose with ``dry_run``)."""
        return self._call(self._admin.Rebalance, lbd_pb2.RebalanceRequest(dry_run=dry_run))

    def execute(self, plan_id: str) -> lbd_pb2.Operation:
        """Execute a plan from a dry-run rebalance; the operation."""
        return self._call(self._admin.Execute, lbd_pb2.ExecuteRequest(plan_id=plan_id))

    def operations(self, *, active_only: bool = False) -> lbd_pb2.ListOperationsResponse:
        """The leader's operations, newest first."""
        request = lbd_pb2.ListOperationsRequest(active_only=active_only)
        return self._call(self._admin.ListOperations, request)

    def operation(self, op_id: str) -> lbd_pb2.Operation:
        """One operation of the leader."""
        return self._call(self._admin.GetOperation, lbd_pb2.GetOperationRequest(id=op_id))

    def cancel_operation(self, op_id: str) -> lbd_pb2.Operation:
        """Stop scheduling an operation's moves (the in-flight ones finish)."""
        request = lbd_pb2.CancelOperationRequest(id=op_id)
        return self._call(self._admin.CancelOperation, request)

    def watch_operation(
        self, op_id: str, *, timeout_s: float | None = None
    ) -> Iterator[lbd_pb2.Operation]:
        """The operation now and after each change until it ends (``timeout_s``: a deadline
        for the whole watch; None: none)."""
        request = lbd_pb2.WatchOperationRequest(id=op_id)
        return self._stream(self._admin.WatchOperation, request, timeout_s)

    def watch_ownership(
        self, namespace: str = "", *, heartbeat_ms: int = 0, timeout_s: float | None = None
    ) -> Iterator[lbd_pb2.OwnershipChange]:
        """The bundles' values (of ``namespace``; all when empty), the end of those, then every
        change, with a heartbeat every ``heartbeat_ms`` once the sidecar can vouch for the
        stream (``timeout_s``: a deadline for the whole watch; None: none)."""
        request = lbd_pb2.WatchOwnershipRequest(namespace=namespace, heartbeat_ms=heartbeat_ms)
        return self._stream(self._lb.WatchOwnership, request, timeout_s)

    def cordon(self, broker: str, reason: str = "") -> lbd_pb2.MaintenanceResponse:
        """Keep new bundles off ``broker``; its maintenance mode now."""
        request = lbd_pb2.CordonRequest(broker_id=broker, reason=reason)
        return self._call(self._admin.Cordon, request)

    def uncordon(self, broker: str) -> lbd_pb2.MaintenanceResponse:
        """Put ``broker`` back in service (a drain of it stops)."""
        return self._call(self._admin.Uncordon, lbd_pb2.UncordonRequest(broker_id=broker))

    def drain(self, broker: str) -> lbd_pb2.Operation:
        """Cordon ``broker`` and move every bundle off it; the operation."""
        return self._call(self._admin.Drain, lbd_pb2.DrainRequest(broker_id=broker))

    def decommission(self, broker: str) -> lbd_pb2.Operation:
        """Drain ``broker``, then deregister it; the operation."""
        request = lbd_pb2.DecommissionRequest(broker_id=broker)
        return self._call(self._admin.Decommission, request)

    def snapshot(self) -> lbd_pb2.SnapshotResponse:
        """The leader's load snapshot in the scenario format (DESIGN §7)."""
        return self._call(self._admin.Snapshot, lbd_pb2.SnapshotRequest())

    def audit(self) -> lbd_pb2.AuditResponse:
        """The leader's safety auditor's findings, each with what to do."""
        return self._call(self._admin.Audit, lbd_pb2.AuditRequest())

    def decisions(self, since_ms: int = 0, limit: int = 0) -> lbd_pb2.ListDecisionsResponse:
        """The leader's decisions at or after ``since_ms``, oldest first; the newest ``limit``
        (0: every one it keeps)."""
        request = lbd_pb2.ListDecisionsRequest(since_ms=since_ms, limit=limit)
        return self._call(self._admin.ListDecisions, request)

    def close(self) -> None:
        """Close the channel; idempotent."""
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _stream(
        self, method: Callable[..., Any], request: Message, timeout_s: float | None
    ) -> Iterator[_Response]:
        """The responses of a server-streaming call, started when first iterated and cancelled
        when the iteration ends, however it ends."""
        stream = method(request, timeout=timeout_s, metadata=self._metadata)
        try:
            yield from stream
        except grpc.RpcError as e:
            raise self._failure(e) from None
        finally:
            stream.cancel()

    def _call(self, method: Callable[..., _Response], request: Message) -> _Response:
        try:
            return method(request, timeout=self._timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._failure(e) from None

    def _failure(self, e: grpc.RpcError) -> RpcFailure:
        """The failure to raise for ``e``."""
        # Every error a blocking call raises is also a grpc.Call with a code and details.
        code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
        details = e.details() if isinstance(e, grpc.Call) else str(e)
        if code is grpc.StatusCode.UNAVAILABLE and (
            not details or details.startswith(_CONNECT_FAILURE)
        ):
            details = f"cannot reach the sidecar at {self.server} ({details or 'no answer'})"
        return RpcFailure(code, details or "")
