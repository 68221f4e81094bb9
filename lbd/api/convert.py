"""Protobuf <-> core types, in both directions, with nothing else in between.

Incoming messages are validated here, where the proto field names are known, so a bad field is
reported to the caller by its proto name (INVALID_ARGUMENT). An empty proto string means "not
set"; it becomes None in the core.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Generator, Iterable, Mapping
from typing import TYPE_CHECKING, Final

from lbd.core.audit import AuditReport
from lbd.core.broker_info import (
    BrokerInfo,
    BrokerMessage,
    CommandAck,
    Hello,
    LazyTopics,
    LeaseRequest,
    Leave,
    LoadReport,
    OwnCommand,
    ReleaseCommand,
    ServingLease,
    SidecarMessage,
)
from lbd.core.bundles import TopicLoad, parse_bundle_id
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BrokerUsage, BundleLoad, ResourceUsage
from lbd.core.namespace import IsolationPolicy, NamespacePolicies, NamespaceRecord
from lbd.core.operations import Move, MoveState, Operation, OperationState, Plan
from lbd.core.shedding import SheddingResult
from lbd.core.state import ServiceUnitState, ServiceUnitStateData
from lbd.gen.v1 import lbd_pb2

MAX_LEAVE_REASON = 200
"""Characters of a broker's leave reason kept (it goes into the maintenance record)."""

if TYPE_CHECKING:
    from lbd.services.leader.decisions import Decision
    from lbd.services.sidecar.lookup import LookupResult

_STATES: Mapping[ServiceUnitState, lbd_pb2.BundleState] = {
    ServiceUnitState.Init: lbd_pb2.BUNDLE_STATE_INIT,
    ServiceUnitState.Free: lbd_pb2.BUNDLE_STATE_FREE,
    ServiceUnitState.Owned: lbd_pb2.BUNDLE_STATE_OWNED,
    ServiceUnitState.Assigning: lbd_pb2.BUNDLE_STATE_ASSIGNING,
    ServiceUnitState.Releasing: lbd_pb2.BUNDLE_STATE_RELEASING,
    ServiceUnitState.Splitting: lbd_pb2.BUNDLE_STATE_SPLITTING,
    ServiceUnitState.Deleted: lbd_pb2.BUNDLE_STATE_DELETED,
}


def optional(text: str) -> str | None:
    """A proto string field as the core sees it: None when empty."""
    return text or None


def broker_id(text: str, field: str) -> BrokerId:
    """A required broker id field; InvalidInputError naming ``field`` when blank."""
    if not text.strip():
        raise InvalidInputError(f"{field} is required")
    return BrokerId(text.strip())


def bundle_id(text: str, field: str = "bundle") -> BundleId:
    """A bundle id field in its canonical spelling; InvalidInputError naming ``field``."""
    if not text:
        raise InvalidInputError(f"{field} is required (tenant/namespace/0xLLLLLLLL_0xHHHHHHHH)")
    return _canonical_bundle_id(text)


@functools.lru_cache(maxsize=65_536)
def _canonical_bundle_id(text: str) -> BundleId:
    """Parsed once per spelling: every load report names each of its broker's bundles again
    (a failure raises and is not kept)."""
    return parse_bundle_id(text).id


# -- states and bundles ----------------------------------------------------------------------


def state_to_proto(state: ServiceUnitState) -> lbd_pb2.BundleState:
    """A state as the proto enum."""
    return _STATES[state]


def bundle_info(bundle: BundleId, value: ServiceUnitStateData | None) -> lbd_pb2.BundleInfo:
    """One bundle's value (None: Init) for ListBundles."""
    if value is None:
        return lbd_pb2.BundleInfo(bundle=bundle, state=lbd_pb2.BUNDLE_STATE_INIT)
    return lbd_pb2.BundleInfo(
        bundle=bundle,
        state=state_to_proto(value.state),
        owner_broker_id=value.dst_broker or "",
        source_broker_id=value.source_broker or "",
        version_id=value.version_id,
    )


