"""lbd's errors as gRPC status codes with the human message (DESIGN §6).

The services raise :class:`~lbd.core.errors.LbdError` subclasses whose messages are written for
the operator; the interceptor turns them into status codes and passes the message on. Anything
else is a bug: the client gets INTERNAL and a pointer to the log, the log gets the traceback,
and no Python traceback ever reaches the client. A request that does not decode is the client's
error: INVALID_ARGUMENT naming the message type, logged at debug level only.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from lbd.api.handlers import (
    Call,
    CallWrapper,
    StreamCall,
    WrappingInterceptor,
)
from lbd.core.errors import (
    DeadlineError,
    InvalidInputError,
    LbdError,
    NotFoundError,
    PreconditionError,
)
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


async def _abort_for(method: str, context: grpc.aio.ServicerContext, error: Exception) -> None:
    """Abort the call as ``error`` deserves; always raises."""
    if isinstance(error, grpc.aio.AioRpcError):
        # A call this sidecar forwarded failed: pass the other sidecar's answer on as it is.
        _log.debug("%s: forwarded call failed: %s %s", method, error.code().name, error.details())
        await context.abort(error.code(), error.details() or "")
    if isinstance(error, LbdError):
        code = status_of(error)
        if code is grpc.StatusCode.INTERNAL:
            _log.error("%s failed: %s", method, error, exc_info=error)
        else:
            _log.debug("%s: %s: %s", method, code.name, error)
        await context.abort(code, str(error))
    _log.error("%s failed with an unexpected error", method, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


class _ErrorMapping(CallWrapper):
    async def unary(self, method: str, context: grpc.aio.ServicerContext, call: Call) -> Any:
        try:
            return await call()
        except grpc.aio.AbortError:
            raise  # the servicer chose its status itself
        except Exception as e:
            await _abort_for(method, context, e)

    async def stream(
        self, method: str, context: grpc.aio.ServicerContext, call: StreamCall
    ) -> AsyncIterator[Any]:
        try:
            async for response in call():
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _abort_for(method, context, e)


class ErrorInterceptor(WrappingInterceptor):
    """Maps exceptions escaping lbd's servicers to status codes with their message."""

    def __init__(self) -> None:
        super().__init__(_ErrorMapping(), checks_requests=True)
