"""The broker registry: which brokers are live, since when one is gone, and safe mode.

It lists ``brokers/`` once at start, then follows the store's watch, so that reading it costs
nothing. It also follows the metadata session: between UNREACHABLE and REACHABLE/RECONNECTED
the sidecar is in safe mode (DESIGN §8) and :attr:`BrokerRegistry.reachable` is False, so that no
registry-dependent decision (a new assignment, an orphan cleanup) is made on stale knowledge.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Container, Mapping
from types import MappingProxyType

from lbd.core.broker_info import BrokerInfo
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId
from lbd.ports.clock import Clock
from lbd.ports.errors import SessionExpiredError
from lbd.ports.metadata import MetadataStore, RegistryEvent, SessionEvent, SessionEventKind
from lbd.tasks import Component, Tasks

_log = logging.getLogger(__name__)


class BrokerRegistry(Component):
    """Live registrations (:class:`BrokerInfo` by broker id), vanish times and safe mode."""

    def __init__(self, metadata: MetadataStore, clock: Clock) -> None:
        self._metadata = metadata
        self._clock = clock
        self._brokers: dict[BrokerId, BrokerInfo] = {}
        self._absent: dict[BrokerId, float] = {}
        self._reachable = True
        self._subscribers: set[asyncio.Queue[RegistryEvent]] = set()
        self._tasks = Tasks("the broker registry")
        self._changed = asyncio.Event()

    async def start(self) -> None:
        """List the registry and start following it and the session.

        Raises :class:`~lbd.ports.errors.UnavailableError` when the store cannot be reached.
        """
        if self._tasks:
            return
        # Subscribed before listing: an outage beginning meanwhile is not missed.
        session = self._metadata.session_events()
        listed, revision = await self._metadata.list_brokers()
        for broker, raw in listed.items():
            info = _decode(broker, raw)
            if info is not None:
                self._brokers[broker] = info
        self._tasks.spawn(self._follow_registry(revision), name="broker-registry")
        self._tasks.spawn(self._follow_session(session), name="broker-registry-session")

    async def close(self) -> None:
        """Stop following. Idempotent."""
        await self._tasks.close()

    # -- reading ----------------------------------------------------------------------------

    def brokers(self) -> Mapping[BrokerId, BrokerInfo]:
        """Live registrations (a read-only snapshot)."""
        return MappingProxyType(dict(self._brokers))

    def get(self, broker: BrokerId) -> BrokerInfo | None:
        """One live registration, or None."""
        return self._brokers.get(broker)

    def absent_since(self, broker: BrokerId) -> float | None:
        """Clock-monotonic time at which ``broker``'s registration vanished; None while it is
        registered or if this sidecar never saw it."""
        return self._absent.get(broker)

    async def registered_now(self, broker: BrokerId) -> bool:
        """Whether ``broker`` is registered, read from the store itself rather than this
        sidecar's watch (which may lag); raises UnavailableError when the store cannot answer."""
        brokers, _ = await self._metadata.list_brokers()
        return broker in brokers

    @property
    def reachable(self) -> bool:
        """False in safe mode: the metadata store cannot be reached."""
        return self._reachable

    def changes(self) -> AsyncIterator[RegistryEvent]:
        """Every registration change applied from the moment of this call on."""
        queue: asyncio.Queue[RegistryEvent] = asyncio.Queue()
        self._subscribers.add(queue)
        return self._drain(queue)

    async def wait_for(self, brokers: set[BrokerId]) -> None:
        """Return once every broker of ``brokers`` is registered (bound it with a timeout)."""
        while not brokers <= self._brokers.keys():
            self._changed.clear()
            await self._changed.wait()

    # -- writing ----------------------------------------------------------------------------

    async def register(self, info: BrokerInfo) -> None:
        """Register ``info`` under the session lease (raises UnavailableError in safe mode).

        The registration is known here at once, before the watch echoes it back.
        """
        await self._metadata.register_broker(info.broker_id, info.to_json())
        _log.info("registered broker %s", info.broker_id)
        self._present(info)

    async def deregister(self, broker: BrokerId) -> None:
        """Remove ``broker``'s registration (raises UnavailableError in safe mode)."""
        await self._metadata.deregister_broker(broker)
        _log.info("deregistered broker %s", broker)
        self._gone(broker)

    # -- following --------------------------------------------------------------------------

    async def _drain(self, queue: asyncio.Queue[RegistryEvent]) -> AsyncIterator[RegistryEvent]:
        try:
            while True:
                yield await queue.get()
        finally:
            self._subscribers.discard(queue)

    async def _follow_registry(self, revision: int) -> None:
        async for event in self._metadata.watch_brokers(revision):
            if event.value is None:
                self._gone(event.broker)
            else:
                info = _decode(event.broker, event.value)
                if info is None:
                    continue
                self._present(info)
            for queue in self._subscribers:
                queue.put_nowait(event)

    async def _follow_session(self, events: AsyncIterator[SessionEvent]) -> None:
        with contextlib.suppress(SessionExpiredError):  # the SessionWatcher stops the daemon
            async for event in events:
                reachable = event.kind in (SessionEventKind.REACHABLE, SessionEventKind.RECONNECTED)
                if reachable != self._reachable:
                    self._reachable = reachable
                    _log.warning(
                        "metadata store %s: %s",
                        "reachable again" if reachable else "unreachable, safe mode",
                        event.kind.value,
                    )
                    self._changed.set()

    def _present(self, info: BrokerInfo) -> None:
        if self._brokers.get(info.broker_id) != info:
            self._brokers[info.broker_id] = info
            self._absent.pop(info.broker_id, None)
            self._changed.set()

    def _gone(self, broker: BrokerId) -> None:
        if self._brokers.pop(broker, None) is not None:
            self._absent[broker] = self._clock.monotonic()
            self._changed.set()


def _decode(broker: BrokerId, raw: bytes) -> BrokerInfo | None:
    """The registration of ``broker``, or None (logged) when it is unreadable or mislabelled."""
    try:
        info = BrokerInfo.from_json(raw)
    except InvalidInputError as e:
        _log.warning("ignoring the unreadable registration of broker %s: %s", broker, e)
        return None
    if info.broker_id != broker:
        _log.warning(
            "ignoring the registration under brokers/%s: it names broker %s", broker, info.broker_id
        )
        return None
    return info


class GoneBrokers:
    """How long unregistered brokers have been away, for a duty that walks the table (the
    leader's monitor, the safety auditor).

    The registry's word when this sidecar saw the broker vanish; for one that vanished before it
    was watching, from when the duty first asked about it, less ``unseen_extra_s``: a broker
    this sidecar never saw registered (a cluster starting) gets that much more grace. Each duty
    keeps its own.
    """

    def __init__(self, registry: BrokerRegistry, *, unseen_extra_s: float = 0.0) -> None:
        self._registry = registry
        self._unseen_extra_s = unseen_extra_s
        self._noticed: dict[BrokerId, float] = {}
        """Brokers whose vanishing this sidecar did not witness: when the duty noticed them."""

    def away_s(self, broker: BrokerId, now: float) -> float:
        """Seconds the unregistered ``broker`` has been away at ``now`` (clock-monotonic), as its
        grace counts them (less ``unseen_extra_s`` for one never seen registered)."""
        since = self._registry.absent_since(broker)
        if since is None:
            since = self._noticed.setdefault(broker, now) + self._unseen_extra_s
        return now - since

    def keep_only(self, brokers: Container[BrokerId]) -> None:
        """Forget every broker not in ``brokers``: one named again later is noticed afresh."""
        self._noticed = {b: t for b, t in self._noticed.items() if b in brokers}

    def clear(self) -> None:
        """Forget every broker noticed."""
        self._noticed.clear()
