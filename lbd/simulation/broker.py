"""The world's broker: obeys the broker contract on its host's clock, and tells the world's checks
whenever it starts serving or gets its lease back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
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
from lbd.simulation.hosts import Gate, HostClock
from lbd.simulation.schedule import REPORT_S

if TYPE_CHECKING:
    from lbd.simulation.world import World


class SimulatedBroker:
    """A broker that obeys the contract: it serves what it is told to Own while its serving lease
    is valid, acknowledges every command, and forgets everything when its lease runs out or its
    session ends. Its lease is timed on its own host's clock."""

    def __init__(self, world: World, info: BrokerInfo, clock: HostClock) -> None:
        self.info = info
        self.serving: set[BundleId] = set()
        self.lease = BrokerLease()
        self.clock = clock
        self._frozen = Gate()
        """Closed while the broker is paused."""
        self._world = world
        self._gate = Gate()
        self._outgoing: asyncio.Queue[BrokerMessage | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def id(self) -> BrokerId:
        return self.info.broker_id

    @property
    def paused(self) -> bool:
        """Whether the broker is frozen: it reads nothing (its stream keeps what comes, in
        order, for when it resumes), sends nothing and asks for no lease."""
        return self._frozen.paused

    @paused.setter
    def paused(self, paused: bool) -> None:
        self._frozen.set(paused)

    def serves(self, bundle: BundleId) -> bool:
        """Whether it serves ``bundle`` now: told to own it, and (unless the lease is switched
        off) its lease still valid."""
        if bundle not in self.serving:
            return False
        return self._world.lease_off or self.lease.valid(self.clock.monotonic())

    def start(self, session: Callable[[AsyncIterator[BrokerMessage]], Any], gate: Gate) -> None:
        """Open a session (``gate``: its sidecar's, closed while that is paused)."""
        self._gate = gate
        self._outgoing = asyncio.Queue()
        self._outgoing.put_nowait(Hello(self.info, takes_own_batches=True))
        self.lease = BrokerLease()
        self._tasks = [
            asyncio.create_task(self._run(session), name=f"sim-broker-{self.id}"),
            asyncio.create_task(self._keep_lease(), name=f"sim-lease-{self.id}"),
            asyncio.create_task(self._report(), name=f"sim-report-{self.id}"),
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
        clock = self.clock
        while True:
            if not self.paused:
                self._outgoing.put_nowait(self.lease.request(clock.monotonic()))
            await clock.sleep(self._world.spec.timings.serving_lease_s / 4)
            if self.paused or self._world.lease_off:
                continue
            if self.lease.lapse_if_due(clock.monotonic()) and self.serving:
                self._world.note(f"{self.id} lease ran out; serves nothing")
                self.serving.clear()

    async def _report(self) -> None:
        """Report its load every :data:`REPORT_S` (while it serves: what its bundles carry)."""
        while True:
            await self.clock.sleep(REPORT_S)
            if not self.paused:
                serving = sorted(b for b in self.serving if self.serves(b))
                self._outgoing.put_nowait(self._world.traffic.report(serving))

    def _handle(self, message: SidecarMessage) -> None:
        command = message.command
        match command:
            case ServingLease():
                now = self.clock.monotonic()
                was_valid = self.lease.valid(now)
                self.lease.grant(command, now)
                if not was_valid:  # serving again: what it serves must still be its own
                    self._world.check_broker(self)
                return
            case OwnCommand():
                for bundle in command.bundles:
                    self.serving.add(bundle)
                    self._world.starts_serving(self, bundle)
            case ReleaseCommand(bundle=bundle) | CloseCommand(bundle=bundle):
                self.serving.discard(bundle)
        self._outgoing.put_nowait(CommandAck(message.command_id, ok=True))
