"""The broker front's serving core: what it serves, what it answers, how it hands topics over.

:class:`Front` is the :class:`~lbd.broker.BrokerHandler` its :class:`~lbd.broker.BrokerClient`
calls (Own, Release, Close, stopping everything) and what every client connection asks
(:class:`~lbd.front.connection.FrontServices`). The rules it keeps:

1. **It serves a topic only while its sidecar lets it**: the topic falls in a bundle it was given
   by an Own, and :meth:`BrokerClient.may_serve` says yes *now* (no Release or Close came, the
   serving lease is valid on this process's clock). PRODUCER and SUBSCRIBE are refused with
   ServiceNotReady otherwise (the client looks the topic up again), and every SEND and ACK is
   checked at the instant it is forwarded: nothing is written to storage by a broker that is
   not the bundle's server at that instant.
2. **A transfer hands clients over without a lookup** (Pulsar's PIP-307). On Release to a new
   owner: fence the bundle's producers and consumers (nothing more is forwarded), let storage
   receipt what was written and confirm consumers' closes, acknowledge the Release; then, once
   the new owner holds the bundle (its Owned value in the ownership view: the new owner
   acknowledged its Own before that value was written), close the clients' handles naming the
   new owner's URL, and they reconnect there at once. The sends fenced meanwhile were never
   receipted: the clients send them again to the new owner, in order.
3. **An unload, a Close or a lost lease closes clients without a URL**: they look the topic up
   again. A split's parent is the exception: a topic that falls in a child the front was given
   keeps its handles.
4. **Lookups**: Connect when the front serves the topic's bundle now; Redirect (authoritative)
   to the owner the ownership view or the sidecar names; a bundle without owner is assigned by
   the sidecar's Lookup. One that cannot be answered now fails with MetadataError, which the
   client retries on the same connection.

It also keeps the traffic counters behind the load reports and logs ``write`` events (which
broker wrote which storage entries of a topic, and when) beside own/release/close, so that a
checker can match storage's order against the serving intervals.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from lbd.broker import BrokerClient, NewOwner, OwnershipView, StaleOwnershipError
from lbd.broker.events import EventLog, RecordingHandler
from lbd.broker.lookups import LookupFailedError
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.front.connection import ClientConnection
from lbd.front.handles import ClientProducer, Handle, Redirect, State
from lbd.front.metrics import FrontMetrics
from lbd.front.served import ServedBundles, Topic
from lbd.front.storage import StoragePool
from lbd.front.traffic import TopicTraffic, TrafficBook, bundle_stats
from lbd.front.usage import UsageSampler
from lbd.gen.pulsar import pulsar_api_pb2 as api
from lbd.gen.v1 import lbd_pb2

_log = logging.getLogger(__name__)

L = api.CommandLookupTopicResponse
E = api.ServerError
# A lookup that cannot be answered now fails with MetadataError, as Apache Pulsar answers one
# for a bundle being unloaded (apache/pulsar#21211): the client retries it. ServiceNotReady
# would make the official client close the whole connection, and every producer and consumer
# on it would reconnect for one topic's sake.
NOT_NOW = E.MetadataError

LOOKUP_RETRY_S = 0.5
"""A held lookup asks the sidecar again at least this often (and at every ownership change)."""

SIDECAR_LOOKUP_S = 5.0
"""A lookup the sidecar has not answered within this fails (the client asks another broker)."""

_LOOKUP_ANSWERS: dict[int, str] = {L.Connect: "connect", L.Redirect: "redirect", L.Failed: "failed"}

WRITE_WINDOW_S = 1.0
"""A topic's ``write`` event covers at most this long of receipts (fewer lines at high rates)."""


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    """What a LOOKUP is answered with."""

    response: int
    service_url: str = ""
    service_url_tls: str = ""
    authoritative: bool = False
    error: int = 0
    message: str = ""


