"""Lookups a broker makes one topic at a time, sent to the sidecar many at a time.

A broker that has thousands of clients reconnecting (after a restart, after its neighbour
failed) looks up thousands of topics at once, each from the code serving one client. As unary
``Lookup`` calls they cost the sidecar a gRPC call each, and that is what limits it: on a
2-core machine a sidecar assigns some 600-800 new bundles per second by single Lookups and
2,500-3,000 by ``LookupMany`` (docs/performance.md, "The figures of `make bench`").
:class:`LookupBatcher` gives the broker's code a per-topic call that travels in bulk:

- the lookups asked for in one turn of the event loop go together in one ``LookupMany`` (at most
  ``max_per_call``); there is no timer, so a lone lookup leaves at once, in a call of one;
- at most ``calls_in_flight`` calls are out at a time; lookups asked for meanwhile wait for a call
  to come back and then leave together;
- each caller gets its own answer, or :class:`LookupFailedError` with the status code and message
  its own unary Lookup would have failed with. A call that fails as a whole (the sidecar is
  unreachable, the deadline passed) fails each of its lookups with that call's status.

The sidecar answers each lookup of a ``LookupMany`` exactly as it answers a ``Lookup``: the
batching changes how many calls there are, not any answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final

import grpc

from lbd.core.errors import InvalidInputError, LbdError
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc

MAX_PER_CALL: Final = 256
"""Lookups in one ``LookupMany`` by default (the sidecar takes up to 4,096)."""
CALLS_IN_FLIGHT: Final = 4
"""``LookupMany`` calls out at a time by default."""
TIMEOUT_S: Final = 30.0
"""The deadline of each ``LookupMany`` call by default."""

_Pending = tuple[lbd_pb2.LookupRequest, "asyncio.Future[lbd_pb2.LookupResponse]"]


class LookupFailedError(LbdError):
    """A lookup failed; ``code`` is the gRPC status code its own Lookup would have ended with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.details = message


class LookupBatcher:
    """Per-topic lookups carried by ``LookupMany`` calls (the module docstring).

    Use it from one event loop; :meth:`close` (or ``async with``) cancels the lookups still
    waiting and the calls still out."""

    def __init__(
        self,
        stub: lbd_pb2_grpc.LoadBalancerStub,
        *,
        max_per_call: int = MAX_PER_CALL,
        calls_in_flight: int = CALLS_IN_FLIGHT,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        if max_per_call < 1:
            raise InvalidInputError(f"max_per_call must be at least 1, got {max_per_call}")
        if calls_in_flight < 1:
            raise InvalidInputError(f"calls_in_flight must be at least 1, got {calls_in_flight}")
        if timeout_s <= 0:
            raise InvalidInputError(f"timeout_s must be positive, got {timeout_s}")
        self._stub = stub
        self._max_per_call = max_per_call
        self._calls_in_flight = calls_in_flight
        self._timeout_s = timeout_s
        self._pending: list[_Pending] = []
        self._calls: set[asyncio.Task[None]] = set()
        self._flush_scheduled = False
        self._closed = False
        self.calls_made = 0
        """``LookupMany`` calls sent so far."""

    async def lookup(self, topic: str, *, read_only: bool = False) -> lbd_pb2.LookupResponse:
        """The sidecar's answer for ``topic``, as ``Lookup`` would give it; raises
        :class:`LookupFailedError` where ``Lookup`` would have failed."""
        if self._closed:
            raise RuntimeError("the LookupBatcher is closed")
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[lbd_pb2.LookupResponse] = loop.create_future()
        self._pending.append((lbd_pb2.LookupRequest(topic=topic, read_only=read_only), answer))
        if not self._flush_scheduled:
            # At the end of this turn: every lookup asked for in it goes in the same call.
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return await answer

    def _flush(self) -> None:
        """Send what waits, in calls of at most ``max_per_call``, while a call may go out."""
        self._flush_scheduled = False
        while self._pending and len(self._calls) < self._calls_in_flight:
            batch = self._pending[: self._max_per_call]
            del self._pending[: self._max_per_call]
            batch = [(request, answer) for request, answer in batch if not answer.done()]
            if not batch:
                continue
            call = asyncio.ensure_future(self._call(batch))
            self._calls.add(call)
            call.add_done_callback(self._call_done)

    def _call_done(self, call: asyncio.Task[None]) -> None:
        self._calls.discard(call)
        if not call.cancelled():
            call.exception()  # _call settles every answer itself; nothing is left to raise
        if not self._closed:
            self._flush()

    async def _call(self, batch: list[_Pending]) -> None:
        self.calls_made += 1
        request = lbd_pb2.LookupManyRequest(lookups=[r for r, _ in batch])
        try:
            response = await self._stub.LookupMany(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as e:
            _fail(batch, LookupFailedError(e.code(), e.details() or ""))
            return
        except Exception as e:  # not a status: the channel is closed, say; each caller sees it
            _fail(batch, e)
            return
        except BaseException:
            for _, answer in batch:
                answer.cancel()
            raise
        if len(response.results) != len(batch):
            count = f"the sidecar answered {len(response.results)} lookups of {len(batch)}"
            _fail(batch, LookupFailedError(grpc.StatusCode.INTERNAL, count))
            return
        for (_, answer), result in zip(batch, response.results, strict=True):
            if answer.done():
                continue  # its caller gave up
            if result.HasField("answer"):
                answer.set_result(result.answer)
            else:
                code = status_code_of(result.failure.code)
                answer.set_exception(LookupFailedError(code, result.failure.message))

    async def close(self) -> None:
        """Cancel the lookups still waiting and the calls still out. Idempotent."""
        self._closed = True
        pending, self._pending = self._pending, []
        for _, answer in pending:
            answer.cancel()
        calls = list(self._calls)
        for call in calls:
            call.cancel()
        for call in calls:
            with contextlib.suppress(asyncio.CancelledError):
                await call

    async def __aenter__(self) -> LookupBatcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _fail(batch: list[_Pending], error: Exception) -> None:
    """Every lookup of ``batch`` whose caller still waits fails with ``error``."""
    for _, answer in batch:
        if not answer.done():
            answer.set_exception(error)


def status_code_of(value: int) -> grpc.StatusCode:
    """The gRPC status code numbered ``value`` (a ``LookupFailure``'s code); UNKNOWN for a
    number that names none."""
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN
