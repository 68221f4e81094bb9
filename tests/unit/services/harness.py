"""In-process sidecars on the memory adapters, for service-level tests.

A :class:`Harness` is one simulated cluster: a shared :class:`MemoryMetadataCluster` ("etcd"), a
shared :class:`MemoryLog` (the state channel), shared :class:`MemoryLoadTopic` s (broker load and
top bundles), a shared checkpoint store and one :class:`ManualClock`. :meth:`Harness.add` builds a
whole sidecar on it with :func:`lbd.services.graph.build_sidecar`, the wiring ``lbd serve`` uses
(every service, leader duties included), with either ``auto_ack`` or a :class:`FakeBroker` driving
the real ``BrokerLink.session``. Fake brokers write every command they get into one shared, ordered
:attr:`Harness.events` list, and record a violation whenever a broker is told to own a bundle whose
hash range another broker serves at that instant (the invariant of DESIGN §8).

Typical use::

    async with Harness() as h:
        a = await h.add("broker-a")                       # auto_ack
        b = await h.add("broker-b", fake_broker=True)      # a FakeBroker attached
        await h.ready()                                    # registries see everyone
        result = await a.lookup.lookup("persistent://public/default/t")
        await h.idle()                                     # reactors done, followers caught up
        assert h.violations == []

Time moves only when a test moves it (``h.clock.advance`` / ``await h.clock.run_for(s)``):
lease keepalives, fence checks, ack timeouts, settle deadlines and every scheduler run on that
clock. The schedulers' intervals are the defaults (load reports every 10 s, the leader's duties
every 60 s or more) unless a test passes its own :class:`SidecarConfig`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass

from lbd.adapters.clock import ManualClock
from lbd.adapters.memory.channel import MemoryChannelLog, MemoryLog
from lbd.adapters.memory.checkpoint import MemoryCheckpointStore
from lbd.adapters.memory.loadstore import MemoryLoadStore, MemoryLoadTopic
from lbd.adapters.memory.metadata import MemoryMetadataCluster, MemoryMetadataStore
from lbd.adapters.session import SessionPolicy
from lbd.core.broker_info import (
    BrokerInfo,
    CloseCommand,
    CommandAck,
    Leave,
    LoadReport,
    OwnCommand,
    ReleaseCommand,
)
from lbd.core.bundles import parse_bundle_id
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BrokerUsage, ResourceWeights
from lbd.core.names import NamespaceName
from lbd.core.settings import AssignmentConfig, SidecarConfig, SidecarTimings, SplitConfig
from lbd.core.state import owner_of
from lbd.services import graph
from lbd.services.graph import SidecarPorts, build_sidecar
from lbd.services.sidecar.broker_link import BrokerLink, LinkEventKind
from lbd.simulation.broker import ContractBroker

DEFAULT_NAMESPACE: NamespaceName = graph.DEFAULT_NAMESPACE

WAIT_S = 5.0
"""Real-time bound of the harness's own waits: in-process work settles in milliseconds."""


@dataclass(frozen=True, slots=True)
class BrokerEvent:
    """One command a fake broker received: ``kind`` is ``own``, ``release`` or ``close``."""

    broker: BrokerId
    kind: str
    bundle: BundleId
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Timing:
    """The timing knobs of every sidecar of a harness (seconds of the manual clock)."""

    lease_ttl_s: int = 15
    keepalive_interval_s: float = 2.0
    ack_timeout_s: float = 5.0
    settle_timeout_s: float = 30.0
    fence_after_s: float = 8.0
    channel_fence_after_s: float = 8.0
    fence_check_interval_s: float = 1.0
    retry_s: float = 1.0
    serving_lease_s: float = 4.0
    lease_margin_s: float = 1.0
    silence_timeout_s: float = 12.0

    def timings(self) -> SidecarTimings:
        """The sidecar's timings (Own and Release share ``ack_timeout_s``)."""
        return SidecarTimings(
            own_ack_timeout_s=self.ack_timeout_s,
            release_ack_timeout_s=self.ack_timeout_s,
            settle_timeout_s=self.settle_timeout_s,
            fence_after_s=self.fence_after_s,
            channel_fence_after_s=self.channel_fence_after_s,
            fence_check_interval_s=self.fence_check_interval_s,
            retry_s=self.retry_s,
            serving_lease_s=self.serving_lease_s,
            lease_margin_s=self.lease_margin_s,
            silence_timeout_s=self.silence_timeout_s,
        )


class IdleHost:
    """A host that is never busy: what the load reporter measures while no broker reports, so
    that no test depends on the machine it runs on."""

    def sample(self, now_s: float) -> BrokerUsage:
        return BrokerUsage()


class FakeBroker(ContractBroker):
    """A broker on the far side of ``BrokerLink.session`` (the shared in-process broker of
    :mod:`lbd.simulation.broker`, on the harness clock): does and acknowledges what it is told,
    and the harness records every command and checks that no two brokers serve one bundle.

    ``ack_own`` / ``ack_release`` choose how it answers Own / Release: ``True`` acknowledges,
    ``False`` refuses (ok=False), ``None`` never answers (the sidecar's ack timeout decides).
    """

    _task_prefix = "fake"

    def __init__(
        self,
        info: BrokerInfo,
        harness: Harness,
        *,
        ack_own: bool | None = True,
        ack_release: bool | None = True,
    ) -> None:
        super().__init__(info, harness.clock, harness.timing.serving_lease_s)
        self.ack_own = ack_own
        self.ack_release = ack_release
        self._harness = harness

    async def connect(self, link: BrokerLink) -> None:
        """Open a session with ``link`` (Hello first) and wait until the link is attached."""
        events = link.events()
        self.open(link.session)
        async with asyncio.timeout(WAIT_S), contextlib.aclosing(events):
            async for event in events:
                if event.kind is LinkEventKind.ATTACHED and event.info == self.info:
                    break

    async def disconnect(self) -> None:
        """End the session (the broker's stream ends) and wait for the link to notice."""
        if not self._tasks:
            return
        run, *others = self._tasks
        for task in others:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._outgoing.put_nowait(None)
        async with asyncio.timeout(WAIT_S):
            await run
        self._tasks = []
        self.serving.clear()

    def report(self, report: LoadReport) -> None:
        """Send a load report."""
        self.send(report)

    def leave(self, reason: str) -> None:
        """Say it is shutting down gracefully (it goes on serving what it is told)."""
        self.send(Leave(reason))

    def report_ack(self, ack: CommandAck) -> None:
        """Send an ack of its own making (e.g. a late answer to a command it left unanswered)."""
        self.send(ack)

    def answer(self, command: OwnCommand | ReleaseCommand | CloseCommand) -> bool | None:
        match command:
            case OwnCommand():
                return self.ack_own
            case ReleaseCommand():
                return self.ack_release
        return True

    def on_own(self, bundle: BundleId, accepted: bool) -> None:
        self._harness._record(BrokerEvent(self.id, "own", bundle))
        if accepted:
            self._harness._check_exclusive(self.id, bundle)

    def on_release(self, bundle: BundleId, command: ReleaseCommand | CloseCommand) -> None:
        if isinstance(command, ReleaseCommand):
            new_owner = command.new_owner
            detail = "" if new_owner is None else new_owner.broker_id
            self._harness._record(BrokerEvent(self.id, "release", bundle, detail))
        else:
            self._harness._record(BrokerEvent(self.id, "close", bundle, command.reason))

    def on_lapse(self, was_serving: bool) -> None:
        self._harness._record(BrokerEvent(self.id, "lapse", BundleId("")))


