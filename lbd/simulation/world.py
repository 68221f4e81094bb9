"""A simulated world: real sidecars under one virtual clock, with faults chosen by a seed.

Every sidecar is built by :func:`lbd.services.graph.build_sidecar`, the wiring ``lbd serve`` uses,
on the in-memory ports (one "etcd", one state channel, one pair of load topics), and each holds a
session with a simulated broker that obeys the broker contract, serving lease included. One
``random.Random(seed)`` makes every choice (the brokers, the faults, their times, the sidecars'
own random numbers), and time is a :class:`~lbd.adapters.clock.ManualClock` moved only by the
world, so a seed always gives the same run: :attr:`World.trace` is the same, line for line.

Faults, at random times in the first two thirds of the run:

- a sidecar paused (its clock, its channel reads and writes and its broker's messages wait; its
  etcd session gets no renewal through, as for a frozen process) and resumed;
- a sidecar isolated: running, its broker attached, but cut off from etcd and the channel;
- a broker paused (it answers nothing, asks for no lease; its own clock runs on);
- etcd unreachable for everyone, or for one sidecar only;
- the channel unavailable for everyone;
- an admin Transfer or Unload.

Invariants: at no instant do two brokers serve one bundle (checked whenever a broker starts to
serve one, against every other broker's serving set and lease); once the faults stop, every bundle
that was ever Owned is Owned by a registered broker within the orphan bound, and every sidecar's
table is the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from lbd.adapters.clock import ManualClock
from lbd.adapters.memory.channel import MemoryChannelLog, MemoryLog
from lbd.adapters.memory.checkpoint import MemoryCheckpointStore
from lbd.adapters.memory.loadstore import MemoryLoadStore, MemoryLoadTopic
from lbd.adapters.memory.metadata import MemoryMetadataCluster, MemoryMetadataStore
from lbd.adapters.session import SessionPolicy
from lbd.core.broker import (
    BrokerInfo,
    BrokerMessage,
    CloseCommand,
    CommandAck,
    Hello,
    OwnCommand,
    ReleaseCommand,
    ServingLease,
    SidecarMessage,
)
from lbd.core.errors import LbdError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.lease import BrokerLease
from lbd.core.load import BrokerUsage, ResourceUsage
from lbd.core.state import ServiceUnitState, owner_of
from lbd.core.table import ChannelPosition
from lbd.core.tuning import MonitorConfig, SidecarConfig, SidecarTimings
from lbd.ports.channel import ChannelMessage
from lbd.services import graph
from lbd.services.graph import SidecarPorts, build_sidecar

_S = ServiceUnitState
_HELD = (
    "pause-sidecar",
    "isolate-sidecar",
    "pause-broker",
    "etcd-down",
    "etcd-cut-one",
    "channel-down",
)
"""Faults that hold for a while (the others are one admin call)."""

TIMINGS = SidecarTimings(
    own_ack_timeout_s=3.0,
    release_ack_timeout_s=3.0,
    settle_timeout_s=10.0,
    fence_after_s=3.0,
    fence_check_interval_s=0.5,
    retry_s=0.5,
    serving_lease_s=2.0,
    lease_margin_s=1.0,
    silence_timeout_s=6.0,
)
"""The dev cluster's short timings: a run of ten virtual minutes sees many leases and graces."""
LEASE_TTL_S = 3
KEEPALIVE_S = 0.8
CONFIG = SidecarConfig(
    timings=TIMINGS,
    monitor=MonitorConfig(
        interval_s=1.0, inflight_timeout_s=8.0, tombstone_after_s=3600.0, orphan_cleanup_grace_s=7.0
    ),
    shedding_interval_s=10**9,
    split_interval_s=10**9,
    checkpoint_interval_s=10**9,
    load_report_interval_s=5.0,
    default_namespace_bundles=8,
)
STEP_S = 0.25
"""How far the world moves the clock at a time."""
TURNS = 20
"""Event-loop turns after each step: in-process work settles within a few."""
ORPHAN_BOUND_S = LEASE_TTL_S + 7.0 + TIMINGS.handover_wait_s + 2 * CONFIG.monitor.interval_s + 10.0
"""A gone broker's bundles are Owned again within this (with time for a lookup to assign a freed
one)."""


@dataclass(frozen=True, slots=True)
class WorldSpec:
    """One simulated run."""

    seed: int
    virtual_s: float = 600.0
    mean_fault_gap_s: float = 20.0
    brokers: int | None = None
    """3 to 5, chosen by the seed when None."""
    lease_off: bool = False
    """Mutation: brokers ignore their serving lease (the simulation must then find dual serving)."""
    faults: tuple[str, ...] = ()
    """Only these kinds of fault (all when empty): see :data:`FAULTS`."""
    timings: SidecarTimings = TIMINGS
    orphan_grace_s: float = 7.0
    """``monitor.orphan_cleanup_grace_s`` (the dev cluster's)."""


