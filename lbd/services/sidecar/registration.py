"""Broker registration: ``brokers/<me>`` exists exactly while this sidecar's broker can serve.

A registered broker is an assignment candidate, so the registration follows the broker link: it
is written when a broker says Hello (with what the broker said about itself) and removed when its
session ends. With ``broker.auto_ack`` the sidecar stands in for an absent broker and keeps a
registration of its own configured info instead.

A broker that is attached but silent (no report, no lease request, no ack) for
``silence_timeout_s`` is deregistered as if it had left, so that its bundles follow the orphan
path; that is safe because a silent broker asks for no serving lease and has stopped serving by
then. It is registered again as soon as it is heard from; the leader may have announced the
hand-over of its bundles meanwhile, so the fence counts the etcd lease as a ground for vouching only
after a channel read barrier that began once the new registration was written
(:attr:`BrokerRegistration.registered_since`).

A registration that meets an outage is retried every ``retry_s`` until it lands; the lease it
lives under is the metadata session's (:mod:`lbd.adapters.session`), which re-registers it by
itself after a lease loss.

A broker whose maintenance record says ``decommissioned`` (the leader drained it and ended its
service, :mod:`lbd.services.leader.drain`) is deregistered when the record appears and is
not registered again, whatever its link does, until the record is cleared (uncordon): then it is
registered as the link says.

A broker that leaves gracefully (``LeaveRequest``, a SIGTERM of ``lbd broker``) gets its own
maintenance record, ``draining`` with a reason starting ``leaving:``: the leader moves every bundle
off it as in a drain, and the broker, still serving, hands each over as it is told. The record is
the broker's: when the broker says Hello again it is cleared and the broker is back in service
(a record an operator wrote is never touched).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import replace

from lbd.core.broker_info import BrokerInfo
from lbd.core.maintenance import LEAVE_REASON_PREFIX, MaintenanceMode
from lbd.core.probes import probe
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.services.cluster.maintenance_view import MaintenanceChange, MaintenanceView
from lbd.services.cluster.registry import BrokerRegistry
from lbd.services.sidecar.broker_link import BrokerLink, LinkEvent, LinkEventKind
from lbd.tasks import Component, Tasks, cancel_and_wait, guard, seconds_until

_log = logging.getLogger(__name__)


class BrokerRegistration(Component):
    """Keeps this sidecar's broker registered while it is attached (or always, with auto-ack)."""

    def __init__(
        self,
        link: BrokerLink,
        registry: BrokerRegistry,
        clock: Clock,
        *,
        maintenance: MaintenanceView,
        self_info: BrokerInfo,
        retry_s: float,
        silence_timeout_s: float,
    ) -> None:
        """``self_info`` is registered with auto-ack while no broker is attached; its
        ``sidecar_grpc_addr`` is filled into a broker's own info when that lacks one."""
        self._link = link
        self._registry = registry
        self._clock = clock
        self._maintenance = maintenance
        self._held = False
        """A registration was withheld (or removed) because the broker is decommissioned."""
        self._self_info = self_info
        self._retry_s = retry_s
        self._silence_timeout_s = silence_timeout_s
        self._silent = False
        self._registered_since: float | None = None
        self._tasks = Tasks(f"the registration of {link.me}")
        self._registration: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Follow the broker link; with auto-ack and no broker, register ``self_info`` now."""
        if self._tasks:
            return
        events = self._link.events()
        records = self._maintenance.changes()
        me = self._link.me
        self._tasks.spawn(self._follow(events), name=f"registration-{me}")
        self._tasks.spawn(self._watch_silence(), name=f"silence-{me}")
        self._tasks.spawn(self._follow_records(records), name=f"decommission-{me}")
        if self._link.auto_ack and not self._link.attached:
            self._register(self._self_info)

    async def close(self) -> None:
        """Stop following (the registration stays until the lease goes). Idempotent."""
        registration, self._registration = self._registration, None
        await self._tasks.close()
        await cancel_and_wait(registration)

    @property
    def registered_since(self) -> float | None:
        """When the current registration was written (clock-monotonic, once the write
        returned); None while the broker is not registered or its registration is being
        (re)written.

        Between a deregistration and the next registration the leader may have announced the
        hand-over of the broker's bundles: the fence's lease ground counts only after a channel
        read barrier that began after this (docs/safety.md)."""
        return self._registered_since

    async def deregister(self) -> None:
        """Remove the registration now (best effort: it vanishes with the lease anyway)."""
        self._registered_since = None
        registration, self._registration = self._registration, None
        await cancel_and_wait(registration)
        try:
            await self._registry.deregister(self._link.me)
        except UnavailableError as e:
            _log.warning("deregistering %s failed: %s", self._link.me, e)

    async def _watch_silence(self) -> None:
        while True:
            await self._clock.sleep(self._until_next_look_s())
            info, heard = self._link.info, self._link.last_heard
            if info is None or heard is None:
                self._silent = False
                continue
            quiet_s = self._clock.monotonic() - heard
            if quiet_s >= self._silence_timeout_s and not self._silent:
                self._silent = True
                probe("silence.deregister")
                _log.warning(
                    "broker %s silent for %.1fs: deregistered, its bundles follow the orphan path",
                    info.broker_id,
                    quiet_s,
                )
                await self.deregister()
            elif quiet_s < self._silence_timeout_s and self._silent:
                self._silent = False
                _log.info("broker %s heard from again: registered", info.broker_id)
                self._register(info)

    def _until_next_look_s(self) -> float:
        """How long until the silence watch looks again: the moment the broker would have been
        silent for ``silence_timeout_s`` while it is heard from (a live broker asks for its
        lease every quarter of it, so this comes rarely); a quarter of the timeout while it is
        silent or not attached, to notice it again."""
        poll_s = self._silence_timeout_s / 4
        heard = self._link.last_heard
        if self._silent or self._link.info is None or heard is None:
            return poll_s
        return seconds_until(self._clock, heard + self._silence_timeout_s)

    async def _follow(self, events: AsyncGenerator[LinkEvent, None]) -> None:
        async with contextlib.aclosing(events):
            async for event in events:
                if event.kind is LinkEventKind.ATTACHED and event.info is not None:
                    self._silent = False
                    await self._back_from_leave()
                    self._register(event.info)
                elif event.kind is LinkEventKind.LEAVING:
                    await self._leave(event.detail)
                elif event.kind is LinkEventKind.DETACHED:
                    if self._link.auto_ack:
                        self._register(self._self_info)
                    else:
                        await self.deregister()

    async def _follow_records(self, changes: AsyncGenerator[MaintenanceChange, None]) -> None:
        async with contextlib.aclosing(changes):
            async for change in changes:
                if change.broker != self._link.me:
                    continue
                if self._decommissioned():
                    if not self._held:
                        self._held = True
                        _log.warning(
                            "broker %s is decommissioned: deregistered, and kept so until it is "
                            "uncordoned",
                            self._link.me,
                        )
                        await self.deregister()
                elif self._held:
                    self._held = False
                    _log.info("broker %s is no longer decommissioned", self._link.me)
                    info = self._link.info
                    if self._link.attached and info is not None and not self._silent:
                        self._register(info)
                    elif self._link.auto_ack and not self._link.attached:
                        self._register(self._self_info)

    async def _leave(self, reason: str) -> None:
        """Ask for the broker's bundles to be moved off it (unless an operator's record is
        there: it already keeps new bundles away, and says what to do)."""
        me = self._link.me
        record = self._maintenance.get(me)
        if record is not None and not record.leave:
            _log.info("broker %s leaves while %s: left as it is", me, record.describe())
            return
        try:
            await self._maintenance.set(
                me, MaintenanceMode.DRAINING, LEAVE_REASON_PREFIX + (reason or "shutting down")
            )
        except UnavailableError as e:
            _log.warning("broker %s leaves, but its bundles cannot be handed over: %s", me, e)

    async def _back_from_leave(self) -> None:
        me = self._link.me
        record = self._maintenance.get(me)
        if record is None or not record.leave:
            return
        try:
            await self._maintenance.clear(me)
        except UnavailableError as e:
            _log.warning("broker %s is back, but still %s: %s", me, record.describe(), e)
        else:
            _log.info("broker %s is back after leaving: in service again", me)

    def _decommissioned(self) -> bool:
        return self._maintenance.mode(self._link.me) is MaintenanceMode.DECOMMISSIONED

    def _register(self, info: BrokerInfo) -> None:
        if self._decommissioned():
            self._held = True
            _log.warning(
                "broker %s is decommissioned: not registering it (uncordon it to bring it back)",
                info.broker_id,
            )
            return
        if not info.sidecar_grpc_addr and self._self_info.sidecar_grpc_addr:
            info = replace(info, sidecar_grpc_addr=self._self_info.sidecar_grpc_addr)
        if self._registration is not None:
            self._registration.cancel()
        self._registered_since = None
        self._registration = guard(self._keep_registering(info), name=f"register-{info.broker_id}")

    async def _keep_registering(self, info: BrokerInfo) -> None:
        while True:
            try:
                await self._registry.register(info)
                self._registered_since = self._clock.monotonic()
                return
            except UnavailableError as e:
                _log.warning("registering %s failed, retrying: %s", info.broker_id, e)
                await self._clock.sleep(self._retry_s)
