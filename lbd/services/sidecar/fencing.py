"""Self-fencing (DESIGN §8): a sidecar that cannot renew its lease gives up its bundles first.

The lease outlives its last successful renewal by at most its TTL, and the leader cleans up a
vanished broker's bundles only after a grace period longer than that. So when
``now - last_renewed >= fence_after_s`` (shorter than the grace by a safety margin) the sidecar
tells its broker to close every bundle and stops answering lookups with itself as owner, before
anyone else may take those bundles. On the next successful renewal it unfences; the ownership
reactor then re-owns what the table still says is this broker's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

from lbd.ports.clock import Clock
from lbd.ports.metadata import MetadataStore
from lbd.services.sidecar.broker_link import BrokerLink
from lbd.tasks import cancel_and_wait, guard

_log = logging.getLogger(__name__)


class Fence:
    """Watches the lease's last renewal and fences or unfences the broker link."""

    def __init__(
        self,
        metadata: MetadataStore,
        link: BrokerLink,
        clock: Clock,
        *,
        fence_after_s: float,
        check_interval_s: float,
    ) -> None:
        if fence_after_s <= 0 or check_interval_s <= 0:
            raise ValueError(
                f"fence_after_s and check_interval_s must be > 0, got {fence_after_s} and "
                f"{check_interval_s}"
            )
        self._metadata = metadata
        self._link = link
        self._clock = clock
        self._fence_after_s = fence_after_s
        self._check_interval_s = check_interval_s
        self._fenced = False
        self._task: asyncio.Task[None] | None = None
        self._subscribers: set[asyncio.Queue[bool]] = set()
        self.fencings = 0
        """How many times this sidecar fenced itself."""

    @property
    def fenced(self) -> bool:
        """Whether the sidecar is fenced: its broker serves nothing, lookups never name it."""
        return self._fenced

    async def start(self) -> None:
        """Start checking every ``check_interval_s``."""
        if self._task is None:
            self._task = guard(self._run(), name="fence")

    async def close(self) -> None:
        """Stop checking. Idempotent."""
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def __aenter__(self) -> Fence:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def states(self) -> AsyncGenerator[bool, None]:
        """Each change of :attr:`fenced` from the moment of this call on (True: fenced)."""
        queue: asyncio.Queue[bool] = asyncio.Queue()
        self._subscribers.add(queue)
        return self._drain(queue)

    async def _drain(self, queue: asyncio.Queue[bool]) -> AsyncGenerator[bool, None]:
        try:
            while True:
                yield await queue.get()
        finally:
            self._subscribers.discard(queue)

    def vouches(self) -> bool:
        """Whether the sidecar may still vouch for its broker's ownership (grant its serving
        lease): not fenced, and the lease renewed less than ``fence_after_s`` ago, read now
        rather than at the last check."""
        return not self._fenced and self._stale_s() < self._fence_after_s

    def _stale_s(self) -> float:
        return self._clock.monotonic() - self._metadata.last_renewed_monotonic

    async def check(self) -> bool:
        """Compare the last renewal with the deadline now, fence or unfence; the new state."""
        stale_s = self._stale_s()
        if stale_s >= self._fence_after_s and not self._fenced:
            self._set(True)
            self.fencings += 1
            reason = (
                f"lease not renewed for {stale_s:.1f}s >= fence_after_s {self._fence_after_s:g}"
            )
            _log.error("fencing broker %s: %s; closing every bundle", self._link.me, reason)
            await self._link.fence(f"self-fencing: {reason}")
        elif stale_s < self._fence_after_s and self._fenced:
            _log.warning("unfencing broker %s: the lease was renewed", self._link.me)
            self._link.unfence()
            self._set(False)
        return self._fenced

    def _set(self, fenced: bool) -> None:
        self._fenced = fenced
        for queue in self._subscribers:
            queue.put_nowait(fenced)

    async def _run(self) -> None:
        while True:
            await self.check()
            await self._clock.sleep(self._check_interval_s)