FAULTS = (
    "pause-sidecar",
    "isolate-sidecar",
    "pause-broker",
    "etcd-down",
    "etcd-cut-one",
    "channel-down",
    "transfer",
    "unload",
)


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault of a schedule: at ``at_s`` (virtual seconds from the start), ``kind`` hits the
    ``node``-th broker (by id order) for ``duration_s``."""

    at_s: float
    kind: str
    node: int
    duration_s: float

    def __str__(self) -> str:
        return f"{self.kind}@{self.at_s:.1f}s(node {self.node}, {self.duration_s:.1f}s)"


def schedule(spec: WorldSpec) -> tuple[int, tuple[Fault, ...]]:
    """The brokers and the faults of ``spec``'s seed (its own random stream, so a schedule with
    faults removed runs the rest of the world the same way)."""
    rng = random.Random(f"schedule-{spec.seed}")
    brokers = spec.brokers or rng.randint(3, 5)
    kinds = spec.faults or FAULTS
    faults: list[Fault] = []
    at = rng.expovariate(1.0 / spec.mean_fault_gap_s)
    while at < spec.virtual_s * 2 / 3:
        fault = Fault(at, rng.choice(kinds), rng.randrange(brokers), rng.uniform(1.0, 30.0))
        faults.append(fault)
        at += rng.expovariate(1.0 / spec.mean_fault_gap_s)
    return brokers, tuple(faults)


@dataclass(slots=True)
class Outcome:
    """What a run found."""

    seed: int
    faults: tuple[Fault, ...] = ()
    violations: list[str] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every invariant held."""
        return not self.violations


class _Gate:
    """Closed while its sidecar is paused: everything of the sidecar waits at it."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._pauses = 0

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def pause(self) -> None:
        self._pauses += 1
        self._open.clear()

    def resume(self, *, all_: bool = False) -> None:
        self._pauses = 0 if all_ else max(0, self._pauses - 1)
        if self._pauses == 0:
            self._open.set()

    async def wait(self) -> None:
        await self._open.wait()


class _GatedClock:
    """The world's clock as a paused sidecar sees it: time runs on, but no sleep ends while it is
    paused."""

    def __init__(self, clock: ManualClock, gate: _Gate) -> None:
        self._clock = clock
        self._gate = gate

    def now_ms(self) -> int:
        return self._clock.now_ms()

    def monotonic(self) -> float:
        return self._clock.monotonic()

    async def sleep(self, seconds: float) -> None:
        await self._clock.sleep(seconds)
        await self._gate.wait()


class _GatedChannel:
    """A sidecar's channel client that neither reads nor writes while it is paused."""

    def __init__(self, inner: MemoryChannelLog, gate: _Gate) -> None:
        self._inner = inner
        self._gate = gate

    async def publish(self, key: str, value: bytes) -> ChannelPosition:
        await self._gate.wait()
        return await self._inner.publish(key, value)

    async def follow(self, after: ChannelPosition | None) -> AsyncGenerator[ChannelMessage, None]:
        async with contextlib.aclosing(self._inner.follow(after)) as messages:
            async for message in messages:
                await self._gate.wait()
                yield message

    async def catch_up(self, after: ChannelPosition | None) -> AsyncGenerator[ChannelMessage, None]:
        await self._gate.wait()
        async with contextlib.aclosing(self._inner.catch_up(after)) as messages:
            async for message in messages:
                await self._gate.wait()
                yield message

    async def close(self) -> None:
        await self._inner.close()


