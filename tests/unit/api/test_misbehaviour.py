"""A client's misbehaviour over gRPC: answered with a status and counted, never a traceback.

Cancelled streams, undecodable requests and invalid arguments are the client's business: the log
gets at most a debug line, ``lbd_grpc_client_errors_total`` gets the count.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from lbd.gen.v1 import lbd_pb2
from tests.unit.api.served import Api, serve_api, until
from tests.unit.services.harness import Harness

STREAMS = 200
"""Enough for a few of them to be cancelled while grpc sends their snapshot (about one in ten)."""

BUNDLES = 64
"""Owned bundles in the watched snapshot: each stream has that many messages to send."""

GARBAGE = b"\xff\xff\xff\xff\x0f"
"""Not a protobuf message of any type: a field number of 2^28 - 1 with an invalid wire type."""

WATCH = "lbd.v1.LoadBalancer/WatchOwnership"
SESSION = "lbd.v1.LoadBalancer/BrokerSession"


def client_errors(api: Api, method: str, kind: str) -> float:
    """``lbd_grpc_client_errors_total{method, kind}`` of the served sidecar."""
    value = api.sidecar.metrics.registry.get_sample_value(
        "lbd_grpc_client_errors_total", {"method": method, "kind": kind}
    )
    return value or 0.0


def capture_everything(caplog: pytest.LogCaptureFixture) -> None:
    """Every record of lbd and of opentelemetry (whose context detach logs its tracebacks)."""
    caplog.set_level(logging.INFO)
    for logger in ("lbd", "opentelemetry"):
        caplog.set_level(logging.DEBUG, logger=logger)


def assert_quiet(caplog: pytest.LogCaptureFixture) -> None:
    """No error and no traceback in the log."""
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud, [f"{r.name}: {r.getMessage()}" for r in loud]
    assert "Traceback" not in caplog.text


async def status_of(call: object) -> tuple[grpc.StatusCode, str]:
    """The status code and details a call ended with (fails if it succeeded)."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    return caught.value.code(), caught.value.details() or ""


def raw(channel: grpc.aio.Channel, method: str, kind: str = "unary_unary") -> object:
    """A call of ``method`` that sends and receives raw bytes."""
    make = getattr(channel, kind)
    return make(method, request_serializer=None, response_deserializer=None)


# -- cancelled streams ---------------------------------------------------------------------------


async def test_cancelling_many_streams_at_once_is_counted_without_a_traceback(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    capture_everything(caplog)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sidecar = await harness.add("broker-a")
    await harness.ready()
    async with serve_api(harness, sidecar, tracer_provider=provider) as api:
        created = await api.admin.CreateNamespace(
            lbd_pb2.CreateNamespaceRequest(namespace="t/ns", bundles=BUNDLES), timeout=5
        )
        await asyncio.gather(
            *(
                api.admin.Assign(lbd_pb2.AssignRequest(bundle=bundle), timeout=5)
                for bundle in created.bundles
            )
        )
        session = api.lb.BrokerSession(_hello_then_silence())
        await until(lambda: sidecar.link.attached)
        watches = [
            api.lb.WatchOwnership(lbd_pb2.WatchOwnershipRequest(namespace="t/ns"))
            for _ in range(STREAMS)
        ]
        # Every stream is under way: the rest of its snapshot is being sent when it is cancelled.
        await asyncio.gather(*(watch.read() for watch in watches))
        for call in (*watches, session):
            call.cancel()
        await until(lambda: client_errors(api, WATCH, "cancelled") == STREAMS)
        await until(lambda: not sidecar.link.attached)
        await until(lambda: len(_finished(exporter, SESSION)) == 1)
        # grpc's aio server can see a bidi stream's cancel as the end of its requests, when the
        # handler returns before grpc has processed the cancel: the session then ended as a
        # broker that finished, and it is neither counted nor recorded as cancelled.
        session_cancelled = client_errors(api, SESSION, "cancelled")

    assert_quiet(caplog)
    spans = [*_finished(exporter, WATCH), *_finished(exporter, SESSION)]
    assert len(spans) == STREAMS + 1
    for span in spans:
        assert span.attributes is not None
        expected = grpc.StatusCode.CANCELLED
        if span.name == SESSION and not session_cancelled:
            expected = grpc.StatusCode.OK
        assert span.attributes["rpc.grpc.status_code"] == expected.value[0], span.name
        assert span.status.status_code is StatusCode.UNSET  # not the server's fault


def _finished(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


async def _hello_then_silence() -> AsyncIterator[lbd_pb2.BrokerMessage]:
    yield lbd_pb2.BrokerMessage(
        hello=lbd_pb2.BrokerInfo(broker_id="broker-a", service_url="pulsar://broker-a:6650")
    )
    await asyncio.Event().wait()  # the broker stays until its call is cancelled


async def test_calls_the_server_cancels_when_stopping_are_not_counted(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    capture_everything(caplog)
    sidecar = await harness.add("broker-a")
    await harness.ready()
    async with serve_api(harness, sidecar) as api:
        watch = api.lb.WatchOwnership(lbd_pb2.WatchOwnershipRequest(namespace="public/default"))
        while not (await watch.read()).snapshot_done:
            pass
        await api.server.stop(0)
        code, _ = await status_of(watch.read())
        assert code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        assert client_errors(api, WATCH, "cancelled") == 0
    assert_quiet(caplog)


# -- undecodable requests and invalid arguments --------------------------------------------------


async def test_an_undecodable_unary_request_is_an_invalid_argument_counted_quietly(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    capture_everything(caplog)
    for method in ("/lbd.v1.LoadBalancer/Lookup", "/lbd.v1.Admin/Transfer"):
        call = raw(api.channel, method)
        code, details = await status_of(call(GARBAGE, timeout=5))  # type: ignore[operator]
        assert code is grpc.StatusCode.INVALID_ARGUMENT, (method, code, details)
        assert "not a valid" in details and "Request" in details, details
        assert client_errors(api, method.lstrip("/"), "undecodable") == 1
    assert client_errors(api, "lbd.v1.LoadBalancer/Lookup", "invalid_argument") == 0
    assert_quiet(caplog)


async def test_garbage_on_a_broker_session_ends_it_as_an_invalid_argument_counted_quietly(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    capture_everything(caplog)

    async def messages() -> AsyncIterator[bytes]:
        hello = lbd_pb2.BrokerMessage(hello=lbd_pb2.BrokerInfo(broker_id="broker-a"))
        yield hello.SerializeToString()
        yield GARBAGE

    call = raw(api.channel, f"/{SESSION}", "stream_stream")
    stream = call(messages(), timeout=5)  # type: ignore[operator]

    async def drain() -> None:
        async for _ in stream:
            pass

    code, details = await status_of(drain())
    assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "not a valid" in details, details
    assert client_errors(api, SESSION, "undecodable") == 1
    assert client_errors(api, SESSION, "cancelled") == 0
    assert_quiet(caplog)


async def test_an_invalid_argument_is_counted_by_its_method(api: Api) -> None:
    code, _ = await status_of(api.lb.Lookup(lbd_pb2.LookupRequest(topic="no-scheme"), timeout=5))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert client_errors(api, "lbd.v1.LoadBalancer/Lookup", "invalid_argument") == 1
    assert client_errors(api, "lbd.v1.LoadBalancer/Lookup", "undecodable") == 0