def ownership_change(
    bundle: BundleId, value: ServiceUnitStateData | None
) -> lbd_pb2.OwnershipChange:
    """One bundle's value (None: tombstoned, Init) for WatchOwnership."""
    info = bundle_info(bundle, value)
    return lbd_pb2.OwnershipChange(
        bundle=info.bundle,
        state=info.state,
        owner_broker_id=info.owner_broker_id,
        source_broker_id=info.source_broker_id,
        version_id=info.version_id,
    )


# -- brokers ---------------------------------------------------------------------------------


def broker_info_to_proto(info: BrokerInfo) -> lbd_pb2.BrokerInfo:
    """A registration as the proto message."""
    return lbd_pb2.BrokerInfo(
        broker_id=info.broker_id,
        service_url=info.service_url,
        service_url_tls=info.service_url_tls,
        web_service_url=info.web_service_url,
        web_service_url_tls=info.web_service_url_tls,
        version=info.version,
        start_time_ms=info.start_time_ms,
        sidecar_grpc_addr=info.sidecar_grpc_addr,
    )


def broker_info_from_proto(msg: lbd_pb2.BrokerInfo) -> BrokerInfo:
    """A broker's Hello; InvalidInputError when its id is missing or a field is bad."""
    if not msg.broker_id.strip():
        raise InvalidInputError("hello.broker_id is required")
    return BrokerInfo(
        broker_id=BrokerId(msg.broker_id),
        service_url=msg.service_url,
        service_url_tls=msg.service_url_tls,
        web_service_url=msg.web_service_url,
        web_service_url_tls=msg.web_service_url_tls,
        version=msg.version,
        start_time_ms=msg.start_time_ms,
        sidecar_grpc_addr=msg.sidecar_grpc_addr,
    )


def owner_urls(info: BrokerInfo) -> lbd_pb2.OwnerUrls:
    """The URLs clients of ``info``'s broker connect to."""
    return lbd_pb2.OwnerUrls(
        service_url=info.service_url,
        service_url_tls=info.service_url_tls,
        web_service_url=info.web_service_url,
        web_service_url_tls=info.web_service_url_tls,
    )


def lookup_response(result: LookupResult) -> lbd_pb2.LookupResponse:
    """A lookup's answer."""
    response = lbd_pb2.LookupResponse(
        bundle=result.bundle,
        state=state_to_proto(result.state),
        owner_broker_id=result.owner_id or "",
    )
    if result.owner is not None:
        response.owner.CopyFrom(owner_urls(result.owner))
    return response


LOOKUP_RESPONSES_KEPT: Final = 65_536
"""Bundles whose last answer :class:`LookupResponses` keeps (emptied when it reaches this)."""


class LookupResponses:
    """Lookup answers made once per bundle and owner, not once per call.

    Each bundle's last answer is kept with what it was made from, and given again while a lookup
    finds the same state, the same owner id and the very same registration object (the registry
    replaces the object when a broker registers anew). The messages given out are shared: whoever
    takes one only reads it (grpc serializes it; a ``LookupResult`` copies it)."""

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept: dict[BundleId, tuple[LookupResult, lbd_pb2.LookupResponse]] = {}

    def of(self, result: LookupResult) -> lbd_pb2.LookupResponse:
        """The answer to give for ``result``."""
        kept = self._kept.get(result.bundle)
        if kept is not None:
            made_from, response = kept
            if (
                made_from.owner is result.owner
                and made_from.state is result.state
                and made_from.owner_id == result.owner_id
            ):
                return response
        response = lookup_response(result)
        if len(self._kept) >= LOOKUP_RESPONSES_KEPT:
            self._kept.clear()
        self._kept[result.bundle] = (result, response)
        return response


# -- the broker session ----------------------------------------------------------------------


def _usage(msg: lbd_pb2.ResourceUsage, field: str) -> ResourceUsage:
    if msg.usage < 0 or msg.limit < 0:
        raise InvalidInputError(f"load.{field}: usage and limit must be >= 0")
    return ResourceUsage(usage=msg.usage, limit=msg.limit)


