"""Wrapping gRPC method handlers: the one mechanism behind the error, auth and tracing layers.

A grpc.aio interceptor sees a handler, not the call; to act around the call it returns a new
handler whose behaviour wraps the old one. :class:`CallWrapper` says what to do around a call
that returns one response and around one that streams them; :func:`wrap_handler` builds the new
handler for any of the four RPC shapes.

A streaming call that the client cancels while grpc sends a response leaves its generators
suspended at a ``yield``: grpc drops them and the event loop closes them later, in a task of its
own. Each layer therefore closes the stream it wraps when it is closed itself (the whole chain in
that one task) and holds nothing across a ``yield`` that must be released in the task that took
it, such as a current tracing context.
"""

from __future__ import annotations

import abc
import contextlib
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from lbd.core.errors import InvalidInputError

Call = Callable[[], Awaitable[Any]]
"""Runs the wrapped unary-response behaviour and returns its response."""
StreamCall = Callable[[], AsyncGenerator[Any, None]]
"""Runs the wrapped streaming-response behaviour and iterates its responses."""

LBD_SERVICE_PREFIX = "/lbd.v1."
"""Method names of lbd's own services start with this (health and reflection do not)."""


def is_lbd_method(method: str) -> bool:
    """Whether ``method`` (``/package.Service/Method``) belongs to lbd's own services."""
    return method.startswith(LBD_SERVICE_PREFIX)


class CallWrapper(abc.ABC):
    """What an interceptor does around one call of ``method``."""

    @abc.abstractmethod
    async def unary(self, method: str, context: grpc.aio.ServicerContext, call: Call) -> Any:
        """Around a call answering with one response; return that response."""

    @abc.abstractmethod
    def stream(
        self, method: str, context: grpc.aio.ServicerContext, call: StreamCall
    ) -> AsyncGenerator[Any, None]:
        """Around a call streaming its responses; yield them."""


class WrappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """An interceptor passing the calls it picks through a :class:`CallWrapper`.

    By default every call of lbd's own services goes through the one wrapper given (health and
    reflection are left alone); a subclass picks per call by overriding :meth:`wrapper_for`.

    As a grpc.aio interceptor it costs a coroutine and a new handler on every call; lbd's server
    instead applies the same layers once, when it registers its servicers
    (:class:`WrappedRegistration`), and keeps the interceptor form for servers it does not build.
    """

    def __init__(
        self, wrapper: CallWrapper | None = None, *, checks_requests: bool = False
    ) -> None:
        """With ``checks_requests``, a request that does not decode reaches the wrapper as an
        :class:`UndecodableRequestError` raised by the call (see :func:`wrap_handler`)."""
        self._wrapper = wrapper
        self.checks_requests = checks_requests

    def wrapper_for(self, details: grpc.HandlerCallDetails | MethodDetails) -> CallWrapper | None:
        """The wrapper for this call, or None to leave it as it is."""
        return self._wrapper if is_lbd_method(details.method) else None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """The call's handler, wrapped when :meth:`wrapper_for` says so."""
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        wrapper = self.wrapper_for(handler_call_details)
        if wrapper is None:
            return handler
        return wrap_handler(
            handler,
            handler_call_details.method,
            wrapper,
            checks_requests=self.checks_requests,
        )


class BoundCall:
    """A :data:`Call` of a unary-request method; ``request`` is its request (for audit lines)."""

    __slots__ = ("_context", "_inner", "request")

    def __init__(self, inner: Callable[..., Any], request: Any, context: Any) -> None:
        self._inner = inner
        self.request = request
        self._context = context

    def __call__(self) -> Awaitable[Any]:
        result: Awaitable[Any] = self._inner(self.request, self._context)
        return result


class BoundStreamCall:
    """A :data:`StreamCall` of a unary-request method; ``request`` is its request (a layer
    forwarding the call sends it on)."""

    __slots__ = ("_context", "_inner", "request")

    def __init__(self, inner: Callable[..., Any], request: Any, context: Any) -> None:
        self._inner = inner
        self.request = request
        self._context = context

    def __call__(self) -> AsyncGenerator[Any, None]:
        return _responses(self._inner(self.request, self._context))


