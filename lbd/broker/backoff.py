"""How long a broker-side client waits before it connects to its sidecar again."""

from __future__ import annotations

from lbd.core.errors import InvalidInputError


class Backoff:
    """Capped exponential delays between attempts.

    Only an attempt that got through and then lasted at least the cap resets the delay: a sidecar
    that accepts a stream and drops it at once must not turn into a tight reconnect loop.
    """

    def __init__(self, min_s: float, max_s: float) -> None:
        if not 0 < min_s <= max_s:
            raise InvalidInputError(
                f"reconnect delays must satisfy 0 < min <= max, got min {min_s} s, max {max_s} s"
            )
        self._min_s = min_s
        self._max_s = max_s
        self._delay_s = min_s

    def after(self, *, connected: bool, lasted_s: float) -> float:
        """The delay before the next attempt, after one that ``connected`` (or not) and lasted
        ``lasted_s`` seconds."""
        if connected and lasted_s >= self._max_s:
            self._delay_s = self._min_s
        delay = self._delay_s
        self._delay_s = min(delay * 2, self._max_s)
        return delay