@dataclass(slots=True)
class _Writes:
    """The storage entries one topic's producers got receipts for, since the last event."""

    bundle: BundleId
    first_ns: int
    last_ns: int
    first: tuple[int, int]
    last: tuple[int, int]
    count: int = 1


@dataclass(slots=True)
class _Registry:
    """Every open handle, by topic name."""

    by_topic: dict[str, set[Handle]] = field(default_factory=dict)

    def add(self, handle: Handle) -> None:
        self.by_topic.setdefault(handle.topic.name, set()).add(handle)

    def discard(self, handle: Handle) -> None:
        handles = self.by_topic.get(handle.topic.name)
        if handles is not None:
            handles.discard(handle)
            if not handles:
                del self.by_topic[handle.topic.name]

    def all(self) -> list[Handle]:
        return [h for handles in self.by_topic.values() for h in handles]


class _Changed:
    """Wakes every waiter when the ownership view changes."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float) -> None:
        event = self._event
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
        except TimeoutError:
            pass


class Front(RecordingHandler):
    """See the module docstring. Call :meth:`attach` with the broker client before serving."""

    def __init__(
        self,
        *,
        broker_id: str,
        urls: Redirect,
        storage: StoragePool,
        ownership: OwnershipView,
        sidecar_lookup: Callable[[str], Awaitable[lbd_pb2.LookupResponse]],
        metrics: FrontMetrics,
        usage: UsageSampler,
        events: EventLog | None = None,
        drain_timeout_s: float = 2.0,
        handover_timeout_s: float = 10.0,
        lookup_hold_s: float = 25.0,
        max_message_size: int = 5 * 1024 * 1024,
    ) -> None:
        super().__init__(events)
        self.broker_id = broker_id
        self.urls = urls
        self.storage = storage
        self.max_message_size = max_message_size
        self._ownership = ownership
        self._sidecar_lookup = sidecar_lookup
        self.metrics = metrics
        self._usage = usage
        self._drain_s = drain_timeout_s
        self._handover_s = handover_timeout_s
        self._lookup_hold_s = lookup_hold_s
        self._client: BrokerClient | None = None
        self.served = ServedBundles()
        self._registry = _Registry()
        self._book = TrafficBook()
        self._writes: dict[str, _Writes] = {}
        self._urls_of: dict[BrokerId, Redirect] = {BrokerId(broker_id): urls}
        self._elsewhere_turn = 0
        self._closing: set[Handle] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._changed = _Changed()
        self.last_report: lbd_pb2.LoadReport | None = None
        """The load report sent last (None before the first)."""
        self.emptied = asyncio.Event()
        """Set while the front holds no bundle."""
        self.emptied.set()
        self.connections: set[ClientConnection] = set()
        ownership.add_listener(self._changed.notify)

    def attach(self, client: BrokerClient) -> None:
        """The broker client whose session and lease decide what may be served."""
        self._client = client

    @property
    def client(self) -> BrokerClient:
        if self._client is None:
            raise RuntimeError("the front has no broker client attached")
        return self._client

    # -- serving -------------------------------------------------------------------------------

    def serving_bundle(self, topic: Topic) -> BundleId | None:
        """The bundle the front serves ``topic`` in now; None when it serves none of it."""
        client = self.client
        for bundle in self.served.containing(topic):
            if client.may_serve(bundle):
                return bundle
        return None

    def accepts(self, handle: Handle) -> bool:
        """Whether the front serves ``handle``'s topic now; moves the handle to the child of a
        split whose parent is closing (the hot path: one set lookup and a clock read)."""
        if self.client.may_serve(handle.bundle):
            return True
        bundle = self.serving_bundle(handle.topic)
        if bundle is None:
            return False
        handle.bundle = bundle
        return True

    def not_served(self, topic: Topic) -> str:
        """Why ``topic`` is refused here, for the client's log."""
        held = self.served.containing(topic)
        if held and not self.client.lease_valid():
            return f"{self.broker_id} holds no valid serving lease now; look {topic.name} up again"
        return f"{self.broker_id} does not serve {topic.name} now; look it up again"

    def traffic(self, topic: Topic) -> TopicTraffic:
        """The topic's traffic counters."""
        return self._book.of(topic)

    def repeat_dropped(self) -> None:
        """A consumer dropped a repeat storage sent."""
        self.metrics.repeats.inc()

    def register(self, handle: Handle) -> None:
        """A handle begins opening."""
        self._registry.add(handle)
        self.metrics.handles.labels(handle.kind).inc()

    def unregister(self, handle: Handle) -> None:
        """A handle is gone."""
        if handle in self._registry.by_topic.get(handle.topic.name, ()):
            self._registry.discard(handle)
            self.metrics.handles.labels(handle.kind).dec()

    def handle_lost(self, handle: Handle, why: str) -> None:
        """Storage can no longer carry ``handle``, or its topic is not served any more: fence
        it and tell its client to look the topic up again (unless it is being closed already)."""
        if handle in self._closing or handle.state is State.CLOSED:
            return
        _log.info("%s: %s; its client is sent to look it up again", handle, why)
        self._close_later([handle], None)

    def unreceipted(self, handle: Handle, accepted_ns: list[int]) -> None:
        """Logged as ``unreceipted``: the sends a stopping producer leaves to its client to send
        again, with when each was accepted. Storage may have stored those written before a
        partition cut their receipts off (at-least-once: what may be stored twice)."""
        self.record(
            "unreceipted",
            handle.bundle,
            topic=handle.topic.name,
            count=len(accepted_ns),
            accepted_ns=accepted_ns,
        )

    def unserved(self, handle: Handle) -> None:
        """A frame of ``handle`` came while its topic is not served here. When that is because
        the bundle's Release or Close has arrived and waits its turn, the handle is only fenced:
        carrying that command out takes it with the bundle's other handles, and a transfer sends
        its client to the new owner, without a lookup. Otherwise its client looks it up again."""
        if handle.bundle in self.served and self.client.revoked(handle.bundle):
            handle.fence()
            return
        self.handle_lost(handle, "the front no longer serves the topic")

    def producer_written(
        self, producer: ClientProducer, accepted_ns: int, message_id: object
    ) -> None:
        """Storage receipted a send: extend the topic's write window (logged as ``write``)."""
        assert isinstance(message_id, api.MessageIdData)
        if self._events is None:
            return
        name = producer.topic.name
        entry = (message_id.ledgerId, message_id.entryId)
        window = self._writes.get(name)
        if window is not None and (
            window.bundle != producer.bundle or accepted_ns - window.first_ns > WRITE_WINDOW_S * 1e9
        ):
            self._log_writes(name, window)
            window = None
        if window is None:
            self._writes[name] = _Writes(producer.bundle, accepted_ns, accepted_ns, entry, entry)
            return
        window.last_ns = max(window.last_ns, accepted_ns)
        window.first = min(window.first, entry)
        window.last = max(window.last, entry)
        window.count += 1

    def flush_writes(self, topics: Iterable[str] | None = None) -> None:
        """Log the open write windows (of ``topics``; None: all)."""
        names = list(self._writes) if topics is None else [t for t in topics if t in self._writes]
        for name in names:
            self._log_writes(name, self._writes.pop(name))

    def _log_writes(self, topic: str, window: _Writes) -> None:
        self.record(
            "write",
            window.bundle,
            t_ns=window.first_ns,
            topic=topic,
            until_ns=window.last_ns,
            first=f"{window.first[0]}:{window.first[1]}",
            last=f"{window.last[0]}:{window.last[1]}",
            count=window.count,
        )

    # -- lookups -------------------------------------------------------------------------------

    async def lookup(self, topic: str, authoritative: bool) -> LookupAnswer:
        """Where a client should go for ``topic_text`` (rule 4 of the module docstring)."""
        answer = await self._decide(topic, authoritative)
        self.metrics.lookups.labels(
            _LOOKUP_ANSWERS[answer.response], "true" if authoritative else "false"
        ).inc()
        return answer

    async def _decide(self, topic_text: str, authoritative: bool) -> LookupAnswer:
        """Connect, Redirect, or hold the answer while the topic has no owner that can serve
        it (rule 4): an owner that is not registered (it died, and the leader has not moved its
        bundles yet), or this broker without a valid lease. Answering at once would send the
        client to a broker that refuses it, and its retries back off to seconds apart; held, it
        is answered as soon as the bundle is Owned by a live broker.

        Only a sidecar that answers can say so. When this broker's own sidecar does not (its
        lookup fails or is slow, or its ownership stream vouches for nothing), the client is
        redirected, not authoritatively, to another broker it knows, whose sidecar answers in
        its place: a failed lookup would make the client back off, and resume seconds after the
        bundle has an owner again. Unless the client was sent here as to the owner (an
        authoritative lookup): this broker serves nothing without its sidecar, and until the
        cluster notices, the others would send the client back; it fails instead."""
        try:
            topic = Topic.parse(topic_text)
        except InvalidInputError as e:
            return LookupAnswer(L.Failed, error=E.InvalidTopicName, message=str(e))
        deadline = time.monotonic() + self._lookup_hold_s
        while True:
            if self.serving_bundle(topic) is not None:
                return self._connect()
            if not self._ownership.fresh():
                why = self._ownership.stale_reason() or "stale"
                return self._elsewhere(topic, why, authoritative)
            try:
                async with asyncio.timeout(SIDECAR_LOOKUP_S):
                    answer = await self._sidecar_lookup(topic.name)
            except (LookupFailedError, TimeoutError) as e:
                why = str(e) or f"no answer in {SIDECAR_LOOKUP_S:g} s"
                return self._elsewhere(topic, why, authoritative)
            owner = BrokerId(answer.owner_broker_id)
            if answer.HasField("owner"):
                urls = Redirect(answer.owner.service_url, answer.owner.service_url_tls)
                self._urls_of[owner] = urls
                if owner != self.broker_id:
                    return self._redirect(urls)
                why = self.not_served(topic)
            else:
                why = f"its owner {owner} is not registered (gone, not yet replaced)"
            left = deadline - time.monotonic()
            if left <= 0:
                return LookupAnswer(L.Failed, error=NOT_NOW, message=f"{topic.name}: {why}")
            await self._changed.wait(min(LOOKUP_RETRY_S, left))

    def learn_brokers(self, urls: dict[BrokerId, Redirect]) -> None:
        """The registered brokers and their URLs, as the sidecar lists them."""
        self._urls_of.update(urls)

    def _elsewhere(self, topic: Topic, why: str, authoritative: bool) -> LookupAnswer:
        """Send the client to another broker this one knows (its sidecar does not answer)."""
        others = sorted(b for b in self._urls_of if b != self.broker_id)
        if not others or authoritative:
            return LookupAnswer(
                L.Failed,
                error=NOT_NOW,
                message=f"{self.broker_id}'s sidecar cannot look {topic.name} up: {why}",
            )
        self._elsewhere_turn = (self._elsewhere_turn + 1) % len(others)
        urls = self._urls_of[others[self._elsewhere_turn]]
        _log.info("%s: the sidecar does not answer (%s); client sent to %s", topic.name, why, urls)
        return LookupAnswer(L.Redirect, urls.service_url, urls.service_url_tls, False)

    def _connect(self) -> LookupAnswer:
        return LookupAnswer(L.Connect, self.urls.service_url, self.urls.service_url_tls, True)

    def _redirect(self, urls: Redirect) -> LookupAnswer:
        # Authoritative: the owner is the one the cluster decided on, as Pulsar marks a
        # redirect to the broker its leader chose.
        return LookupAnswer(L.Redirect, urls.service_url, urls.service_url_tls, True)

    # -- the broker handler --------------------------------------------------------------------

    async def own(self, bundle: BundleId) -> str | None:
        """Serve ``bundle`` from now (while the lease is valid): clients come by lookup."""
        if bundle not in self.served:
            self.served.add(bundle)
            self.emptied.clear()
            self.record("own", bundle)
            self._changed.notify()  # a held lookup may answer Connect now
        return None

    async def release(self, bundle: BundleId, new_owner: NewOwner | None) -> str | None:
        """Rule 2 (a transfer) or 3 (an unload) of the module docstring."""
        if bundle not in self.served:
            return None
        self.record("release", bundle, new_owner=new_owner.broker_id if new_owner else "")
        handles = self._take_handles(bundle)
        self._forget(bundle)
        started = time.monotonic()
        # What was written must be receipted before the new owner may write. The consumers'
        # closes only have to be confirmed before their clients are sent on: they run meanwhile.
        producers = [h for h in handles if isinstance(h, ClientProducer)]
        consumers = [h for h in handles if not isinstance(h, ClientProducer)]
        closing = asyncio.ensure_future(self._stop_storage(consumers))
        await self._stop_storage(producers)
        _log.info(
            "%s released%s: %d producers and %d consumers fenced, storage settled in %.1f ms",
            bundle,
            f" to {new_owner.broker_id}" if new_owner else "",
            len(producers),
            len(consumers),
            1000 * (time.monotonic() - started),
        )
        if new_owner is None:
            self._spawn(self._tell_when(closing, handles, None))
        else:
            redirect = Redirect(new_owner.service_url, new_owner.service_url_tls)
            self._urls_of[new_owner.broker_id] = redirect
            self._spawn(
                self._hand_over(bundle, handles, new_owner.broker_id, redirect, started, closing)
            )
        return None

    async def close(self, bundle: BundleId, reason: str) -> str | None:
        """Stop serving ``bundle``; clients of its topics look them up again, but those of a
        split's child the front holds stay."""
        if bundle not in self.served:
            return None
        self.record("close", bundle, reason=reason)
        self._forget(bundle)
        handles = [h for h in self._take_handles(bundle) if not self._rehome(h)]
        await self._stop_storage(handles)
        self._tell(handles, None)
        return None

    def stop_all(self, reason: str) -> None:
        """The session ended or the lease ran out: stop everything at once; every client looks
        its topics up again."""
        held = self.served.clear()
        self.emptied.set()
        for bundle in held:
            self.record("close", bundle, reason=reason)
        handles = [h for h in self._registry.all() if h not in self._closing]
        if held or handles:
            _log.warning(
                "stopped serving %d bundles and %d producers and consumers: %s",
                len(held),
                len(handles),
                reason,
            )
        self._close_later(handles, None)

    def traffic_totals(self) -> tuple[int, int, int, int]:
        """Messages in, bytes in, messages out, bytes out since the front started."""
        return self._book.totals()

    async def settle_handovers(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, until the clients of every bundle handed over were sent
        to the new owner (before the broker closes its ports at shutdown)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    def load_report(self) -> lbd_pb2.LoadReport:
        """Usage and the served bundles' stats from the clients' traffic (a new sample: the
        session's report loop calls it; :attr:`last_report` is what it sent last)."""
        _, bytes_in, _, bytes_out = self._book.totals()
        report = self._usage.sample(bytes_in, bytes_out)
        report.bundles.extend(bundle_stats(self.served, self._book.topics(), self._book.rates()))
        self.last_report = report
        return report

    def _forget(self, bundle: BundleId) -> None:
        self.served.remove(bundle)
        if not self.served:
            self.emptied.set()

    # -- handing over --------------------------------------------------------------------------

    def _take_handles(self, bundle: BundleId) -> list[Handle]:
        """Fence every handle of ``bundle``'s topics not being closed yet and claim it."""
        taken = []
        for handle in self._registry.all():
            if handle not in self._closing and self.served.holds(bundle, handle.topic):
                handle.fence()
                self._closing.add(handle)
                taken.append(handle)
        return taken

    def _rehome(self, handle: Handle) -> bool:
        """Keep a handle whose topic falls in another bundle served now (a split's child)."""
        bundle = self.serving_bundle(handle.topic)
        if bundle is None:
            return False
        self._closing.discard(handle)
        handle.bundle = bundle
        handle.unfence()
        return True

    async def _stop_storage(self, handles: Sequence[Handle]) -> None:
        if handles:
            await asyncio.gather(*(h.stop_storage(self._drain_s) for h in handles))
            self.flush_writes({h.topic.name for h in handles})

    def _tell(self, handles: list[Handle], redirect: Redirect | None) -> None:
        for handle in handles:
            handle.tell_client(redirect)
            self._closing.discard(handle)
            self.metrics.closes.labels(handle.kind, "redirect" if redirect else "lookup").inc()

    async def _tell_when(
        self, closing: asyncio.Future[None], handles: list[Handle], redirect: Redirect | None
    ) -> None:
        await closing
        self._tell(handles, redirect)

    def _close_later(self, handles: list[Handle], redirect: Redirect | None) -> None:
        for handle in handles:
            handle.fence()
            self._closing.add(handle)

        async def close() -> None:
            await self._stop_storage(handles)
            self._tell(handles, redirect)

        if handles:
            self._spawn(close())

    async def _hand_over(
        self,
        bundle: BundleId,
        handles: list[Handle],
        new_owner: BrokerId,
        redirect: Redirect,
        started: float,
        closing: asyncio.Future[None],
    ) -> None:
        """Send the clients to ``new_owner`` once it holds ``bundle`` (rule 2); to a lookup if
        the bundle went elsewhere or the handover outlasts its timeout."""
        deadline = started + self._handover_s
        outcome: Redirect | None = None
        why = f"not settled within {self._handover_s:g} s"
        while (left := deadline - time.monotonic()) > 0:
            try:
                value = self._ownership.get(bundle)
            except StaleOwnershipError:
                value = None
            if value is not None and value.owned and value.owner != self.broker_id:
                if value.owner == new_owner:
                    outcome = redirect
                else:
                    why = f"it went to {value.owner} instead"
                break
            if value is not None and value.state in (
                lbd_pb2.BUNDLE_STATE_FREE,
                lbd_pb2.BUNDLE_STATE_DELETED,
            ):
                why = "the transfer was called off"
                break
            await self._changed.wait(left)
        await closing  # the consumers' storage closes (started at the release) are confirmed
        took = time.monotonic() - started
        self.metrics.handover.observe(took)
        if outcome is None:
            _log.warning("%s: handover to %s %s; clients look it up again", bundle, new_owner, why)
        else:
            _log.info(
                "%s: %s owns it %.1f ms after the release; %d producers and consumers sent there",
                bundle,
                new_owner,
                1000 * took,
                len(handles),
            )
        self._tell(handles, outcome)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            _log.error("a handover task failed", exc_info=error)

    # -- connections ---------------------------------------------------------------------------

    def count_bad_frame(self, reason: str) -> None:
        """A connection sent something it should not have."""
        self.metrics.bad_frames.labels(reason).inc()

    def count_refusal(self, what: str) -> None:
        """A PRODUCER or SUBSCRIBE was refused: the topic is not served here now."""
        self.metrics.refusals.labels(what).inc()

    def connection_closed(self, connection: ClientConnection) -> None:
        """The connection is gone."""
        self.connections.discard(connection)

    async def close_tasks(self) -> None:
        """Cancel the handovers in flight (at shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
