"""The gRPC API over in-process sidecars: status codes, auth, reflection, health, streams."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from lbd.api.admin import AdminServicer
from lbd.api.errors import INTERNAL_MESSAGE
from lbd.api.forwarding import leader_methods
from lbd.api.loadbalancer import MAX_LOOKUPS_PER_CALL
from lbd.api.server import track_fence
from lbd.core.bundles import NamespaceBundles
from lbd.core.ids import BundleId
from lbd.core.names import NamespaceName
from lbd.gen.v1 import lbd_pb2
from lbd.ports.errors import UnavailableError
from lbd.services.sidecar.lookup import LookupResult
from tests.unit.api.served import Api, serve_api, until
from tests.unit.services.harness import Harness, Timing

TOPIC = "persistent://public/default/t1"


async def status_of(call: object) -> tuple[grpc.StatusCode, str]:
    """The status code and details a call ended with (fails if it succeeded)."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    return caught.value.code(), caught.value.details() or ""


async def owned_bundle(api: Api, topic: str = TOPIC) -> BundleId:
    reply = await api.lb.Lookup(lbd_pb2.LookupRequest(topic=topic), timeout=5)
    assert reply.state == lbd_pb2.BUNDLE_STATE_OWNED
    return BundleId(reply.bundle)


# -- answers -----------------------------------------------------------------------------------


async def test_lookup_assigns_and_answers_with_the_owner(api: Api) -> None:
    reply = await api.lb.Lookup(lbd_pb2.LookupRequest(topic=TOPIC), timeout=5)
    assert reply.owner_broker_id == "broker-a"
    assert reply.owner.service_url == "pulsar://broker-a:6650"
    assert (
        reply.bundle == NamespaceBundles.default(NamespaceName("public", "default")).find(TOPIC).id
    )
    listed = await api.admin.ListBundles(lbd_pb2.ListBundlesRequest(namespace="public/default"))
    states = {b.bundle: b.state for b in listed.bundles}
    assert len(states) == 4
    assert states[reply.bundle] == lbd_pb2.BUNDLE_STATE_OWNED
    assert sorted(states.values()).count(lbd_pb2.BUNDLE_STATE_INIT) == 3


async def test_admin_reads(api: Api) -> None:
    await owned_bundle(api)
    brokers = await api.admin.ListBrokers(lbd_pb2.ListBrokersRequest())
    leader = await api.admin.GetLeader(lbd_pb2.GetLeaderRequest())
    assert [(b.info.broker_id, b.leader, b.owned_bundles) for b in brokers.brokers] == [
        ("broker-a", True, 1)
    ]
    assert brokers.brokers[0].info.sidecar_grpc_addr == api.addr
    assert leader.broker_id == "broker-a" and leader.term > 0


