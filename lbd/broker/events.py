"""What a broker served, when: one JSON line per event, for the serving checker.

A broker that logs its events with :class:`EventLog` (the simulated broker and the broker front
do) can be judged by :mod:`lbd.devcluster.serving` and the chaos tests: every line is stamped
with ``time.monotonic_ns()``, the same clock for every process on a host, so the logs of several
brokers merge into one timeline.

Events: ``own``, ``release`` and ``close`` (the broker was told to serve ``bundle``, or stopped),
``revoked`` (a Release or Close of an owned ``bundle`` arrived, ``command`` naming which: it stopped
serving the bundle then, before the command's turn to be carried out came), ``session``
(``detail`` ``open`` or ``lost``, ``bundle`` null), ``lease`` (a grant: the lease is valid until
``until_ns``; ``bundle`` null). A broker serves a bundle from its ``own`` until the earliest of
its ``revoked``, ``release`` or ``close`` and the end of its lease. A broker that stores messages
adds ``write`` events (see :class:`RecordingHandler`'s users); readers skip events they do not
know.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO

from lbd.broker.client import BrokerHandler
from lbd.core.ids import BundleId


class EventLog:
    """Appends ``{"t_ns", "event", "bundle", "broker", ...}`` JSON lines to a file. Each line is
    flushed at once so another process reads it as soon as the broker acted."""

    def __init__(self, path: Path, broker_id: str) -> None:
        self._broker_id = broker_id
        self._file: IO[str] = path.open("a", encoding="utf-8")

    def record(
        self, event: str, bundle: str | None, *, t_ns: int | None = None, **detail: object
    ) -> None:
        """Append one event, stamped now (or at ``t_ns`` on the same clock)."""
        line = {
            "t_ns": time.monotonic_ns() if t_ns is None else t_ns,
            "event": event,
            "bundle": bundle,
            "broker": self._broker_id,
            **detail,
        }
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file; idempotent."""
        self._file.close()


class RecordingHandler(BrokerHandler):
    """A :class:`BrokerHandler` whose session and lease hooks are logged as events (when it
    has an :class:`EventLog`); a broker records its own, release and close events with
    :meth:`record`."""

    def __init__(self, events: EventLog | None) -> None:
        self._events = events

    def record(
        self, event: str, bundle: str | None, *, t_ns: int | None = None, **detail: object
    ) -> None:
        """Log one event, if there is a log (stamped now, or at ``t_ns``)."""
        if self._events is not None:
            self._events.record(event, bundle, t_ns=t_ns, **detail)

    def session_opened(self) -> None:
        """Logged as ``session`` ``open``."""
        self.record("session", None, detail="open")

    def session_ended(self) -> None:
        """Logged as ``session`` ``lost``."""
        self.record("session", None, detail="lost")

    def lease_granted(self, valid_until: float) -> None:
        """Logged as ``lease`` with ``until_ns`` on the events' clock."""
        self.record("lease", None, until_ns=str(round(valid_until * 1e9)))

    def revoked(self, bundle: BundleId, command: str) -> None:
        """Logged as ``revoked``, with the ``command`` that arrived."""
        self.record("revoked", str(bundle), command=command)