class Sidecar:
    """One sidecar of a harness: the services :func:`build_sidecar` wired (reached as attributes:
    ``a.lookup``, ``a.registry``...), its fake broker, and whether it was closed."""

    def __init__(self, services: graph.Sidecar, broker: FakeBroker | None = None) -> None:
        self.services = services
        self.broker = broker
        self.closed = False

    def __getattr__(self, name: str) -> object:
        return getattr(self.services, name)

    @property
    def metadata(self) -> MemoryMetadataStore:
        """This sidecar's metadata session."""
        store = self.services.ports.metadata
        assert isinstance(store, MemoryMetadataStore)
        return store

    @property
    def channel(self) -> MemoryChannelLog:
        """This sidecar's channel client."""
        channel = self.services.ports.channel
        assert isinstance(channel, MemoryChannelLog)
        return channel

    @property
    def load_store(self) -> MemoryLoadStore:
        """This sidecar's reader of the broker-load topic."""
        store = self.services.ports.broker_loads
        assert isinstance(store, MemoryLoadStore)
        return store

    def served(self) -> frozenset[BundleId]:
        """What the link believes its broker serves."""
        return self.services.link.served()

    async def publish_load(self, usage: BrokerUsage, now_ms: int) -> None:
        """Publish this broker's load on the broker-load topic (as the load reporter would)."""
        data = BrokerLoadData(self.services.me).update(usage, ResourceWeights(), now_ms)
        await self.load_store.publish(self.services.me, data.to_json())

    async def close(self) -> None:
        """Stop everything of this sidecar (its broker disconnects first). Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.broker is not None:
            await self.broker.disconnect()
        await self.services.close()


async def settle(
    clock: ManualClock, until: Callable[[], bool], seconds: float = 10.0, step: float = 0.1
) -> None:
    """Advance ``clock`` ``step`` at a time until ``until()`` holds; fail after ``seconds``."""
    waited = 0.0
    while not until():
        assert waited < seconds, f"condition not reached within {seconds}s of clock time"
        await clock.run_for(step)
        waited += step


class Harness:
    """A cluster of in-process sidecars on shared memory adapters and one manual clock."""

    def __init__(
        self,
        *,
        seed: int = 7,
        timing: Timing | None = None,
        assignment: AssignmentConfig | None = None,
        split_config: SplitConfig | None = None,
        default_bundles: int = 4,
        config: SidecarConfig | None = None,
    ) -> None:
        """``config`` (default: the defaults) is every sidecar's configuration, its timings,
        assignment, split config and default bundles replaced by the other arguments."""
        self.clock = ManualClock()
        self.metadata = MemoryMetadataCluster(self.clock)
        self.log = MemoryLog()
        self.broker_load = MemoryLoadTopic()
        self.top_bundles = MemoryLoadTopic()
        self.checkpoints = MemoryCheckpointStore()
        self.timing = timing or Timing()
        self.config = dataclasses.replace(
            config or SidecarConfig(),
            timings=self.timing.timings(),
            assignment=assignment or AssignmentConfig(),
            split=split_config or SplitConfig(),
            default_namespace_bundles=default_bundles,
        )
        self.deaths: list[tuple[str, BaseException]] = []
        """Vital tasks of any sidecar that died (each test's harness expects none)."""
        self.sidecars: dict[BrokerId, Sidecar] = {}
        self.events: list[BrokerEvent] = []
        """Every command fake brokers received, in order."""
        self.violations: list[str] = []
        """Each time a broker was told to own a range another broker was serving."""
        self._seed = seed

    async def __aenter__(self) -> Harness:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every sidecar; fail if a vital task of one died meanwhile."""
        for sidecar in list(self.sidecars.values()):
            await sidecar.close()
        assert not self.deaths, f"vital tasks died: {self.deaths}"

    def __getitem__(self, broker: str) -> Sidecar:
        return self.sidecars[BrokerId(broker)]

    async def add(
        self,
        broker: str,
        *,
        auto_ack: bool = True,
        fake_broker: bool = False,
        ack_own: bool | None = True,
        ack_release: bool | None = True,
        version: str = "1.0",
        channel: MemoryChannelLog | None = None,
    ) -> Sidecar:
        """Build and start a sidecar for ``broker``; with ``fake_broker``, attach a FakeBroker.

        Every sidecar ensures the default namespace (``public/default``), as ``lbd serve`` does.
        ``channel`` (default: a client of the shared log) is its state channel client.
        """
        me = BrokerId(broker)
        info = BrokerInfo(
            me,
            service_url=f"pulsar://{broker}:6650",
            web_service_url=f"http://{broker}:8080",
            version=version,
            start_time_ms=self.clock.now_ms(),
            sidecar_grpc_addr=f"{broker}:7000",
        )
        policy = SessionPolicy(self.timing.lease_ttl_s, self.timing.keepalive_interval_s)
        ports = SidecarPorts(
            metadata=MemoryMetadataStore(self.metadata, policy),
            channel=channel or MemoryChannelLog(self.log),
            broker_loads=MemoryLoadStore(self.broker_load, self.clock),
            top_bundles=MemoryLoadStore(self.top_bundles, self.clock),
            checkpoints=self.checkpoints,
        )
        services = build_sidecar(
            info,
            ports,
            dataclasses.replace(self.config, auto_ack=auto_ack),
            self.clock,
            random.Random(self._seed + len(self.sidecars)),
            host=IdleHost(),
            on_death=lambda name, error: self.deaths.append((name, error)),
        )
        sidecar = Sidecar(services)
        self.sidecars[me] = sidecar
        async with asyncio.timeout(WAIT_S):
            await services.start()
        if fake_broker:
            sidecar.broker = FakeBroker(info, self, ack_own=ack_own, ack_release=ack_release)
            await sidecar.broker.connect(services.link)
        return sidecar

    async def start(
        self, count: int, *, auto_ack: bool = True, fake_broker: bool = False
    ) -> list[Sidecar]:
        """Add ``count`` sidecars ``broker-0``... and wait until all see all."""
        sidecars = [
            await self.add(f"broker-{i}", auto_ack=auto_ack, fake_broker=fake_broker)
            for i in range(count)
        ]
        await self.ready()
        return sidecars

    async def ready(self) -> None:
        """Wait until every registry sees every sidecar whose broker should be registered."""
        expected = {
            me
            for me, s in self.sidecars.items()
            if not s.closed and (s.link.auto_ack or s.link.attached)
        }
        async with asyncio.timeout(WAIT_S):
            for sidecar in self.live():
                await sidecar.registry.wait_for(expected)

    def elected_now(self) -> Sidecar:
        """The live sidecar whose elector leads now (AssertionError: none does)."""
        found = next((s for s in self.live() if s.elector.is_leader), None)
        assert found is not None, "no live sidecar leads"
        return found

    async def elected(self, within_s: float = 10.0) -> Sidecar:
        """The live sidecar whose elector leads, once one does (the clock runs meanwhile); the
        leader duties may still be starting: :meth:`leader` waits for them too."""
        await settle(self.clock, lambda: any(s.elector.is_leader for s in self.live()), within_s)
        return self.elected_now()

    async def leader(self, within_s: float = 10.0) -> Sidecar:
        """The sidecar running the leader duties, once one does (the clock runs meanwhile)."""

        def leading() -> Sidecar | None:
            return next((s for s in self.live() if s.tracker.leading), None)

        await settle(self.clock, lambda: leading() is not None, within_s)
        found = leading()
        assert found is not None
        return found

    async def admin_move(
        self, bundle: BundleId, dst: BrokerId | None = None, within_s: float = 30.0
    ) -> BrokerId:
        """An admin Transfer (to ``dst``) or Unload of ``bundle`` as the API runs it, on the
        leader (:meth:`~lbd.services.leader.tracker.OperationTracker.admin_move`), while the
        clock runs; the bundle's source broker, or the move's error."""
        leader = await self.leader()
        moving = asyncio.ensure_future(leader.tracker.admin_move(bundle, dst))
        try:
            for _ in range(5):
                await asyncio.sleep(0)
            await settle(self.clock, moving.done, within_s)
        finally:
            moving.cancel()
        return moving.result()

    def live(self) -> list[Sidecar]:
        """The sidecars not closed."""
        return [s for s in self.sidecars.values() if not s.closed]

    async def idle(self) -> None:
        """Wait until every follower applied the whole log and no reactor has work left."""
        async with asyncio.timeout(WAIT_S):
            while True:
                if self.log.messages:
                    last = self.log.messages[-1].position
                    for sidecar in self.live():
                        await sidecar.follower.wait_applied(last)
                for sidecar in self.live():
                    await sidecar.reactor.idle()
                for _ in range(5):
                    await asyncio.sleep(0)
                settled = not self.log.messages or all(
                    s.follower.table.last_position == self.log.messages[-1].position
                    for s in self.live()
                )
                if settled and not any(s.reactor.busy for s in self.live()):
                    return

    def owner(self, bundle: BundleId) -> BrokerId | None:
        """The owner of ``bundle`` in the first live sidecar's table (None unless Owned)."""
        return owner_of(self.live()[0].follower.get(bundle))

    def kinds(self, bundle: BundleId) -> list[tuple[BrokerId, str]]:
        """The (broker, kind) of every broker event about ``bundle``, in order."""
        return [(e.broker, e.kind) for e in self.events if e.bundle == bundle]

    def _record(self, event: BrokerEvent) -> None:
        self.events.append(event)

    def _check_exclusive(self, broker: BrokerId, bundle: BundleId) -> None:
        wanted = parse_bundle_id(bundle)
        for sidecar in self.sidecars.values():
            other = sidecar.broker
            if other is None or other.id == broker or not other.may_serve():
                continue
            for served in other.serving:
                have = parse_bundle_id(served)
                overlap = (
                    have.namespace == wanted.namespace
                    and have.range.lo < wanted.range.hi
                    and wanted.range.lo < have.range.hi
                )
                if overlap:
                    self.violations.append(
                        f"{broker} told to own {bundle} while {other.id} serves {served}"
                    )