class _SimulatedHost:
    """The host a sidecar measures while its broker sends no load report: a CPU load that wanders
    with the world's seed (never the machine the simulation runs on)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._cpu = rng.uniform(10.0, 60.0)

    def sample(self, now_s: float) -> BrokerUsage:
        self._cpu = min(95.0, max(1.0, self._cpu + self._rng.uniform(-5.0, 5.0)))
        return BrokerUsage(cpu=ResourceUsage(self._cpu, 100.0))


class SimulatedBroker:
    """A broker that obeys the contract: it serves what it is told to Own while its serving lease
    is valid, acknowledges every command, and forgets everything when its lease runs out."""

    def __init__(self, world: World, info: BrokerInfo, gate: _Gate) -> None:
        self.info = info
        self.serving: set[BundleId] = set()
        self.lease = BrokerLease()
        self.paused = False
        self._world = world
        self._gate = gate
        self._outgoing: asyncio.Queue[BrokerMessage | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def id(self) -> BrokerId:
        return self.info.broker_id

    def serves(self, bundle: BundleId) -> bool:
        """Whether it serves ``bundle`` now: told to own it, and (unless the lease is switched
        off) its lease still valid."""
        if bundle not in self.serving:
            return False
        return self._world.spec.lease_off or self.lease.valid(self._world.clock.monotonic())

    def start(self, session: Callable[[AsyncIterator[BrokerMessage]], Any]) -> None:
        self._outgoing = asyncio.Queue()
        self._outgoing.put_nowait(Hello(self.info))
        self.lease = BrokerLease()
        self._tasks = [
            asyncio.create_task(self._run(session), name=f"sim-broker-{self.id}"),
            asyncio.create_task(self._keep_lease(), name=f"sim-lease-{self.id}"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self.serving.clear()

    async def _incoming(self) -> AsyncIterator[BrokerMessage]:
        while (message := await self._outgoing.get()) is not None:
            await self._gate.wait()  # a paused sidecar reads nothing
            yield message

    async def _run(self, session: Callable[[AsyncIterator[BrokerMessage]], Any]) -> None:
        with contextlib.suppress(LbdError):
            async with contextlib.aclosing(session(self._incoming())) as commands:
                async for message in commands:
                    await self._gate.wait()  # nor does it send anything
                    self._handle(message)
        self.serving.clear()  # the session ended: it serves nothing

    async def _keep_lease(self) -> None:
        clock = self._world.clock
        while True:
            if not self.paused:
                self._outgoing.put_nowait(self.lease.request(clock.monotonic()))
            await clock.sleep(TIMINGS.serving_lease_s / 4)
            if self.paused or self._world.spec.lease_off:
                continue
            if self.lease.lapse_if_due(clock.monotonic()) and self.serving:
                self._world.note(f"{self.id} lease ran out; serves nothing")
                self.serving.clear()

    def _handle(self, message: SidecarMessage) -> None:
        if self.paused:
            return  # read on resume, too late to matter: lost
        command = message.command
        match command:
            case ServingLease():
                self.lease.grant(command, self._world.clock.monotonic())
                return
            case OwnCommand(bundle=bundle):
                self._world.starts_serving(self, bundle)
                self.serving.add(bundle)
            case ReleaseCommand(bundle=bundle) | CloseCommand(bundle=bundle):
                self.serving.discard(bundle)
        self._outgoing.put_nowait(CommandAck(message.command_id, ok=True))


@dataclass(slots=True)
class _Node:
    sidecar: graph.Sidecar
    broker: SimulatedBroker
    gate: _Gate
    """Closed while the sidecar is paused: its clock and its broker's stream."""
    channel_gate: _Gate
    """Closed while it is paused or isolated: its channel reads and writes."""
    metadata: MemoryMetadataStore


