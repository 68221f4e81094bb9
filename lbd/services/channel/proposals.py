"""The proposer: writes the next version of a bundle's value to the state channel.

A proposal is only a wish: every sidecar applies the channel with the same resolver, so the first
valid change wins and later conflicting ones are ignored by everyone. The proposer therefore
offers "propose, then look at what the table says" (:meth:`Proposer.propose_and_wait`) and
"wait until the bundle's value satisfies a predicate, within a deadline" (:meth:`Proposer.settle`).
Deadlines run on the injected :class:`~lbd.ports.clock.Clock`, so tests drive them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from lbd.core.errors import DeadlineError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, encode_value
from lbd.core.table import ChannelPosition
from lbd.metrics import Metrics
from lbd.ports.channel import ChannelLog
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.services.channel.batching import BatchingWriter
from lbd.services.channel.deadlines import within
from lbd.services.channel.follower import ChannelFollower

_log = logging.getLogger(__name__)

Predicate = Callable[[ServiceUnitStateData | None], bool]


def _describe(value: ServiceUnitStateData | None) -> str:
    if value is None:
        return "Init (no value)"
    brokers = f"dst={value.dst_broker} src={value.source_broker}"
    return f"{value.state.value} ({brokers}, version {value.version_id})"


class Proposer:
    """Proposes channel values for bundles at the version after the one this sidecar has."""

    def __init__(
        self,
        channel: ChannelLog,
        follower: ChannelFollower,
        clock: Clock,
        *,
        apply_timeout_s: float,
        publish_timeout_s: float,
        metrics: Metrics,
        batch_max_values: int = 1,
    ) -> None:
        """``apply_timeout_s`` bounds :meth:`propose_and_wait`'s wait for the follower to apply
        the proposal (the sidecar's ``assignment.settle_timeout_s``); a publish the channel does
        not take within ``publish_timeout_s`` fails with UnavailableError (it may still land
        later: the resolver judges it then like any other). Values proposed while a write is on
        its way go out together, up to ``batch_max_values`` in one message
        (:class:`~lbd.services.channel.batching.BatchingWriter`)."""
        self._writer = BatchingWriter(
            channel, clock, max_values=batch_max_values, send_timeout_s=publish_timeout_s
        )
        self._apply_timeout_s = apply_timeout_s
        self._publish_timeout_s = publish_timeout_s
        self._metrics = metrics
        self._follower = follower
        self._clock = clock

    async def close(self) -> None:
        """Stop writing: proposals not yet persisted fail with UnavailableError. Idempotent."""
        await self._writer.close()

    @property
    def follower(self) -> ChannelFollower:
        """The follower whose table the proposals build on."""
        return self._follower

    @property
    def clock(self) -> Clock:
        """The clock that stamps the proposals and times their settling."""
        return self._clock

    def next_value(
        self,
        bundle: BundleId,
        state: ServiceUnitState,
        *,
        dst: BrokerId | None = None,
        src: BrokerId | None = None,
        split_children: Mapping[BundleId, BrokerId | None] | None = None,
        force: bool = False,
        leader_term: int | None = None,
    ) -> ServiceUnitStateData:
        """The value :meth:`propose` would write now (version = current + 1, or 1 for none)."""
        current = self._follower.get(bundle)
        return ServiceUnitStateData(
            state=state,
            version_id=1 if current is None else current.version_id + 1,
            dst_broker=dst,
            source_broker=src,
            split_children=split_children,
            force=force,
            timestamp_ms=self._clock.now_ms(),
            leader_term=leader_term,
        )

    async def propose(
        self,
        bundle: BundleId,
        state: ServiceUnitState,
        *,
        dst: BrokerId | None = None,
        src: BrokerId | None = None,
        split_children: Mapping[BundleId, BrokerId | None] | None = None,
        force: bool = False,
        leader_term: int | None = None,
    ) -> ChannelPosition:
        """Publish the next value of ``bundle``; its channel position (not a verdict).

        Raises :class:`~lbd.ports.errors.UnavailableError` when the channel is down.
        """
        value = self.next_value(
            bundle,
            state,
            dst=dst,
            src=src,
            split_children=split_children,
            force=force,
            leader_term=leader_term,
        )
        position = await self._publish(bundle, value)
        _log.debug("proposed %s for %s at %s", _describe(value), bundle, position)
        return position

    async def publish(self, bundle: BundleId, value: ServiceUnitStateData) -> ChannelPosition:
        """Publish ``value``, made by :meth:`next_value` (for a caller that decides on the
        current value and publishes later, many at once); its channel position."""
        return await self._publish(bundle, value)

    async def _publish(
        self, bundle: BundleId, value: ServiceUnitStateData | None
    ) -> ChannelPosition:
        """Publish one value (None: a tombstone), counted by state and result."""
        state = None if value is None else value.state
        try:
            position = await within(
                self._clock,
                self._publish_timeout_s,
                self._writer.publish(bundle, encode_value(value)),
                f"publishing {_describe(value) if value is not None else 'a tombstone'}",
            )
        except DeadlineError as e:
            self._metrics.observe_published(state, ok=False)
            raise UnavailableError(f"the state channel is not taking writes: {e}") from None
        except UnavailableError:
            self._metrics.observe_published(state, ok=False)
            raise
        self._metrics.observe_published(state, ok=True)
        return position

    async def propose_and_wait(
        self,
        bundle: BundleId,
        state: ServiceUnitState,
        *,
        dst: BrokerId | None = None,
        src: BrokerId | None = None,
        split_children: Mapping[BundleId, BrokerId | None] | None = None,
        force: bool = False,
        leader_term: int | None = None,
    ) -> bool:
        """Propose, wait until this sidecar applied it, and say whether the resolver accepted it.

        False means another change won: look at the table to see what the bundle is now.
        Raises DeadlineError if the follower does not get there in time.
        """
        value = self.next_value(
            bundle,
            state,
            dst=dst,
            src=src,
            split_children=split_children,
            force=force,
            leader_term=leader_term,
        )
        # Every accepted value of the bundle is shown to a waiter's predicate as it is applied,
        # so a later change applied in the same breath cannot hide that this one won.
        seen: list[bool] = []

        def ours(current: ServiceUnitStateData | None) -> bool:
            if current == value:
                seen.append(True)
            return False

        with self._follower.watching(bundle, ours):
            position = await self._publish(bundle, value)
            await within(
                self._clock,
                self._apply_timeout_s,
                self._follower.wait_applied(position),
                f"applying the proposal {_describe(value)} for {bundle}",
            )
        won = bool(seen)
        _log.debug(
            "proposal %s for %s %s; now %s",
            _describe(value),
            bundle,
            "won" if won else "lost",
            _describe(self._follower.get(bundle)),
        )
        return won

    async def tombstone(self, bundle: BundleId) -> ChannelPosition:
        """Publish the empty value: the bundle's entry is deleted (always accepted)."""
        return await self._publish(bundle, None)

    async def settle(
        self, bundle: BundleId, predicate: Predicate, timeout_s: float
    ) -> ServiceUnitStateData | None:
        """The bundle's value once ``predicate`` holds (at once if it holds now).

        Raises :class:`DeadlineError` naming the bundle and its state when it does not within
        ``timeout_s`` of clock time.
        """
        try:
            return await within(
                self._clock,
                timeout_s,
                self._follower.wait_for(bundle, predicate),
                f"bundle {bundle}",
            )
        except DeadlineError:
            raise DeadlineError(
                f"bundle {bundle} did not settle within {timeout_s:g}s; it is "
                f"{_describe(self._follower.get(bundle))}"
            ) from None