def _bundle_load(msg: lbd_pb2.BundleStats) -> BundleLoad:
    return BundleLoad(
        bundle=bundle_id(msg.bundle, "load.bundles.bundle"),
        msg_throughput_in=msg.msg_throughput_in,
        msg_throughput_out=msg.msg_throughput_out,
        msg_rate_in=msg.msg_rate_in,
        msg_rate_out=msg.msg_rate_out,
        topics=msg.topics,
        consumer_count=msg.consumer_count,
        producer_count=msg.producer_count,
    )


def _topic_loads(stats: Iterable[lbd_pb2.TopicStats]) -> tuple[TopicLoad, ...]:
    return tuple(
        TopicLoad(t.topic, msg_rate=t.msg_rate, throughput=t.msg_throughput) for t in stats
    )


LOAD_SLICE: Final = 200
"""Bundles of a load report converted between two turns of the event loop, by
:func:`broker_messages_from_proto`: a report of a broker with 1,000 bundles is 15 to 35 ms of
conversion, which would otherwise hold up every lookup of the sidecar."""


def load_report_from_proto(msg: lbd_pb2.LoadReport) -> LoadReport:
    """A broker's load report; the broker-wide rates are the sums over its bundles."""
    steps = _load_report_steps(msg)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            report: LoadReport = done.value
            return report


async def broker_messages_from_proto(
    messages: AsyncIterator[lbd_pb2.BrokerMessage],
) -> AsyncIterator[BrokerMessage]:
    """:func:`broker_message_from_proto` of each message of a broker's stream, a load report's
    bundles ``LOAD_SLICE`` at a time with the event loop run in between."""
    async for msg in messages:
        if msg.WhichOneof("kind") != "load":
            yield broker_message_from_proto(msg)
            continue
        steps = _load_report_steps(msg.load)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                yield done.value
                break
            await asyncio.sleep(0)


def _load_report_steps(msg: lbd_pb2.LoadReport) -> Generator[None, None, LoadReport]:
    """The conversion of a load report, pausing after every ``LOAD_SLICE`` bundles."""
    loads = []
    for n, stats in enumerate(msg.bundles, 1):
        loads.append(_bundle_load(stats))
        for t in stats.topic_stats:
            if t.msg_rate < 0 or t.msg_throughput < 0:
                raise InvalidInputError(
                    f"load.bundles.topic_stats: topic {t.topic!r}: msg_rate and msg_throughput "
                    f"must be >= 0, got {t.msg_rate} and {t.msg_throughput}"
                )
        if n % LOAD_SLICE == 0:
            yield
    bundles = tuple(loads)
    # Checked above, made when a split asks for them.
    topics = LazyTopics(
        {
            load.bundle: stats.topic_stats
            for load, stats in zip(bundles, msg.bundles, strict=True)
            if stats.topic_stats
        },
        _topic_loads,
    )
    usage = BrokerUsage(
        cpu=_usage(msg.cpu, "cpu"),
        memory=_usage(msg.memory, "memory"),
        direct_memory=_usage(msg.direct_memory, "direct_memory"),
        bandwidth_in=_usage(msg.bandwidth_in, "bandwidth_in"),
        bandwidth_out=_usage(msg.bandwidth_out, "bandwidth_out"),
        msg_throughput_in=sum(b.msg_throughput_in for b in bundles),
        msg_throughput_out=sum(b.msg_throughput_out for b in bundles),
        msg_rate_in=sum(b.msg_rate_in for b in bundles),
        msg_rate_out=sum(b.msg_rate_out for b in bundles),
        bundle_count=len(bundles),
        topics=sum(b.topics for b in bundles),
    )
    return LoadReport(usage=usage, bundles=bundles, topics=topics)


def broker_message_from_proto(msg: lbd_pb2.BrokerMessage) -> BrokerMessage:
    """One message of the broker's stream; InvalidInputError when it carries nothing."""
    kind = msg.WhichOneof("kind")
    if kind == "hello":
        return Hello(
            broker_info_from_proto(msg.hello), takes_own_batches=msg.hello.takes_own_batches
        )
    if kind == "load":
        return load_report_from_proto(msg.load)
    if kind == "ack":
        ack = msg.ack
        failed = {
            bundle_id(f.bundle, "ack.failed.bundle"): f.error or "not taken" for f in ack.failed
        }
        if failed and ack.ok:
            raise InvalidInputError("ack: ok is true but failed names bundles not taken")
        return CommandAck(command_id=ack.command_id, ok=ack.ok, error=ack.error, failed=failed)
    if kind == "lease_request":
        return LeaseRequest(msg.lease_request.sequence, msg.lease_request.lapses)
    if kind == "leave":
        return Leave(msg.leave.reason[:MAX_LEAVE_REASON])
    raise InvalidInputError(
        "a BrokerMessage must set one of hello, load, ack, lease_request or leave"
    )


