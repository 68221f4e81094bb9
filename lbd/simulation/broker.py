"""The in-process brokers: one broker that keeps the broker contract, for the simulated world and
the services' test harness alike.

:class:`ContractBroker` sits on the far side of ``BrokerLink.session`` in the sidecar's own
process: it serves what it is told to Own while its serving lease is valid, asks for the lease
right after Hello and every quarter of its duration, stops serving everything when the lease runs
out unrenewed or the session ends (docs/broker-contract.md), and answers every command. A paused
broker (SIGSTOP, a long GC pause) reads nothing, sends nothing and asks for no lease; what comes
meanwhile waits, in order, for its resume. Its subclasses choose the answers and watch what it
does: :class:`SimulatedBroker` (the world's: every answer yes, the world's checks told at every
Own and renewed lease, load reports from the world's traffic) and the harness's ``FakeBroker``
(tests/unit/services/harness.py: answers chosen by the test, every command recorded).

The broker process ``lbd sim broker`` (lbd/devcluster/sim_broker.py) and the real broker front
keep the same contract through the broker library (lbd/broker) over gRPC instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from lbd.core.broker_info import (
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
from lbd.simulation.hosts import Gate, HostClock, WakingClock
from lbd.simulation.schedule import REPORT_S
from lbd.tasks import Mailbox

if TYPE_CHECKING:
    from lbd.simulation.world import World


class ContractBroker:
    """An in-process broker that keeps the broker contract; see the module's docstring."""

    def __init__(
        self,
        info: BrokerInfo,
        clock: WakingClock,
        serving_lease_s: float,
        *,
        takes_own_batches: bool = False,
    ) -> None:
        self.info = info
        self.clock = clock
        self.serving: set[BundleId] = set()
        self.lease = BrokerLease()
        self._lease_s = serving_lease_s
        self._takes_own_batches = takes_own_batches
        self._frozen = Gate()
        """Closed while the broker is paused."""
        self._gate = Gate()
        """Its sidecar's: closed while that is paused (nothing goes either way)."""
        self._outgoing: Mailbox[BrokerMessage | None] = Mailbox()
        self._tasks: list[asyncio.Task[None]] = []
        self._lease_timer: asyncio.Future[None] | None = None

    @property
    def id(self) -> BrokerId:
        """The broker id."""
        return self.info.broker_id

    @property
    def paused(self) -> bool:
        """Whether the broker is frozen: it reads nothing (its stream keeps what comes, in
        order, for when it resumes), sends nothing and asks for no lease."""
        return self._frozen.paused

    @paused.setter
    def paused(self, paused: bool) -> None:
        self._frozen.set(paused)

    @property
    def connected(self) -> bool:
        """Whether its session is running."""
        return bool(self._tasks) and not self._tasks[0].done()

    def may_serve(self) -> bool:
        """Whether its serving lease is valid now, on its clock."""
        return self.lease.valid(self.clock.monotonic())

    def serves(self, bundle: BundleId) -> bool:
        """Whether it serves ``bundle`` now: told to own it, and (unless the lease is not
        enforced) its lease still valid."""
        if bundle not in self.serving:
            return False
        return not self.enforces_lease() or self.may_serve()

    def open(
        self, session: Callable[[AsyncIterator[BrokerMessage]], Any], gate: Gate | None = None
    ) -> None:
        """Open a session (``gate``: its sidecar's, closed while that is paused): Hello, then
        the lease requests."""
        self._gate = gate or Gate()
        self._outgoing = Mailbox()
        self._outgoing.put_nowait(Hello(self.info, takes_own_batches=self._takes_own_batches))
        self.lease = BrokerLease()
        self._tasks = [
            asyncio.create_task(self._run(session), name=f"{self._task_prefix}-broker-{self.id}"),
            asyncio.create_task(self._keep_lease(), name=f"{self._task_prefix}-lease-{self.id}"),
            *(
                asyncio.create_task(work, name=f"{self._task_prefix}-{name}-{self.id}")
                for name, work in self.more_work()
            ),
        ]

    async def close(self) -> None:
        """Stop at once (a crash of the broker process): it serves nothing."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self.serving.clear()

    def send(self, message: BrokerMessage) -> None:
        """Send ``message`` on the session (a load report, a Leave, an ack of its own making)."""
        self._outgoing.put_nowait(message)

    # -- what subclasses choose and watch ------------------------------------------------------

    _task_prefix = "contract"

    def enforces_lease(self) -> bool:
        """Whether it stops serving when its lease runs out (a planted bug may switch it off)."""
        return True

    def answer(self, command: OwnCommand | ReleaseCommand | CloseCommand) -> bool | None:
        """Its acknowledgement of ``command``: True, False (refused), None (never answered)."""
        return True

    def on_own(self, bundle: BundleId, accepted: bool) -> None:
        """Told to own ``bundle`` (``accepted``: it serves it from now on)."""

    def on_release(self, bundle: BundleId, command: ReleaseCommand | CloseCommand) -> None:
        """Told to stop serving ``bundle``: released to another broker, or closed."""

    def on_lapse(self, was_serving: bool) -> None:
        """Its lease ran out unrenewed (it serves nothing from now on)."""

    def on_lease_back(self) -> None:
        """A lease granted while it held none valid: it serves again what it was told to own."""

    def more_work(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        """Further tasks of the session (named), such as load reports."""
        return []

    # -- the session ---------------------------------------------------------------------------

    async def _incoming(self) -> AsyncIterator[BrokerMessage]:
        gate, outgoing = self._gate, self._outgoing
        while (message := await outgoing.get()) is not None:
            if gate.paused:
                await gate.wait()  # a paused sidecar reads nothing
            yield message

    async def _run(self, session: Callable[[AsyncIterator[BrokerMessage]], Any]) -> None:
        with contextlib.suppress(LbdError):
            async with contextlib.aclosing(session(self._incoming())) as commands:
                gate, frozen = self._gate, self._frozen
                async for message in commands:
                    if gate.paused:
                        await gate.wait()  # nor does it send anything
                    if frozen.paused:
                        await frozen.wait()  # read on resume, in order
                    self._handle(message)
        self.serving.clear()  # the session ended: it serves nothing

    async def _keep_lease(self) -> None:
        """Ask for the lease now and every quarter of it, noting a lapse before each ask, until
        cancelled. The turns run on the clock's wake-ups, not on a task that sleeps between
        them: this is a simulated world's most frequent wake, and a callback costs a third of
        a task's turn."""
        self._ask_for_lease()
        try:
            await asyncio.get_running_loop().create_future()  # until the session closes
        finally:
            if self._lease_timer is not None:
                self._lease_timer.cancel()
                self._lease_timer = None

    def _ask_for_lease(self) -> None:
        if not self.paused:
            self._outgoing.put_nowait(self.lease.request(self.clock.monotonic()))
        self._lease_timer = self.clock.wake_after(self._lease_s / 4)
        self._lease_timer.add_done_callback(self._lease_turn)

    def _lease_turn(self, timer: asyncio.Future[None]) -> None:
        if timer.cancelled():
            return
        # A paused broker notices nothing (its clock runs on); nor does one whose lease is off.
        noticed = not self.paused and self.enforces_lease()
        if noticed and self.lease.lapse_if_due(self.clock.monotonic()):
            self.on_lapse(bool(self.serving))
            self.serving.clear()
        self._ask_for_lease()

    def _handle(self, message: SidecarMessage) -> None:
        command = message.command
        match command:
            case ServingLease():
                now = self.clock.monotonic()
                was_valid = self.lease.valid(now)
                self.lease.grant(command, now)
                if not was_valid:
                    self.on_lease_back()
                return
            case OwnCommand():
                answer = self.answer(command)
                for bundle in command.bundles:
                    if answer:
                        self.serving.add(bundle)
                    self.on_own(bundle, bool(answer))
            case ReleaseCommand(bundle=bundle) | CloseCommand(bundle=bundle):
                answer = self.answer(command)
                self.serving.discard(bundle)
                self.on_release(bundle, command)
            case _:
                return
        if answer is not None:
            self._outgoing.put_nowait(CommandAck(message.command_id, ok=answer))


