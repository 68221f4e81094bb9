"""Balance metrics shared by the analytics report, its replay and the balancing scenario suite:
episodes over target and ping-pong.

- An **episode** starts at the first point where the cluster's load std is over the target (at the
  start of the history, or after a point at or under it) and ends at the first later point back
  at or under target; its duration is the time back under target. An episode still open at the
  end has no end.
- A **ping-pong** is a bundle arriving at a broker it left less than a window ago.

:mod:`lbd.analytics.report` computes both with Spark over a history; this module computes them
in plain Python over one simulated run (``lbd analytics replay``, ``lbd bench balance``), with the
same definitions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Episode:
    """A stretch of time with the cluster's std over target."""

    start_ms: int
    end_ms: int | None
    """The first point back under target; None when the history ends over target."""
    peak_std: float

    @property
    def seconds(self) -> float | None:
        """Time back under target, None when it never got there."""
        return None if self.end_ms is None else (self.end_ms - self.start_ms) / 1000


def episodes(series: Sequence[tuple[int, float]], target_std: float) -> list[Episode]:
    """The episodes over ``target_std`` of a ``(ts_ms, std)`` series sorted by time."""
    out: list[Episode] = []
    start: int | None = None
    peak = 0.0
    for ts, std in series:
        if std > target_std:
            if start is None:
                start, peak = ts, std
            peak = max(peak, std)
        elif start is not None:
            out.append(Episode(start, ts, peak))
            start = None
    if start is not None:
        out.append(Episode(start, None, peak))
    return out


def ping_pongs(moves: Iterable[tuple[int, str, str | None, str | None]], window_ms: int) -> int:
    """Count arrivals of a bundle at a broker it left ``window_ms`` before or less.

    ``moves`` are ``(ts_ms, bundle, src, dst)`` in time order; ``src`` is None for an
    assignment, ``dst`` None for a plain unload (its assignment is a move of its own)."""
    left: dict[tuple[str, str], int] = {}
    count = 0
    for ts, bundle, src, dst in moves:
        if dst is not None:
            at = left.get((bundle, dst))
            if at is not None and ts - at <= window_ms:
                count += 1
        if src is not None:
            left[(bundle, src)] = ts
    return count