async def test_create_namespace_then_conflict(api: Api) -> None:
    created = await api.admin.CreateNamespace(
        lbd_pb2.CreateNamespaceRequest(namespace="t/ns", bundles=2)
    )
    assert list(created.bundles) == ["t/ns/0x00000000_0x80000000", "t/ns/0x80000000_0xffffffff"]
    code, details = await status_of(
        api.admin.CreateNamespace(lbd_pb2.CreateNamespaceRequest(namespace="t/ns"))
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "t/ns already exists" in details


async def test_rebalance_on_the_leader_reports_why_nothing_moved(api: Api) -> None:
    reply = await api.admin.Rebalance(lbd_pb2.RebalanceRequest(dry_run=True))
    assert not reply.decisions
    assert reply.skip_reason  # one of Pulsar's names, e.g. NoLoadData / NoBrokers


# -- status codes --------------------------------------------------------------------------------


async def test_lookup_many_answers_each_lookup_in_order_and_fails_only_the_bad_ones(
    api: Api, harness: Harness
) -> None:
    layout = NamespaceBundles.default(NamespaceName("public", "default"))
    first, second, *_, last = layout.bundles()
    names = [f"persistent://public/default/many-{i}" for i in range(1_000)]
    topics = [t for t in names if layout.find(t).id in (first.id, second.id)][:40]
    read_only = next(t for t in names if layout.find(t).id == last.id)
    asked = [*topics[:20], "no-scheme", "persistent://nobody/nowhere/t", *topics[20:]]
    request = lbd_pb2.LookupManyRequest(
        lookups=[lbd_pb2.LookupRequest(topic=t) for t in asked]
        + [lbd_pb2.LookupRequest(topic=read_only, read_only=True)]
    )
    reply = await api.lb.LookupMany(request, timeout=5)
    assert len(reply.results) == len(asked) + 1
    for topic, result in zip(asked, reply.results, strict=False):
        if topic == "no-scheme":
            assert result.WhichOneof("outcome") == "failure"
            assert result.failure.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "invalid topic name 'no-scheme'" in result.failure.message
        elif topic.startswith("persistent://nobody"):
            assert result.failure.code == grpc.StatusCode.NOT_FOUND.value[0]
            assert "nobody/nowhere" in result.failure.message
        else:
            assert result.WhichOneof("outcome") == "answer"
            assert result.answer.state == lbd_pb2.BUNDLE_STATE_OWNED
            assert result.answer.bundle == layout.find(topic).id
            assert result.answer.owner_broker_id == "broker-a"
    unassigned = reply.results[-1].answer
    assert unassigned.bundle == last.id
    assert unassigned.state == lbd_pb2.BUNDLE_STATE_INIT and not unassigned.owner_broker_id
    await harness.idle()
    assert [harness.owner(b.id) for b in (first, second, last)] == ["broker-a", "broker-a", None]
    # Asked again, the owned ones are answered from memory and the rest looked up: same order.
    assert await api.lb.LookupMany(request, timeout=5) == reply


async def test_lookup_many_fails_one_lookup_that_cannot_be_answered_from_memory(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = "persistent://public/default/t2"
    await owned_bundle(api)
    await owned_bundle(api, other)
    real = api.sidecar.lookup.answer_now

    def fenced_for_one(topic: str) -> LookupResult | None:
        if topic == other:
            raise UnavailableError(f"the owner of {topic}'s bundle is fenced")
        return real(topic)

    monkeypatch.setattr(api.sidecar.lookup, "answer_now", fenced_for_one)
    topics = [TOPIC, other, TOPIC]
    request = lbd_pb2.LookupManyRequest(lookups=[lbd_pb2.LookupRequest(topic=t) for t in topics])
    reply = await api.lb.LookupMany(request, timeout=5)
    assert [r.WhichOneof("outcome") for r in reply.results] == ["answer", "failure", "answer"]
    assert reply.results[1].failure.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "fenced" in reply.results[1].failure.message


async def test_lookup_many_refuses_too_many_lookups_and_assigns_nothing(
    api: Api, harness: Harness
) -> None:
    before = len(harness.log)
    many = lbd_pb2.LookupManyRequest(
        lookups=[lbd_pb2.LookupRequest(topic=TOPIC)] * (MAX_LOOKUPS_PER_CALL + 1)
    )
    code, details = await status_of(api.lb.LookupMany(many, timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {MAX_LOOKUPS_PER_CALL} per call" in details
    assert len(harness.log) == before
    empty = await api.lb.LookupMany(lbd_pb2.LookupManyRequest(), timeout=5)
    assert list(empty.results) == []


async def test_invalid_argument_names_what_is_wrong_and_changes_nothing(
    api: Api, harness: Harness
) -> None:
    before = len(harness.log)
    code, details = await status_of(api.lb.Lookup(lbd_pb2.LookupRequest(topic="no-scheme")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "invalid topic name 'no-scheme'" in details
    code, details = await status_of(
        api.admin.Split(
            lbd_pb2.SplitRequest(bundle="public/default/0x00000000_0x40000000", algorithm="nope")
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown split algorithm 'nope'" in details
    code, details = await status_of(
        api.admin.Assign(lbd_pb2.AssignRequest(bundle="x", topic=TOPIC))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "exactly one of bundle and topic" in details
    assert len(harness.log) == before


async def test_not_found_for_an_unknown_namespace(api: Api, harness: Harness) -> None:
    before = len(harness.log)
    code, details = await status_of(
        api.lb.Lookup(lbd_pb2.LookupRequest(topic="persistent://nobody/nowhere/t"))
    )
    assert code == grpc.StatusCode.NOT_FOUND
    assert "nobody/nowhere" in details
    assert len(harness.log) == before


async def test_failed_precondition_for_a_transfer_to_the_owner(api: Api, harness: Harness) -> None:
    bundle = await owned_bundle(api)
    await harness.idle()
    before = len(harness.log)
    code, details = await status_of(
        api.admin.Transfer(lbd_pb2.TransferRequest(bundle=bundle, dst_broker_id="broker-a"))
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "broker-a" in details
    assert len(harness.log) == before
    assert harness.owner(bundle) == "broker-a"


async def test_deadline_exceeded_when_the_broker_never_acknowledges() -> None:
    async with Harness(timing=Timing(settle_timeout_s=3.0)) as h:
        sidecar = await h.add("broker-a", auto_ack=False, fake_broker=True, ack_own=None)
        await h.ready()
        async with serve_api(h, sidecar) as api:
            call = api.lb.Lookup(lbd_pb2.LookupRequest(topic=TOPIC), timeout=5)
            waiting = asyncio.ensure_future(status_of(call))
            while not waiting.done():
                await h.clock.run_for(0.5)
            code, details = waiting.result()
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert details


async def test_unavailable_in_safe_mode_without_assigning(api: Api, harness: Harness) -> None:
    before = len(harness.log)
    harness.metadata.set_reachable(False)
    async with asyncio.timeout(5):
        while api.sidecar.registry.reachable:  # the next keepalive fails
            await harness.clock.run_for(0.5)
    code, details = await status_of(api.lb.Lookup(lbd_pb2.LookupRequest(topic=TOPIC)))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert details
    assert len(harness.log) == before


async def test_unexpected_errors_are_internal_without_a_traceback(
    api: Api, harness: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(topic: str, *, read_only: bool = False) -> None:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(api.sidecar.lookup, "lookup", broken)
    with caplog.at_level(logging.ERROR, logger="lbd.api.errors"):
        code, details = await status_of(api.lb.Lookup(lbd_pb2.LookupRequest(topic=TOPIC)))
    assert code == grpc.StatusCode.INTERNAL
    assert details == INTERNAL_MESSAGE
    assert "secret" not in details and "Traceback" not in details
    logged = [r.exc_info[1] for r in caplog.records if r.exc_info]
    assert [str(e) for e in logged] == ["secret internals"]  # the log has the traceback


async def test_lookup_many_reports_a_bug_in_one_lookup_as_internal_and_answers_the_rest(
    api: Api, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = api.sidecar.lookup.lookup

    async def broken_for_one(topic: str, *, read_only: bool = False) -> LookupResult:
        if topic.endswith("/broken"):
            raise RuntimeError("secret internals")
        return await real(topic, read_only=read_only)

    monkeypatch.setattr(api.sidecar.lookup, "lookup", broken_for_one)
    topics = [TOPIC, "persistent://public/default/broken", TOPIC]
    request = lbd_pb2.LookupManyRequest(lookups=[lbd_pb2.LookupRequest(topic=t) for t in topics])
    with caplog.at_level(logging.ERROR, logger="lbd.api.errors"):
        reply = await api.lb.LookupMany(request, timeout=5)
    outcomes = [r.WhichOneof("outcome") for r in reply.results]
    assert outcomes == ["answer", "failure", "answer"]
    assert reply.results[1].failure.code == grpc.StatusCode.INTERNAL.value[0]
    assert reply.results[1].failure.message == INTERNAL_MESSAGE
    assert reply.results[0].answer == reply.results[2].answer
    logged = [r.exc_info[1] for r in caplog.records if r.exc_info]
    assert [str(e) for e in logged] == ["secret internals"]


# -- auth --------------------------------------------------------------------------------------


@pytest.fixture
async def guarded(harness: Harness) -> AsyncIterator[Api]:
    sidecar = await harness.add("broker-a")
    await harness.ready()
    async with serve_api(harness, sidecar, admin_token="s3cret") as served:
        yield served


async def test_admin_calls_need_the_token(guarded: Api) -> None:
    request = lbd_pb2.ListBrokersRequest()
    code, details = await status_of(guarded.admin.ListBrokers(request))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer" in details
    code, _ = await status_of(
        guarded.admin.ListBrokers(request, metadata=(("authorization", "Basic s3cret"),))
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED
    code, details = await status_of(
        guarded.admin.ListBrokers(request, metadata=(("authorization", "Bearer wrong"),))
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED  # a credential that is not valid
    assert "not valid" in details and "wrong" not in details
    ok = await guarded.admin.ListBrokers(request, metadata=(("authorization", "Bearer s3cret"),))
    assert [b.info.broker_id for b in ok.brokers] == ["broker-a"]


async def test_with_a_token_configured_anonymous_lookups_are_refused_too(guarded: Api) -> None:
    code, details = await status_of(guarded.lb.Lookup(lbd_pb2.LookupRequest(topic=TOPIC)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "needs the reader role" in details
    reply = await guarded.lb.Lookup(
        lbd_pb2.LookupRequest(topic=TOPIC), metadata=(("authorization", "Bearer s3cret"),)
    )
    assert reply.owner_broker_id == "broker-a"


# -- reflection and health ---------------------------------------------------------------------


async def _reflected_services(api: Api) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(api.channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")

    async def requests() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        yield request

    names: set[str] = set()
    async for reply in stub.ServerReflectionInfo(requests()):
        names |= {s.name for s in reply.list_services_response.service}
    return names


async def test_reflection_lists_both_services(api: Api) -> None:
    names = await _reflected_services(api)
    assert {"lbd.v1.LoadBalancer", "lbd.v1.Admin", "grpc.health.v1.Health"} <= names


async def test_every_service_is_a_generic_handler_and_no_method_is_registered(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grpc.aio awaits one pending request per registered method for every call it takes; the
    sidecar registers none, and still serves all four services (LoadBalancer asked first)."""
    registered: list[str] = []
    generic: list[str] = []
    real_generic = grpc.aio._server.Server.add_generic_rpc_handlers

    def add_generic(self: object, handlers: tuple[grpc.GenericRpcHandler, ...]) -> None:
        generic.extend(h.service_name() for h in handlers)  # type: ignore[attr-defined]
        real_generic(self, handlers)  # type: ignore[arg-type]

    def add_registered(self: object, service: str, handlers: object) -> None:
        registered.append(service)

    monkeypatch.setattr(grpc.aio._server.Server, "add_generic_rpc_handlers", add_generic)
    monkeypatch.setattr(grpc.aio._server.Server, "add_registered_method_handlers", add_registered)
    sidecar = await harness.add("broker-a")
    await harness.ready()
    async with serve_api(harness, sidecar) as api:
        assert registered == []
        assert generic == [
            "lbd.v1.LoadBalancer",
            "lbd.v1.Admin",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        ]
        reply = await api.lb.Lookup(lbd_pb2.LookupRequest(topic=TOPIC))
        assert reply.owner_broker_id == "broker-a"
        health = health_pb2_grpc.HealthStub(api.channel)
        checked = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert checked.status == health_pb2.HealthCheckResponse.SERVING
        assert "lbd.v1.Admin" in await _reflected_services(api)


async def test_health_follows_readiness_and_fencing(api: Api, harness: Harness) -> None:
    health = health_pb2_grpc.HealthStub(api.channel)

    async def status(service: str = "") -> int:
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        return int(reply.status)

    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    assert await status() == serving
    assert await status("lbd.v1.Admin") == serving
    tracker = asyncio.create_task(track_fence(api.server, api.sidecar.fence))
    try:
        # Renewals fail and the channel cannot be read through: the fence closes in.
        harness.metadata.set_reachable(False)
        harness.log.go_down()
        async with asyncio.timeout(5):
            while not api.sidecar.fence.fenced:
                await harness.clock.run_for(1.0)
        await until(lambda: api.server._serving is False)
        assert await status() == not_serving
        assert await status("lbd.v1.LoadBalancer") == not_serving
        harness.metadata.set_reachable(True)
        harness.log.come_back()
        async with asyncio.timeout(5):
            while api.sidecar.fence.fenced:
                await harness.clock.run_for(1.0)
        await until(lambda: api.server._serving is True)
        assert await status() == serving
    finally:
        tracker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tracker


# -- streams -----------------------------------------------------------------------------------


async def test_watch_ownership_sends_the_current_state_then_changes(
    api: Api, harness: Harness
) -> None:
    first = await owned_bundle(api)
    await harness.idle()
    stream = api.lb.WatchOwnership(lbd_pb2.WatchOwnershipRequest(namespace="public/default"))
    initial = await asyncio.wait_for(stream.read(), 5)
    assert (initial.bundle, initial.state, initial.owner_broker_id) == (
        first,
        lbd_pb2.BUNDLE_STATE_OWNED,
        "broker-a",
    )
    initial_bundles = [initial.bundle]
    while not (message := await asyncio.wait_for(stream.read(), 5)).snapshot_done:
        initial_bundles.append(message.bundle)
    assert initial_bundles == [first]
    assert not message.bundle
    other = await owned_bundle(api, "persistent://public/default/another-topic-7")
    seen: list[tuple[str, int]] = []
    async with asyncio.timeout(5):
        while (other, lbd_pb2.BUNDLE_STATE_OWNED) not in seen:
            change = await stream.read()
            seen.append((change.bundle, change.state))
    if other != first:
        assert (other, lbd_pb2.BUNDLE_STATE_ASSIGNING) in seen
    stream.cancel()


async def test_watch_ownership_rejects_a_bad_namespace(api: Api) -> None:
    stream = api.lb.WatchOwnership(lbd_pb2.WatchOwnershipRequest(namespace="a/b/c"))
    code, details = await status_of(stream.read())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "a/b/c" in details


async def test_broker_session_over_grpc_owns_what_a_lookup_assigns() -> None:
    async with Harness() as h:
        sidecar = await h.add("broker-a", auto_ack=False)
        async with serve_api(h, sidecar) as api:
            outgoing: asyncio.Queue[lbd_pb2.BrokerMessage | None] = asyncio.Queue()
            outgoing.put_nowait(
                lbd_pb2.BrokerMessage(
                    hello=lbd_pb2.BrokerInfo(
                        broker_id="broker-a", service_url="pulsar://real-broker:6650"
                    )
                )
            )

            async def messages() -> AsyncIterator[lbd_pb2.BrokerMessage]:
                while (message := await outgoing.get()) is not None:
                    yield message

            session = api.lb.BrokerSession(messages())
            await until(lambda: sidecar.link.attached)
            await h.ready()
            lookup = asyncio.ensure_future(
                api.lb.Lookup(lbd_pb2.LookupRequest(topic=TOPIC), timeout=5)
            )
            command = await asyncio.wait_for(session.read(), 5)
            assert command.WhichOneof("kind") == "own"
            outgoing.put_nowait(
                lbd_pb2.BrokerMessage(
                    ack=lbd_pb2.CommandAck(command_id=command.command_id, ok=True)
                )
            )
            reply = await lookup
            assert reply.bundle == command.own.bundle
            assert reply.owner.service_url == "pulsar://real-broker:6650"
            outgoing.put_nowait(None)
            await until(lambda: not sidecar.link.attached)
            session.cancel()


# -- forwarding --------------------------------------------------------------------------------


async def test_split_and_rebalance_are_forwarded(harness: Harness) -> None:
    a = await harness.add("broker-a")
    b = await harness.add("broker-b")
    await harness.ready()
    async with serve_api(harness, a) as api_a, serve_api(harness, b) as api_b:
        await until(lambda: api_a.elector.is_leader or api_b.elector.is_leader)
        leader, follower = (api_a, api_b) if api_a.elector.is_leader else (api_b, api_a)
        await until(lambda: follower.elector.leader is not None)
        await until(lambda: len(follower.sidecar.registry.brokers()) == 2)
        await until(
            lambda: all(
                i.sidecar_grpc_addr.startswith("127.0.0.1:")
                for i in follower.sidecar.registry.brokers().values()
            )
        )
        reply = await follower.admin.Rebalance(lbd_pb2.RebalanceRequest(dry_run=True), timeout=5)
        assert reply.skip_reason

        assign = await follower.admin.Assign(
            lbd_pb2.AssignRequest(topic=TOPIC, dst_broker_id=leader.sidecar.me), timeout=5
        )
        assert assign.owner_broker_id == leader.sidecar.me
        await harness.idle()
        split = await follower.admin.Split(lbd_pb2.SplitRequest(bundle=assign.bundle), timeout=5)
        assert split.parent == assign.bundle
        assert len(split.children) == 2
        assert split.owner_broker_id == leader.sidecar.me

        # A call marked as forwarded already is refused rather than forwarded again.
        await harness.idle()
        child = split.children[0]
        code, details = await status_of(
            follower.admin.Split(
                lbd_pb2.SplitRequest(bundle=child),
                metadata=(("x-lbd-forwarded", "elsewhere"),),
                timeout=5,
            )
        )
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "already forwarded here by elsewhere" in details

        # A Transfer is the leader's: asked of the follower, it runs there as an operation, and
        # the operation is watched through the follower too.
        moved = await follower.admin.Transfer(
            lbd_pb2.TransferRequest(bundle=child, dst_broker_id=follower.sidecar.me), timeout=10
        )
        assert (moved.src_broker_id, moved.dst_broker_id) == (
            leader.sidecar.me,
            follower.sidecar.me,
        )
        [op] = leader.sidecar.tracker.list_operations()
        assert op.description == f"transfer of {child} to {follower.sidecar.me} (from " + (
            f"{leader.sidecar.me})"
        )
        watched = [
            o async for o in follower.admin.WatchOperation(lbd_pb2.WatchOperationRequest(id=op.id))
        ]
        assert watched[-1].id == op.id
        assert watched[-1].state == lbd_pb2.OPERATION_STATE_SUCCEEDED
        assert follower.sidecar.tracker.list_operations() == []  # nothing ran on the follower
        code, details = await status_of(
            follower.admin.Unload(
                lbd_pb2.UnloadRequest(bundle=child),
                metadata=(("x-lbd-forwarded", "elsewhere"),),
                timeout=5,
            )
        )
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "already forwarded here by elsewhere" in details


def test_the_methods_that_run_on_the_leader_are_declared_on_the_servicer() -> None:
    """One declaration per method (:func:`on_leader`), read by the forwarding layer."""
    assert leader_methods(AdminServicer.__new__(AdminServicer), "lbd.v1.Admin") == {
        f"/lbd.v1.Admin/{name}"
        for name in (
            "Transfer",
            "Unload",
            "Rebalance",
            "Execute",
            "ListOperations",
            "GetOperation",
            "WatchOperation",
            "CancelOperation",
            "Snapshot",
            "Audit",
            "ListDecisions",
            "Drain",
            "Decommission",
        )
    }


# -- tracing -----------------------------------------------------------------------------------


async def test_each_call_gets_a_server_span_with_its_status(harness: Harness) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sidecar = await harness.add("broker-a")
    await harness.ready()
    async with serve_api(harness, sidecar, tracer_provider=provider) as api:
        await api.lb.Lookup(lbd_pb2.LookupRequest(topic=TOPIC), timeout=5)
        await status_of(api.lb.Lookup(lbd_pb2.LookupRequest(topic="bad")))
        await status_of(api.lb.Lookup(lbd_pb2.LookupRequest(topic="persistent://x/y/z")))
    spans = [s for s in exporter.get_finished_spans() if s.name == "lbd.v1.LoadBalancer/Lookup"]
    assert [s.attributes["rpc.grpc.status_code"] for s in spans if s.attributes] == [
        grpc.StatusCode.OK.value[0],
        grpc.StatusCode.INVALID_ARGUMENT.value[0],
        grpc.StatusCode.NOT_FOUND.value[0],
    ]
    assert all(s.kind is SpanKind.SERVER for s in spans)
    # A caller's mistake is not the server's fault: the span status stays unset.
    assert all(s.status.status_code is StatusCode.UNSET for s in spans)