def sidecar_message_to_proto(msg: SidecarMessage) -> lbd_pb2.SidecarMessage:
    """One command to the broker."""
    out = lbd_pb2.SidecarMessage(command_id=msg.command_id)
    command = msg.command
    if isinstance(command, OwnCommand):
        out.own.bundle = command.bundle
        out.own.more_bundles.extend(command.more)
    elif isinstance(command, ServingLease):
        out.lease.sequence = command.sequence
        out.lease.duration_ms = command.duration_ms
    elif isinstance(command, ReleaseCommand):
        out.release.bundle = command.bundle
        if command.new_owner is not None:
            out.release.new_owner_broker_id = command.new_owner.broker_id
            out.release.new_owner.CopyFrom(owner_urls(command.new_owner))
    else:
        out.close.bundle = command.bundle
        out.close.reason = command.reason
    return out


# -- namespaces ------------------------------------------------------------------------------


def policies_from_proto(msg: lbd_pb2.NamespacePolicies) -> NamespacePolicies:
    """Namespace policies; isolation applies when ``isolation_primary`` is set."""
    isolation = None
    if msg.isolation_primary:
        isolation = IsolationPolicy(
            primary=tuple(msg.isolation_primary),
            secondary=tuple(msg.isolation_secondary),
            min_available_primaries=(
                msg.isolation_min_primaries if msg.HasField("isolation_min_primaries") else 1
            ),
        )
    elif msg.isolation_secondary or msg.HasField("isolation_min_primaries"):
        raise InvalidInputError(
            "policies: isolation_secondary and isolation_min_primaries need isolation_primary"
        )
    return NamespacePolicies(
        isolation=isolation,
        anti_affinity_group=optional(msg.anti_affinity_group),
        max_bundles=msg.max_bundles if msg.HasField("max_bundles") else None,
    )


def policies_to_proto(policies: NamespacePolicies) -> lbd_pb2.NamespacePolicies:
    """The protobuf of a namespace's policies (the inverse of :func:`policies_from_proto`)."""
    msg = lbd_pb2.NamespacePolicies(anti_affinity_group=policies.anti_affinity_group or "")
    if policies.isolation is not None:
        msg.isolation_primary.extend(policies.isolation.primary)
        msg.isolation_secondary.extend(policies.isolation.secondary)
        msg.isolation_min_primaries = policies.isolation.min_available_primaries
    if policies.max_bundles is not None:
        msg.max_bundles = policies.max_bundles
    return msg


def namespace_info(record: NamespaceRecord) -> lbd_pb2.NamespaceInfo:
    """A namespace, its bundle ids in hash order and its policies."""
    return lbd_pb2.NamespaceInfo(
        namespace=str(record.name),
        bundles=[b.id for b in record.bundles().bundles()],
        policies=policies_to_proto(record.policies),
    )


def namespace_response(record: NamespaceRecord) -> lbd_pb2.CreateNamespaceResponse:
    """A namespace and its bundle ids, in hash order."""
    return lbd_pb2.CreateNamespaceResponse(
        namespace=str(record.name), bundles=[b.id for b in record.bundles().bundles()]
    )


# -- load and shedding -----------------------------------------------------------------------


def load_response(
    loads: Iterable[BrokerLoadData], avg: float, std: float
) -> lbd_pb2.GetLoadResponse:
    """Per-broker load, sorted by broker id, with its mean and standard deviation."""
    return lbd_pb2.GetLoadResponse(
        brokers=[
            lbd_pb2.BrokerLoad(
                broker_id=d.broker,
                load=d.weighted_max_ema,
                msg_throughput=d.msg_throughput_ema,
                updated_at_ms=d.updated_at_ms,
                msg_rate=d.usage.msg_rate_in + d.usage.msg_rate_out,
            )
            for d in sorted(loads, key=lambda d: d.broker)
        ],
        avg=avg,
        std=std,
    )