class World:
    """One seeded run; :meth:`run` returns its :class:`Outcome`."""

    def __init__(self, spec: WorldSpec, faults: tuple[Fault, ...] | None = None) -> None:
        """``faults``: the schedule to run (default: the seed's own, :func:`schedule`)."""
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.clock = ManualClock()
        self._brokers, seeded = schedule(spec)
        self.faults = seeded if faults is None else faults
        self.outcome = Outcome(spec.seed, self.faults)
        self._metadata = MemoryMetadataCluster(self.clock)
        self._log = MemoryLog()
        self._loads = MemoryLoadTopic()
        self._tops = MemoryLoadTopic()
        self._checkpoints = MemoryCheckpointStore()
        self._nodes: dict[BrokerId, _Node] = {}
        self._ever_owned: set[BundleId] = set()
        self._held: dict[tuple[str, str], int] = {}

    def note(self, line: str) -> None:
        """Add a line to the trace, stamped with the virtual time."""
        self.outcome.trace.append(f"{self.clock.monotonic() - 1000.0:9.2f} {line}")

    def starts_serving(self, broker: SimulatedBroker, bundle: BundleId) -> None:
        """The invariant, checked as ``broker`` starts serving ``bundle``."""
        for other in self._nodes.values():
            if other.broker is not broker and other.broker.serves(bundle):
                problem = f"{broker.id} told to own {bundle} while {other.broker.id} serves it"
                self.note(f"VIOLATION {problem}")
                self.outcome.violations.append(problem)
        self.note(f"{broker.id} owns {bundle}")

    async def run(self) -> Outcome:
        """Run the world for ``virtual_s`` of virtual time; the outcome."""
        try:
            for n in range(self._brokers):
                await self._add(BrokerId(f"broker-{n + 1}"))
            await self._run_for(5.0)
            await self._assign_bundles()
            running: list[asyncio.Task[None]] = []
            for fault in self.faults:
                await self._run_for(max(0.0, fault.at_s - self._now()))
                running.append(asyncio.ensure_future(self._fault(fault)))
            while not all(task.done() for task in running):
                await self._run_for(STEP_S)
            for task in running:
                task.result()
            await self._heal()
            await self._run_for(max(ORPHAN_BOUND_S, self.spec.virtual_s - self._now()))
            self._check_converged()
        finally:
            for node in self._nodes.values():
                await node.broker.stop()
            for node in reversed(list(self._nodes.values())):
                node.gate.resume(all_=True)
                node.channel_gate.resume(all_=True)
                await node.sidecar.close()
        return self.outcome

    # -- building ----------------------------------------------------------------------------

    async def _add(self, me: BrokerId) -> None:
        gate, channel_gate = _Gate(), _Gate()
        info = BrokerInfo(me, service_url=f"pulsar://{me}:6650", start_time_ms=self.clock.now_ms())
        metadata = MemoryMetadataStore(self._metadata, SessionPolicy(LEASE_TTL_S, KEEPALIVE_S))
        clock = _GatedClock(self.clock, gate)
        ports = SidecarPorts(
            metadata=metadata,
            channel=_GatedChannel(MemoryChannelLog(self._log), channel_gate),
            broker_loads=MemoryLoadStore(self._loads, self.clock),
            top_bundles=MemoryLoadStore(self._tops, self.clock),
            checkpoints=self._checkpoints,
        )
        sidecar = build_sidecar(
            info,
            ports,
            dataclasses.replace(
                CONFIG,
                auto_ack=False,
                timings=self.spec.timings,
                monitor=dataclasses.replace(
                    CONFIG.monitor, orphan_cleanup_grace_s=self.spec.orphan_grace_s
                ),
            ),
            clock,
            random.Random(self.rng.getrandbits(64)),
            host=_SimulatedHost(random.Random(self.rng.getrandbits(64))),
            on_death=lambda name, error: self._died(me, name, error),
        )
        await sidecar.start()
        broker = SimulatedBroker(self, info, gate)
        broker.start(sidecar.link.session)
        self._nodes[me] = _Node(sidecar, broker, gate, channel_gate, metadata)
        self.note(f"{me} up")

    def _died(self, me: BrokerId, name: str, error: BaseException) -> None:
        problem = f"{me}: vital task {name} died: {error!r}"
        self.note(f"VIOLATION {problem}")
        self.outcome.violations.append(problem)

    async def _assign_bundles(self) -> None:
        first = next(iter(self._nodes.values())).sidecar
        record = await first.namespaces.refresh(graph.DEFAULT_NAMESPACE)
        assigns = []
        for n, bundle in enumerate(record.bundles().bundles()):
            node = list(self._nodes.values())[n % len(self._nodes)]
            assigns.append(node.sidecar.operations.assign(bundle.id, node.sidecar.me))
            self._ever_owned.add(bundle.id)
        await self._while_time_runs(assigns)
        await self._run_for(2.0)

    # -- time ------------------------------------------------------------------------------

    def _now(self) -> float:
        return self.clock.monotonic() - 1000.0

    async def _while_time_runs(self, calls: Sequence[Coroutine[Any, Any, object]]) -> None:
        """Run ``calls`` one after the other while the clock moves on; a call that fails is
        what a client would see, not a violation."""

        async def in_turn() -> None:
            for call in calls:
                with contextlib.suppress(LbdError):
                    await call

        task = asyncio.ensure_future(in_turn())
        while not task.done():
            await self._run_for(STEP_S)
        task.result()

    async def _run_for(self, seconds: float) -> None:
        end = self.clock.monotonic() + seconds
        while self.clock.monotonic() < end:
            self.clock.advance(min(STEP_S, end - self.clock.monotonic()))
            for _ in range(TURNS):
                await asyncio.sleep(0)

    # -- faults ----------------------------------------------------------------------------

    async def _fault(self, fault: Fault) -> None:
        kind, duration = fault.kind, fault.duration_s
        node = self._nodes[sorted(self._nodes)[fault.node % len(self._nodes)]]
        self.note(f"fault {kind} {node.broker.id} for {duration:.1f}s")
        if kind in _HELD:
            target = "" if kind in ("etcd-down", "channel-down") else node.broker.id
            self._hold(kind, target, +1)
            await self.clock.sleep(duration)
            self._hold(kind, target, -1)
        else:
            await self._admin(kind, node, random.Random(f"{self.spec.seed}-{fault}"))
        self.note(f"fault {kind} {node.broker.id} over")

    def _hold(self, kind: str, target: str, change: int) -> None:
        """Count one more (or one less) fault of ``kind`` on ``target``, and apply whether any
        is in force: overlapping faults of one kind end only when the last of them does."""
        key = (kind, target)
        self._held[key] = self._held.get(key, 0) + change
        on = self._held[key] > 0
        node = self._nodes.get(BrokerId(target)) if target else None
        if kind == "etcd-down":
            self._metadata.set_reachable(not on)
        elif kind == "channel-down":
            if on:
                self._log.go_down()
            else:
                self._log.come_back()
        elif node is not None and kind == "pause-broker":
            node.broker.paused = on
        elif node is not None:
            # A paused sidecar gets no renewal through either: it shares the cut-off.
            paused = self._held.get(("pause-sidecar", target), 0) > 0
            isolated = self._held.get(("isolate-sidecar", target), 0) > 0
            cut = paused or isolated or self._held.get(("etcd-cut-one", target), 0) > 0
            node.metadata.set_cut_off(cut)
            for gate, closed in ((node.gate, paused), (node.channel_gate, paused or isolated)):
                if closed:
                    gate.pause()
                else:
                    gate.resume(all_=True)

    async def _admin(self, kind: str, via: _Node, rng: random.Random) -> None:
        owned = sorted(
            (b, o) for b, v in via.sidecar.follower.table.items() if (o := owner_of(v)) is not None
        )
        if not owned:
            return
        bundle, owner = rng.choice(owned)
        others = sorted(b for b in self._nodes if b != owner)
        operation = via.sidecar.operations
        call = (
            operation.transfer(bundle, rng.choice(others))
            if kind == "transfer"
            else operation.unload(bundle)
        )
        with contextlib.suppress(LbdError):
            await call
        if kind == "unload":
            with contextlib.suppress(LbdError):
                await via.sidecar.operations.assign(bundle, via.sidecar.me)

    async def _heal(self) -> None:
        self._held.clear()
        self._metadata.set_reachable(True)
        self._log.come_back()
        for node in self._nodes.values():
            node.metadata.set_cut_off(False)
            node.gate.resume(all_=True)
            node.channel_gate.resume(all_=True)
            node.broker.paused = False
        self.note("faults over")
        # Clients look their topics up again: an unloaded bundle (Free) is assigned anew.
        await self._run_for(2.0)
        nodes = list(self._nodes.values())
        lookups = []
        for n, bundle in enumerate(sorted(self._ever_owned)):
            value = nodes[0].sidecar.follower.get(bundle)
            if value is None or value.state in (_S.Free, _S.Init):
                lookups.append(nodes[n % len(nodes)].sidecar.operations.assign(bundle))
        await self._while_time_runs(lookups)

    # -- the end ---------------------------------------------------------------------------

    def _check_converged(self) -> None:
        live = [n for n in self._nodes.values()]
        tables = {n.broker.id: dict(n.sidecar.follower.table.items()) for n in live}
        first = next(iter(tables.values()))
        for broker, table in tables.items():
            if table != first:
                self._violate(f"{broker}'s table differs from the others'")
        registered = set(next(iter(live)).sidecar.registry.brokers())
        for bundle in sorted(self._ever_owned):
            value = first.get(bundle)
            owner = owner_of(value)
            if value is not None and value.state is _S.Deleted:
                continue
            if owner is None or owner not in registered:
                state = "Init" if value is None else value.state.value
                self._violate(f"{bundle} not Owned by a registered broker at the end: {state}")
            elif not self._nodes[owner].broker.serves(bundle):
                self._violate(f"{bundle} Owned by {owner}, which does not serve it")

    def _violate(self, problem: str) -> None:
        self.note(f"VIOLATION {problem}")
        self.outcome.violations.append(problem)


def run_seed(spec: WorldSpec, faults: tuple[Fault, ...] | None = None) -> Outcome:
    """Run one world in a fresh event loop (deterministic: nothing else runs on it)."""
    return asyncio.run(World(spec, faults).run())


def shrink(spec: WorldSpec, outcome: Outcome) -> Outcome:
    """The failing ``outcome`` of ``spec`` with as few faults as still fail: faults are dropped
    one at a time, each drop kept when the run still violates an invariant."""
    best = outcome
    changed = True
    while changed:
        changed = False
        for n in range(len(best.faults)):
            fewer = best.faults[:n] + best.faults[n + 1 :]
            tried = run_seed(spec, fewer)
            if not tried.ok:
                best, changed = tried, True
                break
    return best
