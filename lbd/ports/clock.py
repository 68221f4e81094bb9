"""The clock port: services never read the wall clock themselves, so a simulator can drive them."""

from contextlib import AbstractAsyncContextManager
from typing import Protocol


class TimeoutScope(Protocol):
    """What a :meth:`Clock.timeout` scope gives its body (``asyncio.Timeout`` is one)."""

    def expired(self) -> bool:
        """Whether the scope's time ran out."""
        ...


class Clock(Protocol):
    """Milliseconds and monotonic time, and sleeping, under one controllable source."""

    def now_ms(self) -> int:
        """Wall-clock milliseconds since the epoch (what is written into channel values)."""
        ...

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin that never goes backwards (timeouts, deadlines)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of this clock's time."""
        ...

    def timeout(self, seconds: float) -> AbstractAsyncContextManager[TimeoutScope]:
        """A scope whose body is cancelled once ``seconds`` of this clock's time have passed;
        it then raises :class:`TimeoutError` (``asyncio.timeout`` on this clock)."""
        ...
