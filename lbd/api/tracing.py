"""OpenTelemetry spans for every call of lbd's services (DESIGN §10).

Tracing is off unless an exporter is asked for: then no span is made and the calls pay nothing
for it. ``OTEL_TRACES_EXPORTER=console`` (the standard OpenTelemetry variable) turns it on: the
app installs a :class:`TracerProvider` once per process (:func:`install_tracing`) and the spans
are printed on stdout; a deployment wanting OTLP adds its exporter to that provider. The tracing
layer continues the caller's trace when the call carries a ``traceparent`` (W3C trace context),
so a forwarded Admin call shows up under the sidecar that forwarded it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from lbd.api.handlers import (
    Call,
    CallWrapper,
    StreamCall,
    WrappingInterceptor,
)

EXPORTER_ENV = "OTEL_TRACES_EXPORTER"
"""Standard OpenTelemetry variable; lbd honours its ``console`` value."""

# Server-side codes that are the server's fault (OpenTelemetry gRPC conventions); the others
# (a bad name, an unknown bundle...) are the caller's and leave the span's status unset.
_SERVER_FAULTS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


def console_requested(env: Mapping[str, str]) -> bool:
    """Whether ``env`` asks for spans on the console (``OTEL_TRACES_EXPORTER`` lists console)."""
    names = env.get(EXPORTER_ENV, "")
    return "console" in {n.strip().lower() for n in names.split(",")}


def install_tracing(*, broker_id: str, console: bool) -> TracerProvider | None:
    """With ``console``, make a provider exporting to the console this process's global one
    (shut it down when stopping); None when no exporter is asked for (tracing off)."""
    if not console:
        return None
    provider = TracerProvider(
        resource=Resource.create({"service.name": "lbd", "service.instance.id": broker_id})
    )
    provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


def inject_context(metadata: list[tuple[str, str]]) -> None:
    """Add the current trace context to outgoing call metadata (for forwarded calls)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    metadata.extend(carrier.items())


def _incoming_context(metadata: Sequence[tuple[str, Any]] | None) -> Any:
    carrier = {k: v for k, v in metadata or () if isinstance(v, str)}
    return propagate.extract(carrier)


class _Spans(CallWrapper):
    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def _start(self, method: str, context: grpc.aio.ServicerContext) -> trace.Span:
        name = method.lstrip("/")
        service, _, rpc = name.partition("/")
        return self._tracer.start_span(
            name,
            context=_incoming_context(context.invocation_metadata()),
            kind=trace.SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc},
        )

    async def unary(self, method: str, context: grpc.aio.ServicerContext, call: Call) -> Any:
        span = self._start(method, context)
        try:
            with _current(span):
                response = await call()
        except BaseException as e:
            _record_status(span, _failure_code(context, e))
            raise
        else:
            _record_status(span, grpc.StatusCode.OK)
            return response
        finally:
            span.end()

    async def stream(
        self, method: str, context: grpc.aio.ServicerContext, call: StreamCall
    ) -> AsyncGenerator[Any, None]:
        # The span is current while the handler makes each response, never across a yield: a
        # stream the client cancels mid-send is closed later in another task, where a context
        # attached in this one cannot be detached (opentelemetry logs a traceback for each).
        span = self._start(method, context)
        count = 0
        try:
            async with contextlib.aclosing(call()) as responses:
                while True:
                    with _current(span):
                        try:
                            response = await anext(responses)
                        except StopAsyncIteration:
                            break
                    count += 1
                    yield response
        except BaseException as e:
            _record_status(span, _failure_code(context, e))
            raise
        else:
            _record_status(span, grpc.StatusCode.OK)
        finally:
            span.set_attribute("lbd.responses", count)
            span.end()


def _current(span: trace.Span) -> contextlib.AbstractContextManager[trace.Span]:
    """``span`` made current (attached and detached in the one task) and left open."""
    return trace.use_span(
        span, end_on_exit=False, record_exception=False, set_status_on_exception=False
    )


def _failure_code(context: grpc.aio.ServicerContext, error: BaseException) -> grpc.StatusCode:
    code: grpc.StatusCode | None = context.code()
    if code is not None:
        return code
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        # Cancelled (by the client, its deadline or the server stopping) or dropped mid-send.
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


def _record_status(span: trace.Span, code: grpc.StatusCode) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in _SERVER_FAULTS:
        span.set_status(trace.StatusCode.ERROR, code.name)


class TracingInterceptor(WrappingInterceptor):
    """One SERVER span per call of lbd's services, with its gRPC status code."""

    def __init__(self, provider: trace.TracerProvider | None = None) -> None:
        super().__init__(_Spans(trace.get_tracer(__name__, tracer_provider=provider)))
