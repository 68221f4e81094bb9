"""The clock port: services never read the wall clock themselves, so a simulator can drive them."""

from typing import Protocol


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
