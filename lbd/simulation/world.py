"""A simulated world: real sidecars under virtual time, with faults chosen by a seed.

Every sidecar is built by :func:`lbd.services.graph.build_sidecar`, the wiring ``lbd serve`` uses,
on the in-memory ports (one "etcd", one state channel, one pair of load topics, one checkpoint
store), and each holds a session with a simulated broker that obeys the broker contract, serving
lease included. One ``random.Random(seed)`` makes every choice (the brokers, the faults, their
times, the hosts' clock rates, the sidecars' own random numbers), and time is a
:class:`~lbd.adapters.clock.ManualClock` that the event loop of :mod:`lbd.simulation.loop` moves
from deadline to deadline, so a seed always gives the same run: :attr:`Outcome.trace` is the same,
line for line.

Faults (:data:`FAULTS`), at random times in the first two thirds of the run, overlapping: a
sidecar paused, isolated, crashed and restarted, or cut off etcd or the channel alone; a broker
paused; etcd or the channel down for everyone; the channel delivering its last messages again;
brokers joining and leaving; a topic's load swinging up (the split scheduler and the shedder act on
what the brokers report); admin Transfer, Unload and Split; a drain of a broker (cordoned, its
bundles moved off under the execution governor, uncordoned when the fault ends); a plan made and
executed by the leader, sometimes cancelled halfway.

Invariants, checked as the world runs against the channel itself: no two brokers serve one bundle
or overlapping ones at one instant; a broker serves only what the channel names it server of;
versions only grow (and survive a crash); no vital task dies and none outlives its component; and
once the faults stop, every bundle is Owned by a registered broker that serves it within the orphan
bound, with every sidecar's table equal to the channel's. See docs/simulation.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from lbd.adapters.clock import ManualClock
from lbd.adapters.memory.channel import MemoryChannelLog
from lbd.adapters.memory.checkpoint import MemoryCheckpointStore
from lbd.adapters.memory.loadstore import MemoryLoadStore, MemoryLoadTopic
from lbd.adapters.memory.metadata import MemoryMetadataCluster, MemoryMetadataStore
from lbd.adapters.session import SessionPolicy
from lbd.core.broker_info import (
    BrokerInfo,
)
from lbd.core.bundles import Bundle, SplitAlgorithm, parse_bundle_id
from lbd.core.errors import LbdError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.state import ServiceUnitState, owner_of, server_of
from lbd.core.table import ChannelPosition, StateTable
from lbd.services import graph
from lbd.services.graph import SidecarPorts, build_sidecar
from lbd.simulation import loop
from lbd.simulation.broker import SimulatedBroker
from lbd.simulation.hosts import (
    Gate,
    GatedChannel,
    HostClock,
    SimulatedHost,
    WatchedLog,
)
from lbd.simulation.schedule import (
    CLUSTER_WIDE,
    CONFIG,
    HELD,
    KEEPALIVE_S,
    LEASE_TTL_S,
    LOOKUP_ATTEMPTS,
    MAX_BROKERS,
    MAX_DRIFT,
    MAX_VIOLATIONS,
    MIN_BROKERS,
    ORPHAN_BOUND_S,
    Fault,
    Outcome,
    WorldSpec,
    schedule,
)
from lbd.tasks import tasks_outliving
from lbd.workload.traffic import HashedTopicTraffic

_S = ServiceUnitState


@dataclass(slots=True)
class _Node:
    """One host: a sidecar incarnation and its broker."""

    sidecar: graph.Sidecar
    broker: SimulatedBroker
    gate: Gate
    """Closed while the sidecar is paused: its clock and its broker's stream."""
    channel_gate: Gate
    """Closed while it is paused, isolated or cut off the channel: its channel reads and
    writes."""
    metadata: MemoryMetadataStore
    rate: float
    """Its host clock's rate."""
    up: bool = False
    """Started, and neither crashed nor gone since (faults pick only hosts that are up)."""


