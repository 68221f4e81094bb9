"""lbd's errors as gRPC status codes with the human message (DESIGN §6).

The services raise :class:`~lbd.core.errors.LbdError` subclasses whose messages are written for
the operator; the interceptor turns them into status codes and passes the message on. Anything
else is a bug: the client gets INTERNAL and a pointer to the log, the log gets the traceback,
and no Python traceback ever reaches the client.

What a client does wrong is its own business, never the log's: a request that does not decode
(INVALID_ARGUMENT naming the message type), any other invalid argument, and a call the client
cancels are logged at debug level only and counted in ``lbd_grpc_client_errors_total``, so that a
client cancelling a thousand streams at once shows as a number, not a thousand tracebacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Any

import grpc

from lbd.api.handlers import (
    Call,
    CallWrapper,
    StreamCall,
    UndecodableRequestError,
    WrappingInterceptor,
)
from lbd.core.errors import (
    DeadlineError,
    InvalidInputError,
    LbdError,
    NotFoundError,
    PreconditionError,
)
from lbd.metrics import CANCELLED, INVALID_ARGUMENT, UNDECODABLE, Metrics
from lbd.ports.errors import UnavailableError

_log = logging.getLogger(__name__)

_CODES: tuple[tuple[type[LbdError], grpc.StatusCode], ...] = (
    (InvalidInputError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),  # CasConflictError too
    (DeadlineError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
)

INTERNAL_MESSAGE = "internal error in the lbd sidecar; its log has the details"


def status_of(error: LbdError) -> grpc.StatusCode:
    """The status code of an lbd error (INTERNAL for an LbdError of no listed kind)."""
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


class _ErrorMapping(CallWrapper):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self.stopping = False  # set once, when the server starts to stop

    async def unary(self, method: str, context: grpc.aio.ServicerContext, call: Call) -> Any:
        try:
            return await call()
        except grpc.aio.AbortError:
            raise  # the servicer chose its status itself
        except asyncio.CancelledError:
            self._cancelled(method, context)
            raise
        except Exception as e:
            await self._abort_for(method, context, e)

    async def stream(
        self, method: str, context: grpc.aio.ServicerContext, call: StreamCall
    ) -> AsyncGenerator[Any, None]:
        try:
            async with contextlib.aclosing(call()) as responses:
                async for response in responses:
                    yield response
        except grpc.aio.AbortError:
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # GeneratorExit: grpc dropped the stream at a yield, its call cancelled mid-send.
            self._cancelled(method, context)
            raise
        except Exception as e:
            await self._abort_for(method, context, e)

    def _cancelled(self, method: str, context: grpc.aio.ServicerContext) -> None:
        if self.stopping:
            return  # the server cancels its calls: nothing the client did
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            _log.debug("%s: the client's deadline passed", method)
            return
        _log.debug("%s: cancelled by the client", method)
        self._count(method, CANCELLED)

    def _count(self, method: str, kind: str) -> None:
        self._metrics.grpc_client_errors.labels(method=method.lstrip("/"), kind=kind).inc()

    async def _abort_for(
        self, method: str, context: grpc.aio.ServicerContext, error: Exception
    ) -> None:
        """Abort the call as ``error`` deserves; always raises."""
        code, message = failure_of(method, error)
        if isinstance(error, UndecodableRequestError):
            self._count(method, UNDECODABLE)
        elif isinstance(error, LbdError) and code is grpc.StatusCode.INVALID_ARGUMENT:
            self._count(method, INVALID_ARGUMENT)
        await context.abort(code, message)


def failure_of(method: str, error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and message a call of ``method`` that failed with ``error`` ends with,
    logged as it deserves: a bug with its traceback (the client gets INTERNAL and a pointer to
    the log), anything else at debug level."""
    if isinstance(error, grpc.aio.AioRpcError):
        # A call this sidecar forwarded failed: pass the other sidecar's answer on as it is.
        _log.debug("%s: forwarded call failed: %s %s", method, error.code().name, error.details())
        return error.code(), error.details() or ""
    if isinstance(error, LbdError):
        code = status_of(error)
        if code is grpc.StatusCode.INTERNAL:
            _log.error("%s failed: %s", method, error, exc_info=error)
        else:
            _log.debug("%s: %s: %s", method, code.name, error)
        return code, str(error)
    _log.error("%s failed with an unexpected error", method, exc_info=error)
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE


class ErrorInterceptor(WrappingInterceptor):
    """Maps exceptions escaping lbd's servicers to status codes with their message, and counts
    the calls that failed by the client's doing in ``metrics``."""

    def __init__(self, metrics: Metrics) -> None:
        self._mapping = _ErrorMapping(metrics)
        super().__init__(self._mapping, checks_requests=True)

    def stopping(self) -> None:
        """From now on calls are cancelled by the server stopping, not by their clients."""
        self._mapping.stopping = True