class UndecodableRequestError(InvalidInputError):
    """The request's bytes are not a message of the method's type: the client's mistake."""


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A request message that did not decode, in place of the message."""

    error: UndecodableRequestError


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    method: str,
    wrapper: CallWrapper,
    *,
    checks_requests: bool = False,
) -> grpc.RpcMethodHandler:
    """``handler`` with each call passed through ``wrapper``.

    With ``checks_requests`` the request deserializer no longer fails the call on bytes that are
    not a message of the method's type (grpc would answer UNKNOWN with a Python class name): the
    call itself raises :class:`UndecodableRequestError` saying so, inside ``wrapper``; a streaming
    request raises it when the bad message is read.
    """
    deserialize = handler.request_deserializer
    if checks_requests and deserialize is not None:
        deserialize = _lenient(deserialize)
    if handler.request_streaming and handler.response_streaming:
        inner, make = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        inner, make = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        inner, make = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        inner, make = handler.unary_unary, grpc.unary_unary_rpc_method_handler

    if checks_requests:
        inner = _checked(inner, streaming_requests=handler.request_streaming)
    if handler.response_streaming:
        # grpc.aio tells streaming behaviours by their being async generator functions.
        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            call = wrapper.stream(method, context, BoundStreamCall(inner, request, context))
            async with contextlib.aclosing(call):
                async for response in call:
                    yield response

        behaviour: Callable[..., Any] = streaming
    else:

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await wrapper.unary(method, context, BoundCall(inner, request, context))

        behaviour = unary
    return make(
        behaviour,
        request_deserializer=deserialize,
        response_serializer=handler.response_serializer,
    )


def _lenient(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``deserialize``, answering :class:`Undecodable` instead of raising."""

    def decode(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as e:
            name = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
            what = name.full_name if name is not None else "message"
            return Undecodable(UndecodableRequestError(f"the request is not a valid {what}: {e}"))

    return decode


def _checked(inner: Callable[..., Any], *, streaming_requests: bool) -> Callable[..., Any]:
    """``inner``, raising the error of an :class:`Undecodable` request instead of calling it
    with one (a streaming request: when the bad message is read)."""
    if streaming_requests:

        def streaming(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            return inner(_decoded(requests), context)

        return streaming

    def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            raise request.error
        return inner(request, context)

    return unary


async def _decoded(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Undecodable):
            raise request.error
        yield request


async def _responses(result: Any) -> AsyncGenerator[Any, None]:
    """The responses of a streaming behaviour, whether it is an async generator or a coroutine
    that writes them with ``context.write`` (then there is nothing to yield)."""
    if inspect.isawaitable(result):
        await result
        return
    async with contextlib.aclosing(result):
        async for response in result:
            yield response


class GenericRegistration:
    """Stands in for a grpc.aio server while a generated ``add_*Servicer_to_server`` registers a
    servicer: its handlers are registered as generic handlers only, never as registered methods.

    grpc.aio's server keeps one pending request per registered method, and one for all generic
    handlers, and awaits ``asyncio.wait`` over all of them for every call it takes. With the 31
    methods of the sidecar's four services that was some 240 Python calls per RPC, a tenth of an
    owned Lookup's CPU in the server (docs/performance.md, "One pending request, not 32"). With
    generic handlers only it waits on one. Each generic handler finds its method in a dict; they
    are asked in the order the services were added.
    """

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        """Register ``handlers`` with the real server."""
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        """Ignored: the same handlers arrive by :meth:`add_generic_rpc_handlers`."""


class WrappedRegistration(GenericRegistration):
    """A :class:`GenericRegistration` that wraps every method handler once, through ``layers``
    (outermost first). Per call this costs the layers' own coroutines only, where interceptors
    would also run their chain and build a new handler for every call."""

    def __init__(self, server: grpc.aio.Server, layers: list[WrappingInterceptor]) -> None:
        super().__init__(server)
        self._layers = layers

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        """Ignored: the same handlers arrive, by method, by
        :meth:`add_registered_method_handlers`."""

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        """Wrap each handler in every layer that picks its method, and register the result as
        a generic handler."""
        wrapped = {name: self._wrap(f"/{service}/{name}", h) for name, h in handlers.items()}
        super().add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wrapped),))

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        details = MethodDetails(method)
        for layer in reversed(self._layers):  # the innermost layer first
            wrapper = layer.wrapper_for(details)
            if wrapper is not None:
                handler = wrap_handler(
                    handler, method, wrapper, checks_requests=layer.checks_requests
                )
        return handler


@dataclass(frozen=True, slots=True)
class MethodDetails:
    """What :meth:`WrappingInterceptor.wrapper_for` reads of a call: its method."""

    method: str
