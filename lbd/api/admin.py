"""``lbd.v1.Admin``: the operator's calls (``grpcurl``, ``lbd ctl``).

Reads (brokers, leader, bundles, load) are answered from this sidecar's own view. An assignment
and a split go to :class:`~lbd.services.sidecar.assign_split.Operations`, namespaces to the
namespace service. The thirteen methods declared :func:`~lbd.api.forwarding.on_leader`
(Transfer and Unload, Rebalance, Execute, the operations, Snapshot, Audit, ListDecisions, Drain
and Decommission) run on the leader's sidecar: on any other, the server's forwarding layer sends
them there before they reach this servicer (:class:`~lbd.api.forwarding.LeaderForwarding`). An
admin Transfer or Unload is the leader's
:meth:`~lbd.services.leader.tracker.OperationTracker.admin_move`. Split runs on the bundle
owner's sidecar, and is forwarded there by :meth:`AdminServicer.Split` itself.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from lbd.api import convert
from lbd.api.forwarding import Forwarder, on_leader, sidecar_addr
from lbd.core.bundles import SplitAlgorithm
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.names import NamespaceName
from lbd.core.namespace import NamespacePolicies
from lbd.core.shedding import mean_and_std, scenario_to_json
from lbd.core.state import ServiceUnitState
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc

if TYPE_CHECKING:
    from lbd.services.channel.follower import ChannelFollower
    from lbd.services.cluster.loads import LoadView
    from lbd.services.cluster.maintenance_view import MaintenanceView
    from lbd.services.cluster.namespaces import NamespaceService
    from lbd.services.cluster.registry import BrokerRegistry
    from lbd.services.leader.auditor import SafetyAuditor
    from lbd.services.leader.decisions import DecisionLog
    from lbd.services.leader.drain import Drainer
    from lbd.services.leader.election import LeaderElector
    from lbd.services.leader.shedding import UnloadScheduler
    from lbd.services.leader.tracker import OperationTracker
    from lbd.services.sidecar.assign_split import Operations
    from lbd.services.sidecar.lookup import LookupService

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

    @on_leader
    async def Transfer(
        self, request: lbd_pb2.TransferRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.TransferResponse:
        """Move an Owned bundle to another broker, as an admin operation of the leader (under
        the execution governor)."""
        bundle = convert.bundle_id(request.bundle)
        dst = convert.broker_id(request.dst_broker_id, "dst_broker_id")
        src = await self._d.tracker.admin_move(bundle, dst)
        return lbd_pb2.TransferResponse(bundle=bundle, src_broker_id=src, dst_broker_id=dst)

    @on_leader
    async def Unload(
        self, request: lbd_pb2.UnloadRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.UnloadResponse:
        """Unload an Owned bundle, as an admin operation of the leader."""
        bundle = convert.bundle_id(request.bundle)
        src = await self._d.tracker.admin_move(bundle, None)
        return lbd_pb2.UnloadResponse(bundle=bundle, src_broker_id=src)

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
            response: lbd_pb2.SplitResponse = await self._d.forwarder.call(
                sidecar_addr(self._d.registry, owner, f"the owner of {bundle}"),
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

    async def GetNamespace(
        self, request: lbd_pb2.GetNamespaceRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.NamespaceInfo:
        """A namespace's bundles and policies, fresh from the store (another sidecar may have
        split or set policies since)."""
        record = await self._d.namespaces.refresh(NamespaceName.parse(request.namespace))
        return convert.namespace_info(record)

    # -- the leader's calls ------------------------------------------------------------------

    @on_leader
    async def Rebalance(
        self, request: lbd_pb2.RebalanceRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.RebalanceResponse:
        """Plan now on the leader; execute the plan unless ``dry_run`` (then it is kept for
        Execute)."""
        report = await self._d.unload_scheduler.run_cycle(dry_run=request.dry_run, asked=True)
        op_id = None if report.operation is None else report.operation.id
        return convert.rebalance_response(report.result, report.plan, op_id)

    @on_leader
    async def Execute(
        self, request: lbd_pb2.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.Operation:
        """Execute a plan a dry-run Rebalance returned."""
        if not request.plan_id:
            raise InvalidInputError("plan_id is required (from `lbd ctl plan`)")
        return convert.operation(await self._d.unload_scheduler.execute(request.plan_id))

    @on_leader
    async def ListOperations(
        self, request: lbd_pb2.ListOperationsRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.ListOperationsResponse:
        """The leader's operations, newest first."""
        ops = self._d.tracker.list_operations(active_only=request.active_only)
        return lbd_pb2.ListOperationsResponse(operations=[convert.operation(op) for op in ops])

    @on_leader
    async def GetOperation(
        self, request: lbd_pb2.GetOperationRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.Operation:
        """One operation of the leader."""
        return convert.operation(self._d.tracker.get(_operation_id(request.id)))

    @on_leader
    async def WatchOperation(
        self, request: lbd_pb2.WatchOperationRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[lbd_pb2.Operation]:
        """The operation now and after each change, until it has finished."""
        async for op in self._d.tracker.watch(_operation_id(request.id)):
            yield convert.operation(op)

    @on_leader
    async def CancelOperation(
        self, request: lbd_pb2.CancelOperationRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.Operation:
        """Stop scheduling an operation's moves; the in-flight ones finish."""
        return convert.operation(self._d.tracker.cancel(_operation_id(request.id)))

    @on_leader
    async def Snapshot(
        self, request: lbd_pb2.SnapshotRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.SnapshotResponse:
        """The leader's load snapshot in the scenario format."""
        scenario = self._d.unload_scheduler.snapshot()
        return lbd_pb2.SnapshotResponse(scenario_json=json.dumps(scenario_to_json(scenario)))

    @on_leader
    async def Audit(
        self, request: lbd_pb2.AuditRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.AuditResponse:
        """The leader's safety auditor's latest findings (an audit runs now if none has yet)."""
        report = self._d.auditor.latest or await self._d.auditor.run_once()
        return convert.audit_response(report)

    @on_leader
    async def ListDecisions(
        self, request: lbd_pb2.ListDecisionsRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.ListDecisionsResponse:
        """The leader's recent decisions at or after ``since_ms``, oldest first."""
        if request.since_ms < 0 or request.limit < 0:
            raise InvalidInputError(
                f"since_ms and limit must be >= 0 (0: all kept), got {request.since_ms} and "
                f"{request.limit}"
            )
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
        """Put a broker back in service, on any sidecar: its maintenance record is cleared, and
        the leader stops a drain or decommission of it when it sees that."""
        broker = convert.broker_id(request.broker_id, "broker_id")
        await self._d.drainer.uncordon(broker)
        return self._maintenance_response(broker)

    @on_leader
    async def Drain(
        self, request: lbd_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.Operation:
        """Cordon a broker and move every bundle off it (on the leader); the operation."""
        broker = convert.broker_id(request.broker_id, "broker_id")
        return convert.operation(await self._d.drainer.drain(broker))

    @on_leader
    async def Decommission(
        self, request: lbd_pb2.DecommissionRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.Operation:
        """Drain a broker, then deregister it for good (on the leader); the operation."""
        broker = convert.broker_id(request.broker_id, "broker_id")
        return convert.operation(await self._d.drainer.decommission(broker))

    def _maintenance_of(self, broker: BrokerId) -> str:
        mode = self._d.maintenance.mode(broker)
        return "" if mode is None else mode.value

    def _maintenance_response(self, broker: BrokerId) -> lbd_pb2.MaintenanceResponse:
        return lbd_pb2.MaintenanceResponse(
            broker_id=broker, maintenance=self._maintenance_of(broker)
        )

    # -- helpers -----------------------------------------------------------------------------


def _operation_id(text: str) -> str:
    """An operation id from a request (InvalidInputError when empty)."""
    if not text.strip():
        raise InvalidInputError("id is required: an operation id from `lbd ctl ops list`")
    return text.strip()