class World:
    """One seeded run; :meth:`run` returns its :class:`Outcome`."""

    def __init__(
        self, spec: WorldSpec, faults: tuple[Fault, ...] | None = None, *, trace: bool = True
    ) -> None:
        """``faults``: the schedule to run (default: the seed's own, :func:`schedule`);
        ``trace``: keep the trace (a run without it finds the same violations, faster)."""
        self.spec = spec
        self._tracing = trace
        self.lease_off = spec.mutation == "lease-off"
        self.rng = random.Random(spec.seed)
        self.clock = ManualClock()
        self._brokers, seeded = schedule(spec)
        self.faults = seeded if faults is None else faults
        self.outcome = Outcome(spec.seed, self.faults)
        self._metadata = MemoryMetadataCluster(self.clock)
        self._log = WatchedLog(self._on_append)
        self._truth = StateTable()
        """The channel as a reader that misses nothing sees it, at every instant."""
        self._loads = MemoryLoadTopic()
        self._tops = MemoryLoadTopic()
        self._checkpoints = MemoryCheckpointStore()
        self._nodes: dict[BrokerId, _Node] = {}
        self._gone: dict[BrokerId, _Node] = {}
        self._ever_owned: set[BundleId] = set()
        self._held: dict[tuple[str, str], int] = {}
        self._starting: set[BrokerId] = set()
        self._joining: set[BrokerId] = set()
        self._bundle_ids: dict[BundleId, Bundle] = {}
        self.traffic = HashedTopicTraffic(random.Random(f"traffic-{spec.seed}"))

    def note(self, line: str) -> None:
        """Add a line to the trace, stamped with the virtual time."""
        if self._tracing:
            self.outcome.trace.append(f"{self.clock.monotonic() - 1000.0:9.2f} {line}")

    # -- invariants --------------------------------------------------------------------------

    def starts_serving(self, broker: SimulatedBroker, bundle: BundleId) -> None:
        """Checked as ``broker`` is told to own ``bundle`` (when it holds a valid lease: without
        one it serves nothing yet, and :meth:`check_broker` looks again once it has one): nobody
        else serves it or a bundle whose range overlaps it, and the channel names ``broker`` its
        server."""
        self.note(f"{broker.id} owns {bundle}")
        self._check_alone(broker, bundle)

    def _check_alone(self, broker: SimulatedBroker, bundle: BundleId) -> None:
        if not broker.serves(bundle):
            return
        mine = self._parsed(bundle)
        for other in self._nodes.values():
            if other.broker is broker:
                continue
            for theirs in other.broker.serving:
                if mine.overlaps(self._parsed(theirs)) and other.broker.serves(theirs):
                    what = "it" if theirs == bundle else f"the overlapping {theirs}"
                    self._violate(
                        f"{broker.id} told to own {bundle} while {other.broker.id} serves {what}"
                    )
        self._check_serving(broker, bundle)

    def _parsed(self, bundle: BundleId) -> Bundle:
        """``bundle`` parsed once (the check runs at every Own and lease)."""
        found = self._bundle_ids.get(bundle)
        if found is None:
            found = self._bundle_ids[bundle] = parse_bundle_id(bundle)
        return found

    def check_broker(self, broker: SimulatedBroker) -> None:
        """Checked as ``broker`` gets a serving lease again: every bundle it serves is its own
        by the channel, and nobody else serves it."""
        for bundle in sorted(broker.serving):
            self._check_alone(broker, bundle)

    def _check_serving(self, broker: SimulatedBroker, bundle: BundleId) -> None:
        if not broker.serves(bundle):
            return
        value = self._truth.get(bundle)
        server = server_of(value)
        if server == broker.id or self._truth.splitting_into(broker.id, bundle):
            return
        if value is not None and value.state is _S.Deleted and value.source_broker == broker.id:
            return  # a split parent: its children, all this broker's, cover it
        state = "Init" if value is None else value.state.value
        self._violate(f"{broker.id} serves {bundle} while the channel says {state} {server}")

    def _on_append(self, position: ChannelPosition, key: str, value: bytes) -> None:
        """Every message the channel takes: versions only grow, and no broker but the new
        value's server serves the bundle from this instant on."""
        result = self._truth.apply(position, BundleId(key), value)
        if not result.changed:
            return
        old, new = result.old, result.new
        if old is not None and new is not None and new.version_id <= old.version_id:
            self._violate(f"{key}: version went from {old.version_id} to {new.version_id}")
        if new is None or new.state in (_S.Deleted, _S.Splitting):
            return
        if new.state is _S.Owned:
            self._ever_owned.add(result.key)
        for node in self._nodes.values():
            self._check_serving(node.broker, result.key)

    def _tally(self, node: _Node) -> None:
        """Add what ``node``'s sidecar did on its own to the outcome (before it goes)."""
        counts = self.outcome.balancing
        metrics = node.sidecar.metrics
        for metric, key in (
            (metrics.split_total, "scheduled_splits"),
            (metrics.unload_total, "shed"),
        ):
            for family in metric.collect():
                for sample in family.samples:
                    labels = sample.labels
                    if (
                        sample.name.endswith("_total")
                        and labels.get("result") == "Success"
                        and labels.get("reason") != "Admin"
                    ):
                        counts[key] = counts.get(key, 0) + int(sample.value)

    def _died(self, me: BrokerId, name: str, error: BaseException) -> None:
        if me in self._starting:
            # The sidecar's start fails with it (as `lbd serve` exits, for a supervisor).
            self.note(f"{me}: {name} ended the start: {error!r}")
            return
        self._violate(f"{me}: vital task {name} died: {error!r}")

    def _violate(self, problem: str) -> None:
        self.note(f"VIOLATION {problem}")
        if len(self.outcome.violations) < MAX_VIOLATIONS:
            self.outcome.violations.append(problem)

    # -- the run -----------------------------------------------------------------------------

    async def run(self) -> Outcome:
        """Run the world: its faults (drawn in the first two thirds of ``virtual_s``), then,
        once they are over, the orphan bound (``ORPHAN_BOUND_S``), by whose end it must have
        converged; the outcome. Quiet time past that bound would add nothing the faults did not
        already reach, so the run ends there."""
        try:
            for n in range(self._brokers):
                await self._add(BrokerId(f"broker-{n + 1}"))
            await self._run_for(5.0)
            await self._assign_bundles()
            running: list[asyncio.Task[None]] = []
            for fault in self.faults:
                await self._run_for(max(0.0, fault.at_s - self._now()))
                running.append(asyncio.ensure_future(self._fault(fault)))
            await asyncio.gather(*running)
            await self._heal()
            await self._run_for(ORPHAN_BOUND_S)
            self._check_converged()
        finally:
            self.outcome.virtual_s = self._now()
            for node in self._nodes.values():
                if node.up:
                    self._tally(node)
            for node in self._nodes.values():
                await node.broker.stop()
            for node in reversed(list(self._nodes.values())):
                node.gate.set(False)
                node.channel_gate.set(False)
                await node.sidecar.close()
        await self._check_no_task_left()
        return self.outcome

    async def _check_no_task_left(self) -> None:
        """Every component is closed now: none of their tasks may still run."""
        await loop.settle()
        for name in tasks_outliving()[:5]:
            self._violate(f"task {name} outlived its component")

    # -- building ----------------------------------------------------------------------------

    async def _add(self, me: BrokerId, rate: float | None = None) -> _Node:
        """Start the host of broker ``me`` (a sidecar, then its broker)."""
        if rate is None:
            rate = 1.0 + self.rng.uniform(-MAX_DRIFT, MAX_DRIFT)
        gate, channel_gate = Gate(), Gate()
        clock = HostClock(self.clock, rate, gate)
        info = BrokerInfo(me, service_url=f"pulsar://{me}:6650", start_time_ms=clock.now_ms())
        metadata = MemoryMetadataStore(
            self._metadata, SessionPolicy(LEASE_TTL_S, KEEPALIVE_S), clock
        )
        ports = SidecarPorts(
            metadata=metadata,
            channel=GatedChannel(MemoryChannelLog(self._log), channel_gate),
            broker_loads=MemoryLoadStore(self._loads, clock),
            top_bundles=MemoryLoadStore(self._tops, clock),
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
            host=SimulatedHost(random.Random(self.rng.getrandbits(64))),
            on_death=lambda name, error: self._died(me, name, error),
        )
        old = self._nodes.get(me) or self._gone.get(me)
        broker = (
            old.broker
            if old is not None
            else SimulatedBroker(
                self, info, HostClock(self.clock, 1.0 + self.rng.uniform(-MAX_DRIFT, MAX_DRIFT))
            )
        )
        node = _Node(sidecar, broker, gate, channel_gate, metadata, rate)
        self._nodes[me] = node
        gone = self._gone.pop(me, None)
        self._apply_held(me)
        self._starting.add(me)
        try:
            await sidecar.start()
        except BaseException:
            self._starting.discard(me)
            del self._nodes[me]
            if old is not None:
                (self._gone if gone is not None else self._nodes)[me] = old
            raise
        self._starting.discard(me)
        node.up = True
        broker.start(sidecar.link.session, gate)
        self.note(f"{me} up")
        return node

    async def _assign_bundles(self) -> None:
        first = next(iter(self._nodes.values())).sidecar
        record = await first.namespaces.refresh(graph.DEFAULT_NAMESPACE)
        assigns = []
        for n, bundle in enumerate(record.bundles().bundles()):
            node = list(self._nodes.values())[n % len(self._nodes)]
            assigns.append(node.sidecar.operations.assign(bundle.id, node.sidecar.me))
            self._ever_owned.add(bundle.id)
        await self._in_turn(assigns)
        await self._run_for(2.0)

    # -- time ------------------------------------------------------------------------------

    def _now(self) -> float:
        return self.clock.monotonic() - 1000.0

    async def _in_turn(self, calls: Sequence[Coroutine[Any, Any, object]]) -> None:
        """Run ``calls`` one after the other (the clock moves on meanwhile); a call that fails
        is what a client would see, not a violation."""
        for call in calls:
            with contextlib.suppress(LbdError):
                await call

    async def _run_for(self, seconds: float) -> None:
        """Let the world run for ``seconds`` of virtual time, then settle the instant."""
        await self.clock.sleep(seconds)
        await loop.settle()

    # -- faults ----------------------------------------------------------------------------

    def _live(self) -> list[_Node]:
        return [self._nodes[b] for b in sorted(self._nodes) if self._nodes[b].up]

    async def _fault(self, fault: Fault) -> None:
        kind, duration = fault.kind, fault.duration_s
        rng = random.Random(f"{self.spec.seed}-{fault}")
        if kind == "join":
            await self._join()
            return
        live = self._live()
        if not live:
            return
        node = live[fault.node % len(live)]
        me = node.broker.id
        self.note(f"fault {kind} {me} for {duration:.1f}s")
        if kind == "crash-sidecar":
            await self._crash(node, duration)
        elif kind in HELD:
            target = "" if kind in CLUSTER_WIDE else me
            self._hold(kind, target, +1)
            await self.clock.sleep(duration)
            self._hold(kind, target, -1)
        elif kind == "redeliver":
            self._log.redeliver(rng.randint(1, 5))
        elif kind == "load-swing":
            topic = rng.randrange(HashedTopicTraffic.TOPICS)
            self.traffic.swing(topic, rng.uniform(20.0, 60.0))
            await self.clock.sleep(duration)
            self.traffic.swing(topic, 1.0)
        elif kind == "leave":
            await self._leave(node)
        elif kind == "drain":
            await self._drain(node, duration)
        elif kind == "plan":
            await self._plan(rng, duration)
        else:
            await self._admin(kind, node, rng)
        self.note(f"fault {kind} {me} over")

    def _hold(self, kind: str, target: str, change: int) -> None:
        """Count one more (or one less) fault of ``kind`` on ``target``, and apply whether any
        is in force: overlapping faults of one kind end only when the last of them does."""
        key = (kind, target)
        self._held[key] = self._held.get(key, 0) + change
        on = self._held[key] > 0
        if kind == "etcd-down":
            self._metadata.set_reachable(not on)
        elif kind == "channel-down":
            if on:
                self._log.go_down()
            else:
                self._log.come_back()
        elif target:
            self._apply_held(BrokerId(target))

    def _apply_held(self, me: BrokerId) -> None:
        """Set the gates and the etcd cut-off of ``me``'s host as the faults on it say."""
        node = self._nodes.get(me)
        if node is None:
            return

        def held(kind: str) -> bool:
            return self._held.get((kind, me), 0) > 0

        # A paused sidecar gets no renewal through either: it shares the cut-off.
        paused, isolated = held("pause-sidecar"), held("isolate-sidecar")
        node.broker.paused = held("pause-broker")
        node.metadata.set_cut_off(paused or isolated or held("etcd-cut-one"))
        node.gate.set(paused)
        node.channel_gate.set(paused or isolated or held("channel-cut-one"))

    async def _crash(self, node: _Node, down_s: float) -> None:
        """The sidecar dies at once (no goodbye: its etcd lease runs out by itself, its broker
        sees the session end) and starts again ``down_s`` later from the checkpoint and the
        channel."""
        me = node.broker.id
        before = {b: v.version_id for b, v in node.sidecar.follower.table.items()}
        node.up = False
        self._tally(node)
        node.metadata.set_cut_off(True)  # no lease revoked, no registration removed
        node.channel_gate.set(True)
        await node.broker.stop()
        node.gate.set(False)
        await node.sidecar.close()
        await self.clock.sleep(down_s)
        fresh = await self._start_host(me, node.rate)
        await self._run_for(0.0)
        for bundle, version in sorted(before.items()):
            value = fresh.sidecar.follower.get(bundle)
            if value is not None and value.version_id < version:
                self._violate(
                    f"{me} restarted with {bundle} at version {value.version_id} < "
                    f"{version} before the crash"
                )

    async def _join(self) -> None:
        ids = [BrokerId(f"broker-{n}") for n in range(1, MAX_BROKERS + 1)]
        free = [b for b in ids if b not in self._nodes and b not in self._joining]
        if not free:
            return
        me = free[0]
        self.note(f"fault join {me}")
        node = self._gone.get(me)
        self._joining.add(me)
        try:
            await self._start_host(me, None if node is None else node.rate)
        finally:
            self._joining.discard(me)

    async def _start_host(self, me: BrokerId, rate: float | None) -> _Node:
        """Start ``me``'s host, again and again until it starts (as a supervisor would)."""
        while True:
            try:
                return await self._add(me, rate)
            except LbdError as e:
                self.note(f"{me} start failed: {e}")
                await self.clock.sleep(self.spec.timings.retry_s)

    async def _leave(self, node: _Node) -> None:
        """The broker shuts down, then its sidecar, in order (bundles follow the orphan
        path)."""
        if len(self._live()) <= MIN_BROKERS:
            return
        me = node.broker.id
        node.up = False
        self._tally(node)
        await node.broker.stop()
        node.gate.set(False)
        node.channel_gate.set(False)
        await node.sidecar.close()
        self._gone[me] = self._nodes.pop(me)
        self.note(f"{me} left")

    async def _admin(self, kind: str, via: _Node, rng: random.Random) -> None:
        owned = sorted(
            (b, o) for b, v in via.sidecar.follower.table.items() if (o := owner_of(v)) is not None
        )
        if not owned:
            return
        bundle, owner = rng.choice(owned)
        others = sorted(b for b in self._nodes if b != owner)
        if kind == "split":
            at = self._nodes.get(owner)
            if at is not None and at.up:
                with contextlib.suppress(LbdError):
                    await at.sidecar.operations.split(bundle, SplitAlgorithm.RANGE_EQUALLY_DIVIDE)
            return
        operation = via.sidecar.operations
        if kind == "transfer" and others:
            with contextlib.suppress(LbdError):
                await self._admin_move(bundle, rng.choice(others))
        elif kind == "unload":
            with contextlib.suppress(LbdError):
                await self._admin_move(bundle, None)
            with contextlib.suppress(LbdError):
                await operation.assign(bundle, via.sidecar.me)

    async def _admin_move(self, bundle: BundleId, dst: BrokerId | None) -> None:
        """An admin Transfer (``dst``) or Unload as the API runs it: the leader's
        :meth:`~lbd.services.leader.tracker.OperationTracker.admin_move` (any sidecar's API
        forwards the call there)."""
        leader = self._leader()
        if leader is not None:
            await leader.sidecar.tracker.admin_move(bundle, dst)

    def _leader(self) -> _Node | None:
        """The live node whose sidecar runs the leader duties now, if any."""
        return next((n for n in self._live() if n.sidecar.elector.is_leader), None)

    async def _drain(self, node: _Node, duration: float) -> None:
        """An operator drains ``node``'s broker through the leader, and uncordons it (through any
        sidecar) when the fault ends, drained or not."""
        me = node.broker.id
        leader = self._leader()
        if leader is None:
            return
        with contextlib.suppress(LbdError):
            op = await leader.sidecar.drainer.drain(me)
            self.note(f"drain of {me}: operation {op.id}")
        await self.clock.sleep(duration)
        await self._uncordon(me)

    async def _uncordon(self, broker: BrokerId) -> None:
        for via in self._live():
            with contextlib.suppress(LbdError):
                await via.sidecar.drainer.uncordon(broker)
                return

    async def _plan(self, rng: random.Random, duration: float) -> None:
        """An operator asks the leader for a plan and executes it; sometimes cancels it
        halfway (its in-flight moves finish)."""
        leader = self._leader()
        if leader is None:
            return
        scheduler = leader.sidecar.unload_scheduler
        with contextlib.suppress(LbdError):
            plan = (await scheduler.run_cycle(dry_run=True, asked=True)).plan
            if plan is None:
                return
            op = await scheduler.execute(plan.id)
            self.note(f"plan {plan.id}: {len(plan.moves)} move(s), operation {op.id}")
            if rng.random() < 0.5:
                await self.clock.sleep(rng.uniform(0.0, duration))
                leader.sidecar.tracker.cancel(op.id)

    async def _heal(self) -> None:
        self._held.clear()
        self._metadata.set_reachable(True)
        self._log.come_back()
        for me in list(self._nodes):
            self._apply_held(me)
        self.note("faults over")
        for broker in sorted(self._nodes):
            await self._uncordon(broker)  # a drain whose uncordon met an outage
        # Clients look their topics up again: an unloaded bundle (Free) is assigned anew.
        await self._run_for(2.0)
        for n, bundle in enumerate(sorted(self._bundles())):
            await self._look_up(bundle, n)

    async def _look_up(self, bundle: BundleId, n: int) -> None:
        """A client's lookup of a Free (or unknown) ``bundle``, retried as a client does while
        the cluster recovers (a sidecar in safe mode assigns nothing)."""
        for attempt in range(LOOKUP_ATTEMPTS):
            value = self._truth.get(bundle)
            if value is not None and value.state not in (_S.Free, _S.Init):
                return
            nodes = self._live()
            try:
                await nodes[(n + attempt) % len(nodes)].sidecar.operations.assign(bundle)
                return
            except LbdError as e:
                self.note(f"lookup of {bundle} failed, retrying: {e}")
                await self.clock.sleep(self.spec.timings.retry_s * 2)

    def _bundles(self) -> set[BundleId]:
        """Every bundle that was ever Owned or has a value now."""
        return self._ever_owned | {b for b, _ in self._truth.items()}

    # -- the end ---------------------------------------------------------------------------

    def _check_converged(self) -> None:
        live = self._live()
        tables = {n.broker.id: dict(n.sidecar.follower.table.items()) for n in live}
        truth = dict(self._truth.items())
        for broker, table in tables.items():
            if table != truth:
                self._violate(f"{broker}'s table differs from the channel's")
        registered = set(live[0].sidecar.registry.brokers())
        for bundle in sorted(self._bundles()):
            value = truth.get(bundle)
            owner = owner_of(value)
            if value is not None and value.state is _S.Deleted:
                continue
            if owner is None or owner not in registered:
                state = "Init" if value is None else value.state.value
                self._violate(f"{bundle} not Owned by a registered broker at the end: {state}")
            elif not self._nodes[owner].broker.serves(bundle):
                self._violate(f"{bundle} Owned by {owner}, which does not serve it")
