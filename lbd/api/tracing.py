"""OpenTelemetry spans for every call of lbd's services (DESIGN §10).

The app installs a :class:`TracerProvider` once per process (:func:`install_tracing`); with no
exporter the spans cost little and go nowhere. ``OTEL_TRACES_EXPORTER=console`` (the standard
OpenTelemetry variable) prints them on stdout; a deployment wanting OTLP adds its exporter to the
provider. The interceptor continues the caller's trace when the call carries a ``traceparent``
(W3C trace context), so a forwarded Admin call shows up under the sidecar that forwarded it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
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


def install_tracing(*, broker_id: str, console: bool) -> TracerProvider:
    """Make a provider for this sidecar the process's global one; shut it down when stopping."""
    provider = TracerProvider(
        resource=Resource.create({"service.name": "lbd", "service.instance.id": broker_id})
    )
    if console:
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

    @contextlib.contextmanager
    def _span(self, method: str, context: grpc.aio.ServicerContext) -> Iterator[trace.Span]:
        name = method.lstrip("/")
        service, _, rpc = name.partition("/")
        with self._tracer.start_as_current_span(
            name,
            context=_incoming_context(context.invocation_metadata()),
            kind=trace.SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc},
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield span
            except BaseException:
                _record_status(span, context.code() or grpc.StatusCode.UNKNOWN)
                raise
            _record_status(span, grpc.StatusCode.OK)

    async def unary(self, method: str, context: grpc.aio.ServicerContext, call: Call) -> Any:
        with self._span(method, context):
            return await call()

    async def stream(
        self, method: str, context: grpc.aio.ServicerContext, call: StreamCall
    ) -> AsyncIterator[Any]:
        with self._span(method, context) as span:
            count = 0
            async for response in call():
                count += 1
                yield response
            span.set_attribute("lbd.responses", count)


def _record_status(span: trace.Span, code: grpc.StatusCode) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in _SERVER_FAULTS:
        span.set_status(trace.StatusCode.ERROR, code.name)


class TracingInterceptor(WrappingInterceptor):
    """One SERVER span per call of lbd's services, with its gRPC status code."""

    def __init__(self, provider: trace.TracerProvider | None = None) -> None:
        super().__init__(_Spans(trace.get_tracer(__name__, tracer_provider=provider)))
