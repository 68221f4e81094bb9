"""The admin token: Admin calls need ``authorization: Bearer <token>`` when one is configured.

LoadBalancer calls are never gated: the broker beside the sidecar must always be able to look up
and hold its session. A missing or malformed header is UNAUTHENTICATED (the caller did not say
who it is); a wrong token is PERMISSION_DENIED (it did, and may not).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import grpc

from lbd.api.handlers import Call, CallWrapper, StreamCall, WrappingInterceptor

_log = logging.getLogger(__name__)

ADMIN_METHOD_PREFIX = "/lbd.v1.Admin/"
AUTHORIZATION = "authorization"
BEARER = "bearer "


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying ``token`` (for clients: ``lbd ctl``, forwarding sidecars)."""
    return ((AUTHORIZATION, f"Bearer {token}"),)


def check_token(metadata: Sequence[tuple[str, Any]] | None, token: str) -> tuple[Any, str] | None:
    """None when ``metadata`` carries ``token``, else the status code and message to refuse with."""
    values = [v for k, v in metadata or () if k.lower() == AUTHORIZATION]
    if not values:
        return (
            grpc.StatusCode.UNAUTHENTICATED,
            "admin calls need the metadata 'authorization: Bearer <token>' "
            "(the sidecar has grpc.admin_token set)",
        )
    value = values[0] if isinstance(values[0], str) else bytes(values[0]).decode(errors="replace")
    if not value.lower().startswith(BEARER) or not value[len(BEARER) :].strip():
        return (
            grpc.StatusCode.UNAUTHENTICATED,
            "the authorization metadata must read 'Bearer <token>'",
        )
    given = value[len(BEARER) :].strip()
    if not hmac.compare_digest(given.encode(), token.encode()):
        return grpc.StatusCode.PERMISSION_DENIED, "the admin token is not valid"
    return None


class _Refusal(CallWrapper):
    """Ends the call with a status code before the servicer runs."""

    def __init__(self, code: Any, message: str) -> None:
        self._code = code
        self._message = message

    async def unary(self, method: str, context: grpc.aio.ServicerContext, call: Call) -> Any:
        await context.abort(self._code, self._message)

    async def stream(
        self, method: str, context: grpc.aio.ServicerContext, call: StreamCall
    ) -> AsyncGenerator[Any, None]:
        await context.abort(self._code, self._message)
        yield  # never reached: abort raises; this makes the method an async generator


class AdminAuthInterceptor(WrappingInterceptor):
    """Refuses Admin calls that do not carry the admin token; lets every other call through."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the admin token must not be empty")
        super().__init__()
        self._token = token

    def wrapper_for(self, details: grpc.HandlerCallDetails) -> CallWrapper | None:
        """A refusal for an Admin call without the right token; None for any other call."""
        method: str = details.method
        if not method.startswith(ADMIN_METHOD_PREFIX):
            return None
        refusal = check_token(details.invocation_metadata, self._token)
        if refusal is None:
            return None
        code, message = refusal
        _log.info("refused %s: %s", method, message)
        return _Refusal(code, message)