class SimulatedBroker(ContractBroker):
    """The world's broker: every answer yes, its lease timed on its own host's clock, the world's
    checks told whenever it starts serving or gets its lease back, and a load report every
    :data:`REPORT_S` of what its bundles carry."""

    _task_prefix = "sim"

    def __init__(self, world: World, info: BrokerInfo, clock: HostClock) -> None:
        super().__init__(info, clock, world.spec.timings.serving_lease_s, takes_own_batches=True)
        self._world = world

    def start(self, session: Callable[[AsyncIterator[BrokerMessage]], Any], gate: Gate) -> None:
        """Open a session (``gate``: its sidecar's, closed while that is paused)."""
        self.open(session, gate)

    async def stop(self) -> None:
        await self.close()

    def enforces_lease(self) -> bool:
        return not self._world.lease_off

    def on_own(self, bundle: BundleId, accepted: bool) -> None:
        self._world.starts_serving(self, bundle)

    def on_lapse(self, was_serving: bool) -> None:
        if was_serving:
            self._world.note(f"{self.id} lease ran out; serves nothing")

    def on_lease_back(self) -> None:
        # Serving again: what it serves must still be its own.
        self._world.check_broker(self)

    def more_work(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        return [("report", self._report())]

    async def _report(self) -> None:
        """Report its load every :data:`REPORT_S` (while it serves: what its bundles carry)."""
        while True:
            await self.clock.sleep(REPORT_S)
            if not self.paused:
                serving = sorted(b for b in self.serving if self.serves(b))
                self.send(self._world.traffic.report(serving))
