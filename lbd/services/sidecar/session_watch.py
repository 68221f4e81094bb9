"""The session watcher: carries out ``etcd.session_expired_policy`` for the whole sidecar.

The metadata session (:mod:`lbd.adapters.session`) replaces a lost lease by itself and
re-registers under the new one: with ``reconnect`` it keeps trying for as long as it takes, and
the watcher has nothing to do. With ``shutdown`` the session gives up after
``etcd.reconnect_retries`` failed attempts and ends every subscription with
:class:`~lbd.ports.errors.SessionExpiredError`; the watcher then hands that to ``on_expired``,
which stops the daemon with one clear line and a non-zero exit code. Every other part that follows
the session (registry, election) only has to stop trusting it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from lbd.ports.errors import SessionExpiredError
from lbd.ports.metadata import MetadataStore, SessionEvent
from lbd.tasks import Component, Tasks


class SessionWatcher(Component):
    """Follows the metadata session; calls ``on_expired`` when it ends for good."""

    def __init__(
        self, metadata: MetadataStore, *, on_expired: Callable[[SessionExpiredError], None]
    ) -> None:
        self._metadata = metadata
        self._on_expired = on_expired
        self._tasks = Tasks("the session watcher")

    async def start(self) -> None:
        """Subscribe to the session's events now; returns at once."""
        if not self._tasks:
            events = self._metadata.session_events()
            self._tasks.spawn(self._watch(events), name="session-watcher")

    async def close(self) -> None:
        """Stop watching. Idempotent."""
        await self._tasks.close()

    async def _watch(self, events: AsyncIterator[SessionEvent]) -> None:
        try:
            async for _ in events:
                pass  # the session logs each event itself; only its end matters here
        except SessionExpiredError as e:
            self._on_expired(e)
