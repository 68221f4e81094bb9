"""``lbd.v1.Admin``: the operator's calls (``grpcurl``, ``lbd ctl``).

Reads (brokers, leader, bundles, load) are answered from this sidecar's own view. Changes go to
:class:`~lbd.services.sidecar.operations.Operations` and the namespace service. Split must run on
the bundle owner's sidecar and Rebalance/Snapshot on the leader's: when that is another sidecar,
the call is forwarded there (:mod:`lbd.api.forwarding`).
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from lbd.api import convert
from lbd.api.forwarding import Forwarder
from lbd.core.broker import BrokerInfo
from lbd.core.bundles import SplitAlgorithm
from lbd.core.errors import DeadlineError, InvalidInputError, PreconditionError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.names import NamespaceName
from lbd.core.namespace import NamespacePolicies
from lbd.core.operations import Move, MoveState, OperationKind
from lbd.core.shedding import mean_and_std, scenario_to_json
from lbd.core.state import ServiceUnitState
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from lbd.metrics import ADMIN_REASON
from lbd.ports.errors import UnavailableError

if TYPE_CHECKING:
    from lbd.services.channel.follower import ChannelFollower
    from lbd.services.cluster.loads import LoadView
    from lbd.services.cluster.maintenance import MaintenanceView
    from lbd.services.cluster.namespaces import NamespaceService
    from lbd.services.cluster.registry import BrokerRegistry
    from lbd.services.leader.auditor import SafetyAuditor
    from lbd.services.leader.decisions import DecisionLog
    from lbd.services.leader.election import LeaderElector
    from lbd.services.leader.maintenance import Drainer
    from lbd.services.leader.operations import OperationTracker
    from lbd.services.leader.shedding import UnloadScheduler
    from lbd.services.sidecar.lookup import LookupService
    from lbd.services.sidecar.operations import Operations

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AdminDeps:
    """What the Admin service reads and drives; built by the composition root."""

    me: BrokerId
    registry: BrokerRegistry
    namespaces: NamespaceService
    follower: ChannelFollower
    operations: Operations
    lookup: LookupService
    elector: LeaderElector
    unload_scheduler: UnloadScheduler
    loads: LoadView
    """The load topics as this sidecar reads them (every sidecar does, for assignment)."""
    forwarder: Forwarder
    tracker: OperationTracker
    """The leader's plans and operations (used only while this sidecar leads)."""
    decisions: DecisionLog
    """The leader's recent decisions (filled only while this sidecar leads)."""
    maintenance: MaintenanceView
    """Every broker's maintenance record (cordoned, draining...)."""
    drainer: Drainer
    """Cordon and uncordon here; drain and decommission while this sidecar leads."""
    auditor: SafetyAuditor
    """The leader's safety auditor (its findings are answered only while this sidecar leads)."""


