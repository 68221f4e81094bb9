"""Deadlines on the injected clock, for any awaitable: what the channel services wait with."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

from lbd.core.errors import DeadlineError
from lbd.ports.clock import Clock, TimeoutScope

T = TypeVar("T")


async def within(clock: Clock, seconds: float, awaitable: Awaitable[T], what: str) -> T:
    """``awaitable``'s result if it completes within ``seconds`` of ``clock`` time.

    Raises :class:`DeadlineError` saying ``what`` did not finish in time otherwise; the awaitable
    is cancelled then (and when the caller is). It runs in the caller's task, under the clock's
    timeout scope: no task of its own.
    """
    scope: TimeoutScope | None = None
    try:
        async with clock.timeout(seconds) as scope:
            return await awaitable
    except TimeoutError:
        if scope is None or not scope.expired():
            raise  # the awaitable's own
        raise DeadlineError(f"{what} did not finish within {seconds:g}s") from None