def decision(d: Decision) -> lbd_pb2.Decision:
    """One entry of the leader's decision log (absent brokers and operation: empty strings)."""
    return lbd_pb2.Decision(
        at_ms=d.at_ms,
        kind=d.kind,
        bundle=d.bundle,
        src_broker_id=d.src or "",
        dst_broker_id=d.dst or "",
        reason=d.reason,
        source=d.source,
        operation_id=d.operation_id or "",
    )


def rebalance_response(
    result: SheddingResult, plan: Plan | None = None, operation_id: str | None = None
) -> lbd_pb2.RebalanceResponse:
    """A shedding cycle's decisions (as a plan), or why there are none."""
    return lbd_pb2.RebalanceResponse(
        decisions=[
            lbd_pb2.UnloadDecision(
                bundle=d.bundle,
                src_broker_id=d.src,
                dst_broker_id=d.dst or "",
                reason=d.reason.value,
            )
            for d in result.decisions
        ],
        skip_reason=result.skip_reason.value if result.skip_reason is not None else "",
        avg=result.avg,
        std=result.std,
        plan=None if plan is None else plan_to_proto(plan),
        operation_id=operation_id or "",
    )


_MOVE_STATES = {s: getattr(lbd_pb2, f"MOVE_STATE_{s.name}") for s in MoveState}
_OPERATION_STATES = {s: getattr(lbd_pb2, f"OPERATION_STATE_{s.name}") for s in OperationState}


def move_to_proto(move: Move) -> lbd_pb2.Move:
    """One move of a plan or an operation."""
    return lbd_pb2.Move(
        bundle=move.bundle,
        src_broker_id=move.src,
        dst_broker_id=move.dst or "",
        reason=move.reason,
        state=_MOVE_STATES[move.state],
        error=move.error,
        started_at_ms=move.started_at_ms,
        ended_at_ms=move.ended_at_ms,
        unavailable_ms=-1.0 if move.unavailable_ms is None else move.unavailable_ms,
        msg_throughput=move.msg_throughput,
        sessions=move.sessions,
    )


def plan_to_proto(plan: Plan) -> lbd_pb2.Plan:
    """A plan, with its predicted spread and what it moves."""
    return lbd_pb2.Plan(
        id=plan.id,
        strategy=plan.strategy,
        moves=[move_to_proto(m) for m in plan.moves],
        avg=plan.avg,
        std_before=plan.std_before,
        std_after=plan.std_after,
        bytes_to_move=plan.bytes_to_move,
        sessions_to_move=plan.sessions_to_move,
        created_at_ms=plan.created_at_ms,
        expires_at_ms=plan.expires_at_ms,
    )


def operation(op: Operation) -> lbd_pb2.Operation:
    """An operation with its moves and progress."""
    return lbd_pb2.Operation(
        id=op.id,
        kind=op.kind.value,
        description=op.description,
        state=_OPERATION_STATES[op.state],
        moves=[move_to_proto(m) for m in op.moves],
        created_at_ms=op.created_at_ms,
        ended_at_ms=op.ended_at_ms,
        error=op.error,
        broker_id=op.broker or "",
        plan_id=op.plan_id or "",
        moves_done=op.moves_done,
        moves_left=op.moves_left,
    )


def audit_response(report: AuditReport) -> lbd_pb2.AuditResponse:
    """The safety auditor's report: each finding with what to do about it."""
    return lbd_pb2.AuditResponse(
        findings=[
            lbd_pb2.Finding(
                kind=f.kind.value,
                bundle=f.bundle or "",
                broker_id=f.broker or "",
                detail=f.detail,
                action=f.action,
                since_ms=f.since_ms,
            )
            for f in report.findings
        ],
        checked_at_ms=report.checked_at_ms,
        bundles_checked=report.bundles_checked,
        sidecars_compared=report.sidecars_compared,
    )