class AdminServicer(lbd_pb2_grpc.AdminServicer):
    """Every Admin RPC of the proto."""

    def __init__(self, deps: AdminDeps) -> None:
        self._d = deps

    # -- ownership changes -------------------------------------------------------------------

    async def Assign(
        self, request: lbd_pb2.AssignRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.AssignResponse:
        """Assign a bundle (given, or the topic's) that has no owner."""
        if bool(request.bundle) == bool(request.topic):
            raise InvalidInputError("set exactly one of bundle and topic")
        if request.bundle:
            bundle = convert.bundle_id(request.bundle)
        else:
            bundle = await self._d.lookup.bundle_of(request.topic)
        dst = convert.optional(request.dst_broker_id)
        owner = await self._d.operations.assign(bundle, None if dst is None else BrokerId(dst))
        return lbd_pb2.AssignResponse(bundle=bundle, owner_broker_id=owner)

    async def Transfer(
        self, request: lbd_pb2.TransferRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.TransferResponse:
        """Move an Owned bundle to another broker, as an admin operation of the leader (under
        the execution governor)."""
        bundle = convert.bundle_id(request.bundle)
        dst = convert.broker_id(request.dst_broker_id, "dst_broker_id")
        if not self._d.elector.is_leader:
            response: lbd_pb2.TransferResponse = await self._forward_to_leader(
                lambda stub: stub.Transfer, request, context
            )
            return response
        src = await self._d.operations.check_transfer(bundle, dst)
        await self._admin_move(Move(bundle, src, dst, ADMIN_REASON), f"transfer to {dst}")
        return lbd_pb2.TransferResponse(bundle=bundle, src_broker_id=src, dst_broker_id=dst)

    async def Unload(
        self, request: lbd_pb2.UnloadRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.UnloadResponse:
        """Unload an Owned bundle, as an admin operation of the leader."""
        bundle = convert.bundle_id(request.bundle)
        if not self._d.elector.is_leader:
            response: lbd_pb2.UnloadResponse = await self._forward_to_leader(
                lambda stub: stub.Unload, request, context
            )
            return response
        src = await self._d.operations.check_unload(bundle)
        await self._admin_move(Move(bundle, src, None, ADMIN_REASON), "unload")
        return lbd_pb2.UnloadResponse(bundle=bundle, src_broker_id=src)

    async def _admin_move(self, move: Move, what: str) -> None:
        """Run ``move`` as an admin operation and wait for it; PreconditionError (naming the
        operation) when it did not complete."""
        op = self._d.tracker.start_operation(
            OperationKind.ADMIN, f"{what}: {move.bundle} (from {move.src})", [move]
        )
        op = await self._d.tracker.wait(op.id)
        done = op.moves[0]
        if done.state is MoveState.DONE:
            return
        message = (
            f"{what} of {move.bundle} did not complete ({done.state.value}): {done.error} "
            f"(operation {op.id})"
        )
        cause = self._d.tracker.failure(op.id)
        # An outage or a deadline keeps its code, so that a client knows to retry.
        if isinstance(cause, UnavailableError):
            raise UnavailableError(message)
        if isinstance(cause, DeadlineError):
            raise DeadlineError(message)
        raise PreconditionError(message)

    async def Split(
        self, request: lbd_pb2.SplitRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.SplitResponse:
        """Split an Owned bundle, on its owner's sidecar."""
        bundle = convert.bundle_id(request.bundle)
        algorithm = SplitAlgorithm.parse(
            request.algorithm or SplitAlgorithm.RANGE_EQUALLY_DIVIDE.value
        )
        value = self._d.follower.get(bundle)
        owner = value.dst_broker if value is not None else None
        if (
            value is not None
            and value.state is ServiceUnitState.Owned
            and owner is not None
            and owner != self._d.me
        ):
            target = self._sidecar_of(owner, f"the owner of {bundle}")
            response: lbd_pb2.SplitResponse = await self._d.forwarder.call(
                target.sidecar_grpc_addr,
                lambda stub: stub.Split,
                request,
                context,
                what=f"{bundle} is owned by {owner}, not by {self._d.me}",
            )
            return response
        # Owned here, or not Owned at all: Operations says why it cannot split then.
        outcome = await self._d.operations.split(bundle, algorithm, list(request.boundaries))
        return lbd_pb2.SplitResponse(
            parent=outcome.parent,
            children=list(outcome.children),
            owner_broker_id=outcome.owner,
        )

    # -- reads -------------------------------------------------------------------------------

    async def ListBrokers(
        self, request: lbd_pb2.ListBrokersRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.ListBrokersResponse:
        """Every registered broker, with whether it leads, how many bundles it owns and its
        maintenance mode."""
        owned = collections.Counter(self._d.follower.table.owners().values())
        leader = self._d.elector.leader
        brokers = self._d.registry.brokers()
        return lbd_pb2.ListBrokersResponse(
            brokers=[
                lbd_pb2.BrokerStatus(
                    info=convert.broker_info_to_proto(brokers[broker]),
                    leader=leader is not None and leader.broker == broker,
                    owned_bundles=owned.get(broker, 0),
                    maintenance=self._maintenance_of(broker),
                )
                for broker in sorted(brokers)
            ]
        )

    async def GetLeader(
        self, request: lbd_pb2.GetLeaderRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.GetLeaderResponse:
        """The leader as this sidecar knows it (empty while nobody leads)."""
        leader = self._d.elector.leader
        if leader is None:
            return lbd_pb2.GetLeaderResponse()
        return lbd_pb2.GetLeaderResponse(broker_id=leader.broker, term=leader.term)

    async def ListBundles(
        self, request: lbd_pb2.ListBundlesRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.ListBundlesResponse:
        """Every bundle of the namespace (or of all namespaces), with its value in the table."""
        if request.namespace:
            # Fresh from the store, not the cache: another sidecar may have split since.
            records = [await self._d.namespaces.refresh(NamespaceName.parse(request.namespace))]
        else:
            records = await self._d.namespaces.list(fresh=True)
        bundles: list[BundleId] = sorted(
            b.id for record in records for b in record.bundles().bundles()
        )
        return lbd_pb2.ListBundlesResponse(
            bundles=[convert.bundle_info(b, self._d.follower.get(b)) for b in bundles]
        )

    async def GetLoad(
        self, request: lbd_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.GetLoadResponse:
        """The brokers' fresh load data as this sidecar received it, with mean and std."""
        loads = [data for _, data in sorted(self._d.loads.brokers().items())]
        avg, std = mean_and_std(d.weighted_max_ema for d in loads)
        return convert.load_response(loads, avg, std)

    # -- namespaces --------------------------------------------------------------------------

    async def CreateNamespace(
        self, request: lbd_pb2.CreateNamespaceRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.CreateNamespaceResponse:
        """Create a namespace of equal bundles."""
        name = NamespaceName.parse(request.namespace)
        if request.bundles < 0:
            raise InvalidInputError(f"bundles must be >= 0 (0: the default), got {request.bundles}")
        policies = (
            convert.policies_from_proto(request.policies)
            if request.HasField("policies")
            else NamespacePolicies()
        )
        record = await self._d.namespaces.create(name, request.bundles or None, policies)
        return convert.namespace_response(record)

    async def SetNamespacePolicies(
        self, request: lbd_pb2.SetNamespacePoliciesRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.SetNamespacePoliciesResponse:
        """Replace a namespace's policies."""
        name = NamespaceName.parse(request.namespace)
        policies = convert.policies_from_proto(request.policies)
        await self._d.namespaces.set_policies(name, policies)
        _log.info("namespace %s: policies set to %s (Admin)", name, policies.to_dict())
        return lbd_pb2.SetNamespacePoliciesResponse()

    # -- the leader's calls ------------------------------------------------------------------

    async def Rebalance(
        self, request: lbd_pb2.RebalanceRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.RebalanceResponse:
        """Plan now on the leader; execute the plan unless ``dry_run`` (then it is kept for
        Execute)."""
        if not self._d.elector.is_leader:
            response: lbd_pb2.RebalanceResponse = await self._forward_to_leader(
                lambda stub: stub.Rebalance, request, context
            )
            return response
        report = await self._d.unload_scheduler.run_cycle(dry_run=request.dry_run, asked=True)
        op_id = None if report.operation is None else report.operation.id
        return convert.rebalance_response(report.result, report.plan, op_id)

    async def Execute(
        self, request: lbd_pb2.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.Operation:
        """Execute a plan a dry-run Rebalance returned."""
        if not request.plan_id:
            raise InvalidInputError("plan_id is required (from `lbd ctl plan`)")
        if not self._d.elector.is_leader:
            response: lbd_pb2.Operation = await self._forward_to_leader(
                lambda stub: stub.Execute, request, context
            )
            return response
        return convert.operation(await self._d.unload_scheduler.execute(request.plan_id))

    async def ListOperations(
        self, request: lbd_pb2.ListOperationsRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.ListOperationsResponse:
        """The leader's operations, newest first."""
        if not self._d.elector.is_leader:
            response: lbd_pb2.ListOperationsResponse = await self._forward_to_leader(
                lambda stub: stub.ListOperations, request, context
            )
            return response
        ops = self._d.tracker.list_operations(active_only=request.active_only)
        return lbd_pb2.ListOperationsResponse(operations=[convert.operation(op) for op in ops])

    async def GetOperation(
        self, request: lbd_pb2.GetOperationRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.Operation:
        """One operation of the leader."""
        if not self._d.elector.is_leader:
            response: lbd_pb2.Operation = await self._forward_to_leader(
                lambda stub: stub.GetOperation, request, context
            )
            return response
        return convert.operation(self._d.tracker.get(_operation_id(request.id)))

    async def WatchOperation(
        self, request: lbd_pb2.WatchOperationRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[lbd_pb2.Operation]:
        """The operation now and after each change, until it has finished."""
        if not self._d.elector.is_leader:
            async for forwarded in self._stream_from_leader(
                lambda stub: stub.WatchOperation, request, context
            ):
                yield forwarded
            return
        async for op in self._d.tracker.watch(_operation_id(request.id)):
            yield convert.operation(op)

    async def CancelOperation(
        self, request: lbd_pb2.CancelOperationRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.Operation:
        """Stop scheduling an operation's moves; the in-flight ones finish."""
        if not self._d.elector.is_leader:
            response: lbd_pb2.Operation = await self._forward_to_leader(
                lambda stub: stub.CancelOperation, request, context
            )
            return response
        return convert.operation(self._d.tracker.cancel(_operation_id(request.id)))

    async def Snapshot(
        self, request: lbd_pb2.SnapshotRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.SnapshotResponse:
        """The leader's load snapshot in the scenario format."""
        if not self._d.elector.is_leader:
            response: lbd_pb2.SnapshotResponse = await self._forward_to_leader(
                lambda stub: stub.Snapshot, request, context
            )
            return response
        scenario = self._d.unload_scheduler.snapshot()
        return lbd_pb2.SnapshotResponse(scenario_json=json.dumps(scenario_to_json(scenario)))

    async def Audit(
        self, request: lbd_pb2.AuditRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.AuditResponse:
        """The leader's safety auditor's latest findings (an audit runs now if none has yet)."""
        if not self._d.elector.is_leader:
            response: lbd_pb2.AuditResponse = await self._forward_to_leader(
                lambda stub: stub.Audit, request, context
            )
            return response
        report = self._d.auditor.latest or await self._d.auditor.run_once()
        return convert.audit_response(report)

    async def ListDecisions(
        self, request: lbd_pb2.ListDecisionsRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.ListDecisionsResponse:
        """The leader's recent decisions at or after ``since_ms``, oldest first."""
        if request.since_ms < 0 or request.limit < 0:
            raise InvalidInputError(
                f"since_ms and limit must be >= 0 (0: all kept), got {request.since_ms} and "
                f"{request.limit}"
            )
        if not self._d.elector.is_leader:
            response: lbd_pb2.ListDecisionsResponse = await self._forward_to_leader(
                lambda stub: stub.ListDecisions, request, context
            )
            return response
        decisions = self._d.decisions.since(request.since_ms, request.limit)
        return lbd_pb2.ListDecisionsResponse(decisions=[convert.decision(d) for d in decisions])

    # -- maintenance -------------------------------------------------------------------------

    async def Cordon(
        self, request: lbd_pb2.CordonRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.MaintenanceResponse:
        """Keep new bundles off a broker (any sidecar: the record is in the metadata store)."""
        broker = convert.broker_id(request.broker_id, "broker_id")
        await self._d.drainer.cordon(broker, request.reason.strip())
        return self._maintenance_response(broker)

    async def Uncordon(
        self, request: lbd_pb2.UncordonRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.MaintenanceResponse:
        """Put a broker back in service; its drain or decommission stops (on the leader)."""
        broker = convert.broker_id(request.broker_id, "broker_id")
        await self._d.drainer.uncordon(broker)
        return self._maintenance_response(broker)

    async def Drain(
        self, request: lbd_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.Operation:
        """Cordon a broker and move every bundle off it (on the leader); the operation."""
        broker = convert.broker_id(request.broker_id, "broker_id")
        if not self._d.elector.is_leader:
            response: lbd_pb2.Operation = await self._forward_to_leader(
                lambda stub: stub.Drain, request, context
            )
            return response
        return convert.operation(await self._d.drainer.drain(broker))

    async def Decommission(
        self, request: lbd_pb2.DecommissionRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.Operation:
        """Drain a broker, then deregister it for good (on the leader); the operation."""
        broker = convert.broker_id(request.broker_id, "broker_id")
        if not self._d.elector.is_leader:
            response: lbd_pb2.Operation = await self._forward_to_leader(
                lambda stub: stub.Decommission, request, context
            )
            return response
        return convert.operation(await self._d.drainer.decommission(broker))

    def _maintenance_of(self, broker: BrokerId) -> str:
        mode = self._d.maintenance.mode(broker)
        return "" if mode is None else mode.value

    def _maintenance_response(self, broker: BrokerId) -> lbd_pb2.MaintenanceResponse:
        return lbd_pb2.MaintenanceResponse(
            broker_id=broker, maintenance=self._maintenance_of(broker)
        )

    # -- helpers -----------------------------------------------------------------------------

    def _sidecar_of(self, broker: BrokerId, role: str) -> BrokerInfo:
        info = self._d.registry.get(broker)
        if info is None:
            raise UnavailableError(f"{role}, {broker}, is not registered; retry once it is back")
        if not info.sidecar_grpc_addr:
            raise UnavailableError(f"{role}, {broker}, did not register its sidecar's address")
        return info

    def _leader_addr(self) -> tuple[str, str]:
        """The leader's sidecar address and why this sidecar does not answer itself."""
        leader = self._d.elector.leader
        if leader is None:
            raise UnavailableError("no leader is elected right now; retry shortly")
        if leader.broker == self._d.me:
            raise PreconditionError(
                f"{self._d.me} was elected leader but is not running the leader duties yet; "
                "retry shortly"
            )
        target = self._sidecar_of(leader.broker, "the leader")
        return target.sidecar_grpc_addr, f"{leader.broker} leads, not {self._d.me}"

    async def _stream_from_leader(
        self,
        method: Callable[[lbd_pb2_grpc.AdminStub], Any],
        request: Any,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Any]:
        addr, what = self._leader_addr()
        async for response in self._d.forwarder.stream(addr, method, request, context, what=what):
            yield response

    async def _forward_to_leader(
        self,
        method: Callable[[lbd_pb2_grpc.AdminStub], Any],
        request: Any,
        context: grpc.aio.ServicerContext,
    ) -> Any:
        addr, what = self._leader_addr()
        return await self._d.forwarder.call(addr, method, request, context, what=what)


def _operation_id(text: str) -> str:
    """An operation id from a request (InvalidInputError when empty)."""
    if not text.strip():
        raise InvalidInputError("id is required: an operation id from `lbd ctl ops list`")
    return text.strip()
