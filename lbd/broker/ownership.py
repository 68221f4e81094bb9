"""Who owns which bundle, answered from memory: a cache fed by the sidecar's ``WatchOwnership``.

A broker answers its own topic lookups with :meth:`OwnershipCache.owner` instead of a round trip
to the sidecar. The stream starts with the current value of every bundle and a
``snapshot_done`` message, then sends every change in channel order. The cache builds a new table
from those first values and swaps it in at ``snapshot_done``: that is how a reconnect drops
bundles whose value was removed while the cache was away, which no change would ever name.

While it is disconnected the cache answers from what it had for ``stale_after_s``; after that,
and before its first snapshot, it raises :class:`StaleOwnershipError` (the broker then asks the
sidecar, or refuses the lookup). A sidecar that keeps the stream open but sends nothing is not
noticed: the stream has no heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from lbd.broker.backoff import Backoff
from lbd.broker.client import check_address
from lbd.broker.credentials import INSECURE, ClientCredentials
from lbd.core.errors import InvalidInputError, LbdError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.names import NamespaceName
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc

_log = logging.getLogger(__name__)


class StaleOwnershipError(LbdError):
    """The cache cannot vouch for its answers: not synced yet, or disconnected too long."""


@dataclass(frozen=True, slots=True)
class Ownership:
    """One bundle's value as the sidecar last sent it."""

    bundle: BundleId
    state: lbd_pb2.BundleState
    owner: BrokerId | None
    """The broker of the state (the destination of a move in flight); None when none."""
    source: BrokerId | None
    version_id: int

    @property
    def owned(self) -> bool:
        """Whether the bundle is settled on :attr:`owner` (not moving, not free, not split)."""
        return self.state == lbd_pb2.BUNDLE_STATE_OWNED and self.owner is not None


class OwnershipCache:
    """A local copy of the bundle table of one namespace (or all), kept by ``WatchOwnership``.

    Run it with ``async with OwnershipCache(...)`` (or :meth:`start` and :meth:`close`), or await
    :meth:`run` in a task of the broker's own; :meth:`wait_synced` waits for the first snapshot.
    """

    def __init__(
        self,
        sidecar: str,
        *,
        namespace: str = "",
        stale_after_s: float = 5.0,
        reconnect_min_s: float = 0.1,
        reconnect_max_s: float = 2.0,
        credentials: ClientCredentials = INSECURE,
    ) -> None:
        check_address(sidecar)
        if stale_after_s <= 0:
            raise InvalidInputError(f"stale bound must be > 0 seconds, got {stale_after_s}")
        Backoff(reconnect_min_s, reconnect_max_s)  # checks the delays now
        self._sidecar = sidecar
        self._namespace = str(NamespaceName.parse(namespace)) if namespace else ""
        self._stale_after_s = stale_after_s
        self._reconnect = (reconnect_min_s, reconnect_max_s)
        self._credentials = credentials
        self._table: dict[BundleId, Ownership] = {}
        self._live = False
        self._lost_at: float | None = None
        self._syncs = 0
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def syncs(self) -> int:
        """How many snapshots were taken in so far (1 + the reconnects that got through)."""
        return self._syncs

    @property
    def live(self) -> bool:
        """Whether the stream is open and past its snapshot."""
        return self._live

    def fresh(self) -> bool:
        """Whether answers are given now (synced, and not disconnected for too long)."""
        return self._staleness() is None

    def get(self, bundle: str) -> Ownership | None:
        """The last value of ``bundle``; None when it has none. StaleOwnershipError when the
        cache cannot answer."""
        if (why := self._staleness()) is not None:
            raise StaleOwnershipError(why)
        return self._table.get(BundleId(bundle))

    def owner(self, bundle: str) -> BrokerId | None:
        """The broker that owns ``bundle``; None when it has no owner or is moving.
        StaleOwnershipError when the cache cannot answer."""
        value = self.get(bundle)
        return value.owner if value is not None and value.owned else None

    async def wait_synced(self) -> None:
        """Wait until the first snapshot was taken in."""
        await self._synced.wait()

    def _staleness(self) -> str | None:
        if self._syncs == 0:
            return f"ownership from sidecar {self._sidecar} not synced yet"
        if self._live or self._lost_at is None:
            return None
        away = time.monotonic() - self._lost_at
        if away <= self._stale_after_s:
            return None
        return (
            f"ownership from sidecar {self._sidecar} is stale: disconnected for {away:.1f} s "
            f"(bound {self._stale_after_s} s)"
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Run the cache in a task of its own; idempotent."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self.run(), name=f"ownership-cache-{self._sidecar}"
            )

    async def close(self) -> None:
        """Stop following the sidecar (answers go stale after the bound); idempotent."""
        task = self._task
        if task is None:
            return
        if not task.done():
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            # Its own cancellation ends here; one of the caller's goes on.
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise

    async def __aenter__(self) -> OwnershipCache:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def run(self) -> None:
        """Follow the sidecar's ownership stream, reconnecting whenever it drops, until
        cancelled."""
        backoff = Backoff(*self._reconnect)
        while True:
            # A channel per watch: a renewed certificate or token is read at each reconnect.
            async with self._credentials.aio_channel(self._sidecar) as channel:
                stub = lbd_pb2_grpc.LoadBalancerStub(channel)
                started = time.monotonic()
                synced = await self._watch(stub)
                lasted = time.monotonic() - started
            await asyncio.sleep(backoff.after(connected=synced, lasted_s=lasted))

    async def _watch(self, stub: lbd_pb2_grpc.LoadBalancerStub) -> bool:
        """One stream, until it ends; True when its snapshot was taken in."""
        call = stub.WatchOwnership(
            lbd_pb2.WatchOwnershipRequest(namespace=self._namespace),
            metadata=self._credentials.metadata(),
        )
        snapshot: dict[BundleId, Ownership] = {}
        try:
            async for change in call:
                if self._live:
                    _apply(self._table, change)
                elif change.snapshot_done:
                    self._take(snapshot)
                else:
                    _apply(snapshot, change)
            _log.warning("sidecar %s ended the ownership stream", self._sidecar)
        except grpc.aio.AioRpcError as e:
            level = logging.WARNING if self._live else logging.DEBUG
            _log.log(level, "ownership stream from %s: %s", self._sidecar, e.code().name)
        finally:
            call.cancel()
            was_live, self._live = self._live, False
            if was_live:
                self._lost_at = time.monotonic()
        return was_live

    def _take(self, snapshot: dict[BundleId, Ownership]) -> None:
        self._table = snapshot
        self._live = True
        self._lost_at = None
        self._syncs += 1
        self._synced.set()
        _log.info(
            "ownership from sidecar %s synced (%d bundles, sync %d)",
            self._sidecar,
            len(snapshot),
            self._syncs,
        )


def _apply(table: dict[BundleId, Ownership], change: lbd_pb2.OwnershipChange) -> None:
    bundle = BundleId(change.bundle)
    if change.state in (lbd_pb2.BUNDLE_STATE_INIT, lbd_pb2.BUNDLE_STATE_UNSPECIFIED):
        table.pop(bundle, None)  # tombstoned: no value
        return
    table[bundle] = Ownership(
        bundle,
        change.state,
        BrokerId(change.owner_broker_id) if change.owner_broker_id else None,
        BrokerId(change.source_broker_id) if change.source_broker_id else None,
        change.version_id,
    )
