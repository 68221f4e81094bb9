"""Who owns which bundle and topic, answered from memory: a cache fed by ``WatchOwnership``.

A broker answers its own topic lookups with :meth:`OwnershipView.owner_of_topic` instead of a
round trip to the sidecar. The stream starts with the current value of every bundle and a
``snapshot_done`` message, then sends every change in channel order, and a heartbeat every
``heartbeat_s`` saying how fresh the stream is. The cache builds a new table from the first
values and swaps it in at the first heartbeat after ``snapshot_done``: that is how a reconnect
drops bundles whose value was removed while the cache was away, which no change would ever name.

**The staleness bound.** A heartbeat carries an age measured on the sidecar's clock: every change
appended to the state channel before the instant that long before the heartbeat was sent came
before the heartbeat on the stream (the sidecar proves it with a read barrier on the channel,
:mod:`lbd.api.loadbalancer`). The cache subtracts the age from the heartbeat's arrival on its own
monotonic clock and calls the result the instant *vouched for*: as the heartbeat was sent before
it arrived, the true instant is no later. Its table then holds every change appended before that
instant and later ones only in channel order. So, with ``B = stale_after_s``:

    Whenever the cache answers at instant t, its table is the channel's table as it was at some
    instant no earlier than t - B. Otherwise (nothing vouched for since t - B) it raises
    :class:`StaleOwnershipError`.

The two hosts' clocks are never compared, only durations on each; the bound stretches by how much
faster the broker's clock runs than the sidecar's (parts per million). It holds through anything
that stops the vouching: a sidecar that keeps the stream open but cannot read the channel sends
heartbeats with a growing age, a paused or cut-off one sends none, a closed stream sends nothing;
in each case the answers stop at most B after the last instant vouched for. The heartbeats come
every ``heartbeat_s`` and the sidecar's read barrier at least every half
``channel_fence_after_s`` (0.75 s by default), so in steady state the data is at most about
``channel_fence_after_s / 2 + 2 * heartbeat_s`` old, plus twice a barrier's duration: pick B above
that with a margin (the default 5 s is). A smaller B means more refusals, never wrong answers.

Topic answers: a topic belongs to the bundle of its namespace whose hash range holds the CRC-32 of
its full name (:func:`lbd.core.bundles.topic_hash`). The cache keeps, per namespace, the ranges of
the Owned bundles sorted by lower bound, updated as each change arrives (a split leaves a Deleted
parent, not indexed, and Owned children, indexed). A memo of raw topic text to answer sits in
front; a change of a namespace's Owned ranges voids the namespace's answers (a generation count),
so a repeated lookup costs one dict hit and the staleness check.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from lbd.broker.backoff import Backoff
from lbd.broker.client import check_address
from lbd.broker.credentials import INSECURE, ClientCredentials
from lbd.core.bundles import FULL_UPPER, parse_bundle_id, topic_hash
from lbd.core.errors import InvalidInputError, LbdError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.names import NamespaceName, TopicName
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc

_log = logging.getLogger(__name__)

DEFAULT_MEMO_SIZE = 100_000
"""Topics whose answers are memoized at most; the memo starts afresh when it is full."""


class StaleOwnershipError(LbdError):
    """The cache cannot vouch for its answers: not synced yet, or nothing vouched for within
    its bound (the sidecar cannot read the channel, is paused, or the stream is down)."""


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


_Span = tuple[str, int, int]
"""Where a bundle sits: its namespace, the lower bound of its range and the end (exclusive; 2**32
for the last bundle, whose range includes 0xffffffff)."""


class _OwnedRanges:
    """The Owned bundles of one namespace, sorted by lower bound, and a generation that every
    change of them bumps (the memo's answers hold the generation they were computed at)."""

    __slots__ = ("ends", "generation", "lowers", "values")

    def __init__(self, entries: list[tuple[int, int, Ownership]] | None = None) -> None:
        entries = sorted(entries or (), key=lambda e: (e[0], e[1]))
        self.generation = 0
        self.lowers = [lo for lo, _, _ in entries]
        self.ends = [end for _, end, _ in entries]
        self.values = [value for _, _, value in entries]

    def find(self, hash_value: int) -> Ownership | None:
        """The Owned value whose range holds ``hash_value``; None when none does."""
        i = bisect.bisect_right(self.lowers, hash_value) - 1
        if i >= 0 and hash_value < self.ends[i]:
            return self.values[i]
        return None

    def put(self, lo: int, end: int, value: Ownership) -> None:
        i = bisect.bisect_right(self.lowers, lo)
        self.lowers.insert(i, lo)
        self.ends.insert(i, end)
        self.values.insert(i, value)
        self.generation += 1

    def remove(self, lo: int, bundle: BundleId) -> None:
        for i in range(bisect.bisect_left(self.lowers, lo), bisect.bisect_right(self.lowers, lo)):
            if self.values[i].bundle == bundle:
                del self.lowers[i], self.ends[i], self.values[i]
                self.generation += 1
                return


_Answer = tuple[_OwnedRanges, int, Ownership | None, BrokerId | None]
"""A memoized topic answer: the namespace's ranges, their generation then, the value, its owner."""


class _Phase(enum.Enum):
    CLOSED = "no stream"
    SNAPSHOT = "receiving the current values"
    VOUCHING = "waiting for the first heartbeat after the current values"
    LIVE = "live"


class OwnershipView:
    """What one ``WatchOwnership`` stream said, answering lookups from memory (no I/O).

    Feed it with :meth:`stream_opened`, :meth:`receive` for each message and
    :meth:`stream_closed` (:class:`OwnershipCache` does, from the sidecar); ``clock`` is the
    monotonic clock the staleness bound is kept on.
    """

    def __init__(
        self,
        *,
        stale_after_s: float = 5.0,
        memo_size: int = DEFAULT_MEMO_SIZE,
        clock: Callable[[], float] = time.monotonic,
        source: str = "the ownership stream",
    ) -> None:
        if not stale_after_s > 0:
            raise InvalidInputError(f"stale bound must be > 0 seconds, got {stale_after_s}")
        if memo_size < 1:
            raise InvalidInputError(f"memo size must be >= 1, got {memo_size}")
        self._stale_after_s = stale_after_s
        self._memo_size = memo_size
        self._clock = clock
        self._source = source
        self._table: dict[BundleId, Ownership] = {}
        self._spans: dict[BundleId, _Span] = {}
        """The span of every Owned bundle of the table."""
        self._ranges: dict[str, _OwnedRanges] = {}
        self._memo: dict[str, _Answer] = {}
        self._phase = _Phase.CLOSED
        self._pending: dict[BundleId, Ownership] = {}
        self._pending_spans: dict[BundleId, _Span] = {}
        self._syncs = 0
        self._vouched_at = -math.inf
        """The latest instant (on ``clock``) as of which the table is known complete."""
        self._fresh_until = -math.inf
        """``_vouched_at + stale_after_s``: answers are given up to this instant."""
        self._last_heartbeat: float | None = None
        self._warned_old_vouch = False
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the caller's thread, synchronously) after each change the
        stream applies and after each new table is swapped in: a broker that waits for a
        bundle to settle re-reads the view then instead of polling it."""
        self._listeners.append(callback)

    def _changed(self) -> None:
        for callback in self._listeners:
            callback()

    # -- answers -----------------------------------------------------------------------------

    def owner_of_topic(self, topic: str) -> BrokerId | None:
        """The broker that owns the bundle holding ``topic``; None when that bundle has no
        Owned value here (moving, free, unknown, or of a namespace this cache does not watch:
        ask the sidecar's ``Lookup``). InvalidInputError for an invalid topic name;
        StaleOwnershipError when the cache cannot answer."""
        if self._clock() > self._fresh_until:
            raise StaleOwnershipError(self._why_stale())
        answer = self._memo.get(topic)
        if answer is None or answer[0].generation != answer[1]:
            answer = self._resolve(topic)
        return answer[3]

    def lookup_topic(self, topic: str) -> Ownership | None:
        """The Owned value of the bundle holding ``topic`` (its bundle id, owner and version);
        None, InvalidInputError and StaleOwnershipError as :meth:`owner_of_topic`."""
        if self._clock() > self._fresh_until:
            raise StaleOwnershipError(self._why_stale())
        answer = self._memo.get(topic)
        if answer is None or answer[0].generation != answer[1]:
            answer = self._resolve(topic)
        return answer[2]

    def get(self, bundle: str) -> Ownership | None:
        """The last value of ``bundle``; None when it has none. StaleOwnershipError when the
        cache cannot answer."""
        if self._clock() > self._fresh_until:
            raise StaleOwnershipError(self._why_stale())
        return self._table.get(BundleId(bundle))

    def owner(self, bundle: str) -> BrokerId | None:
        """The broker that owns ``bundle``; None when it has no owner or is moving.
        StaleOwnershipError when the cache cannot answer."""
        value = self.get(bundle)
        return value.owner if value is not None and value.owned else None

    def fresh(self) -> bool:
        """Whether answers are given now (synced, and vouched for within the bound)."""
        return self._clock() <= self._fresh_until

    def stale_reason(self) -> str | None:
        """None while answers are given; else why not (what StaleOwnershipError says)."""
        return None if self.fresh() else self._why_stale()

    def vouched_age_s(self) -> float:
        """How old the data may be now: the time since the instant last vouched for (inf
        before the first heartbeat). Answers are given while it is at most the bound."""
        return self._clock() - self._vouched_at

    @property
    def stale_after_s(self) -> float:
        """The staleness bound (module docstring)."""
        return self._stale_after_s

    @property
    def syncs(self) -> int:
        """How many snapshots were taken in so far (1 + the reconnects that got through)."""
        return self._syncs

    @property
    def live(self) -> bool:
        """Whether the stream is open and its snapshot taken in."""
        return self._phase is _Phase.LIVE

    @property
    def memoized(self) -> int:
        """How many topic answers are memoized now (at most ``memo_size``)."""
        return len(self._memo)

    def _resolve(self, topic: str) -> _Answer:
        """Compute ``topic``'s answer from the ranges and memoize it."""
        name = TopicName.parse(topic)
        if len(self._memo) >= self._memo_size:
            self._forget_answers()
        key = str(name.namespace)
        ranges = self._ranges.get(key)
        if ranges is None:
            # Held, though empty, so that a change in the namespace voids this answer.
            ranges = self._ranges[key] = _OwnedRanges()
        value = ranges.find(topic_hash(name))
        answer = (ranges, ranges.generation, value, value.owner if value is not None else None)
        self._memo[topic] = answer
        return answer

    def _forget_answers(self) -> None:
        self._memo.clear()
        # Namespaces kept only for answers about them: gone with the answers.
        self._ranges = {k: ranges for k, ranges in self._ranges.items() if ranges.lowers}

    def _why_stale(self) -> str:
        now = self._clock()
        if self._phase is _Phase.LIVE and self._last_heartbeat is not None:
            # Facts to tell the two causes apart: no heartbeats (a paused sidecar, a network
            # cut) or heartbeats with a growing age (a sidecar that cannot read the channel).
            why = (
                f"the last heartbeat came {now - self._last_heartbeat:.2f} s ago and vouched "
                f"for {self._last_heartbeat - self._vouched_at:.2f} s before it"
            )
        elif self._phase is _Phase.VOUCHING:
            why = "a new snapshot waits for the sidecar's first heartbeat"
        elif self._phase is _Phase.SNAPSHOT:
            why = "a new stream is sending its snapshot"
        else:
            why = "the stream is down"
        if self._syncs == 0:
            return f"ownership from {self._source} not synced yet: {why}"
        return (
            f"ownership from {self._source} is stale: vouched for as of "
            f"{now - self._vouched_at:.2f} s ago (bound {self._stale_after_s:g} s); {why}"
        )

    # -- feeding -----------------------------------------------------------------------------

    def stream_opened(self) -> None:
        """A new stream begins: its values build a new table (the current one keeps answering
        within its bound until that is vouched for)."""
        self._phase = _Phase.SNAPSHOT
        self._pending = {}
        self._pending_spans = {}

    def stream_closed(self) -> None:
        """The stream ended: answers go on until the bound runs out."""
        self._phase = _Phase.CLOSED
        self._pending = {}
        self._pending_spans = {}

    def receive(self, message: lbd_pb2.OwnershipChange) -> None:
        """Take in one message of the stream (opened with :meth:`stream_opened`)."""
        if self._phase is _Phase.CLOSED:
            raise RuntimeError(f"a message from {self._source} while no stream is open")
        if message.heartbeat:
            self._heartbeat(message.vouched_age_ms)
        elif message.snapshot_done:
            if self._phase is _Phase.SNAPSHOT:
                self._phase = _Phase.VOUCHING
        elif self._phase is _Phase.LIVE:
            self._change(message)
        else:
            _apply(self._pending, self._pending_spans, message)

    def _heartbeat(self, vouched_age_ms: int) -> None:
        now = self._clock()
        vouched_at = now - vouched_age_ms / 1000
        if self._phase is _Phase.SNAPSHOT:
            return  # it cannot vouch for a table not yet complete
        if self._phase is _Phase.VOUCHING:
            self._take()
            self._vouched_at = vouched_at  # a new table: what vouched for the old says nothing
        else:
            self._vouched_at = max(self._vouched_at, vouched_at)
        self._fresh_until = self._vouched_at + self._stale_after_s
        self._last_heartbeat = now
        too_old = now > self._fresh_until
        if too_old and not self._warned_old_vouch:
            _log.warning(
                "%s vouches for ownership only as of %.2f s ago (bound %g s): answers refused",
                self._source,
                now - self._vouched_at,
                self._stale_after_s,
            )
        elif not too_old and self._warned_old_vouch:
            _log.info("%s vouches for fresh ownership again", self._source)
        self._warned_old_vouch = too_old

    def _take(self) -> None:
        """Swap in the table the stream built."""
        self._table, self._spans = self._pending, self._pending_spans
        self._pending, self._pending_spans = {}, {}
        by_namespace: dict[str, list[tuple[int, int, Ownership]]] = {}
        for bundle, (namespace, lo, end) in self._spans.items():
            by_namespace.setdefault(namespace, []).append((lo, end, self._table[bundle]))
        self._ranges = {ns: _OwnedRanges(entries) for ns, entries in by_namespace.items()}
        self._memo.clear()  # its answers point into the old ranges
        self._phase = _Phase.LIVE
        self._syncs += 1
        _log.info(
            "ownership from %s synced (%d bundles, %d owned, sync %d)",
            self._source,
            len(self._table),
            len(self._spans),
            self._syncs,
        )
        self._changed()

    def _change(self, message: lbd_pb2.OwnershipChange) -> None:
        bundle = BundleId(message.bundle)
        old_span = self._spans.get(bundle)
        value = _apply(self._table, self._spans, message)
        if old_span is not None:
            self._ranges[old_span[0]].remove(old_span[1], bundle)
        new_span = self._spans.get(bundle)
        if new_span is not None and value is not None:
            namespace, lo, end = new_span
            ranges = self._ranges.get(namespace)
            if ranges is None:
                ranges = self._ranges[namespace] = _OwnedRanges()
            ranges.put(lo, end, value)
        self._changed()


def _apply(
    table: dict[BundleId, Ownership], spans: dict[BundleId, _Span], change: lbd_pb2.OwnershipChange
) -> Ownership | None:
    """Put ``change`` into ``table`` (and the span of an Owned value into ``spans``); the new
    value, None when tombstoned."""
    bundle = BundleId(change.bundle)
    spans.pop(bundle, None)
    if change.state in (lbd_pb2.BUNDLE_STATE_INIT, lbd_pb2.BUNDLE_STATE_UNSPECIFIED):
        table.pop(bundle, None)  # tombstoned: no value
        return None
    value = table[bundle] = Ownership(
        bundle,
        change.state,
        BrokerId(change.owner_broker_id) if change.owner_broker_id else None,
        BrokerId(change.source_broker_id) if change.source_broker_id else None,
        change.version_id,
    )
    if value.owned:
        try:
            parsed = parse_bundle_id(bundle)
        except InvalidInputError as e:
            _log.warning("bundle %r left out of topic lookups: %s", bundle, e)
        else:
            hash_range = parsed.range
            end = hash_range.hi + 1 if hash_range.hi == FULL_UPPER else hash_range.hi
            spans[bundle] = (str(parsed.namespace), hash_range.lo, end)
    return value


class OwnershipCache(OwnershipView):
    """An :class:`OwnershipView` of one namespace (or all) kept by the sidecar's
    ``WatchOwnership``, asking for a heartbeat every ``heartbeat_s``.

    Run it with ``async with OwnershipCache(...)`` (or :meth:`start` and :meth:`close`), or await
    :meth:`run` in a task of the broker's own; :meth:`wait_synced` waits until it answers.
    """

    def __init__(
        self,
        sidecar: str,
        *,
        namespace: str = "",
        stale_after_s: float = 5.0,
        heartbeat_s: float = 0.5,
        memo_size: int = DEFAULT_MEMO_SIZE,
        reconnect_min_s: float = 0.1,
        reconnect_max_s: float = 2.0,
        credentials: ClientCredentials = INSECURE,
    ) -> None:
        check_address(sidecar)
        super().__init__(
            stale_after_s=stale_after_s, memo_size=memo_size, source=f"sidecar {sidecar}"
        )
        if not 0 < heartbeat_s < stale_after_s:
            raise InvalidInputError(
                f"heartbeat interval must be > 0 and below the stale bound ({stale_after_s} s), "
                f"got {heartbeat_s}"
            )
        Backoff(reconnect_min_s, reconnect_max_s)  # checks the delays now
        self._sidecar = sidecar
        self._namespace = str(NamespaceName.parse(namespace)) if namespace else ""
        self._heartbeat_ms = max(1, round(heartbeat_s * 1000))
        self._reconnect = (reconnect_min_s, reconnect_max_s)
        self._credentials = credentials
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def wait_synced(self) -> None:
        """Wait until the first snapshot was taken in (vouched for by a heartbeat)."""
        await self._synced.wait()

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
            lbd_pb2.WatchOwnershipRequest(
                namespace=self._namespace, heartbeat_ms=self._heartbeat_ms
            ),
            metadata=self._credentials.metadata(),
        )
        syncs = self.syncs
        self.stream_opened()
        try:
            async for message in call:
                self.receive(message)
                if self.syncs > syncs:
                    self._synced.set()
            _log.warning("sidecar %s ended the ownership stream", self._sidecar)
        except grpc.aio.AioRpcError as e:
            level = logging.WARNING if self.live else logging.DEBUG
            _log.log(level, "ownership stream from %s: %s", self._sidecar, e.code().name)
        finally:
            call.cancel()
            self.stream_closed()
        return self.syncs > syncs
