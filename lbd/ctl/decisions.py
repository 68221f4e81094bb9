"""``lbd ctl decisions``: the leader's recent decisions, and the history's when asked.

The leader keeps only its newest ``operations.keep_decisions``; the history (``[history]``,
Parquet) keeps every decision its sidecars recorded. With ``--history`` both are read and merged,
oldest first: a history row that repeats a decision the leader still holds (same kind, bundle,
brokers and reason, recorded within :data:`SAME_DECISION_MS`) is shown once, as the leader's,
which also knows its source and operation.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Sequence

from lbd.core.errors import InvalidInputError
from lbd.gen.v1 import lbd_pb2
from lbd.history.reader import HistoryDecision

HISTORY_SOURCE = "history"
"""``source`` of a decision read from the history only (the history does not record one)."""
SAME_DECISION_MS = 2000
"""A leader's decision and a history row this close in time, and alike, are one decision: the
two record the same event from clocks of the same host (or of NTP-synchronised hosts)."""

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(s|m|h|d)")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now_ms: int) -> int:
    """``--since``: a duration back from ``now_ms`` (``30s``, ``10m``, ``2h``, ``1d``) or an
    ISO-8601 time (UTC unless it carries an offset), as epoch milliseconds."""
    text = text.strip()
    duration = _DURATION.fullmatch(text)
    if duration is not None:
        amount, unit = duration.groups()
        return now_ms - round(float(amount) * _UNIT_S[unit] * 1000)
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise InvalidInputError(
            f"{text!r} is neither a duration (a number and s, m, h or d, e.g. 10m) nor "
            "an ISO-8601 time (e.g. 2024-05-01T13:00:00Z)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return int(when.timestamp() * 1000)


def from_history(row: HistoryDecision) -> lbd_pb2.Decision:
    """A history row as the leader's decisions are shown (source ``history``)."""
    return lbd_pb2.Decision(
        at_ms=row.ts_ms,
        kind=row.kind,
        bundle=row.bundle,
        src_broker_id=row.src or "",
        dst_broker_id=row.dst or "",
        reason=row.reason,
        source=HISTORY_SOURCE,
    )


def merge(
    leader: Sequence[lbd_pb2.Decision], history: Iterable[HistoryDecision], limit: int = 0
) -> lbd_pb2.ListDecisionsResponse:
    """The leader's decisions and the history's, oldest first, each decision once; the newest
    ``limit`` (0: all)."""
    by_key: dict[tuple[str, str, str, str, str], list[int]] = {}
    for d in leader:
        by_key.setdefault(_key(d), []).append(d.at_ms)
    merged = list(leader)
    for row in history:
        d = from_history(row)
        if not any(abs(at - d.at_ms) <= SAME_DECISION_MS for at in by_key.get(_key(d), ())):
            merged.append(d)
    merged.sort(key=lambda d: d.at_ms)  # stable: the leader's order among equal times
    if limit > 0:
        merged = merged[-limit:]
    return lbd_pb2.ListDecisionsResponse(decisions=merged)


def _key(d: lbd_pb2.Decision) -> tuple[str, str, str, str, str]:
    return (d.kind, d.bundle, d.src_broker_id, d.dst_broker_id, d.reason)
