"""The leader's ownership monitor (DESIGN §4, §8).

As soon as it leads, then every ``monitor.interval_s``, and whenever a gone broker's orphan grace
ends (the registry's watch says when a broker vanished), the monitor sweeps the channel table and
fixes what nobody else will:

- **orphans**: a bundle whose server (:func:`server_of`: its owner, the source of a Releasing or
  Splitting, the destination of an Assigning) is not registered and has stayed away for
  ``orphan_cleanup_grace_s`` is moved in two steps. First a forced ``Releasing`` from the gone
  broker announces the move on the channel; only ``handover_wait_s`` after this leader first saw
  that announcement, and if the broker is still not registered in the store itself, a forced
  ``Assigning`` tells a live broker chosen by the :class:`~lbd.services.cluster.assigner.Assigner`
  (isolation, anti-affinity, version and max-topics filters included). A gone broker's sidecar
  that still reads the channel releases the bundle itself; one that cannot has stopped vouching
  for its broker, whose serving lease has run out by then (docs/safety.md). Never in safe
  mode: an unreachable registry says nothing about who is alive. A broker that registers again
  within the grace keeps its bundles (the cleanup is cancelled, and counted so);
- **stuck in-flight states** older than ``inflight_timeout_s`` (by the value's timestamp) whose
  server is registered: a ``Splitting`` goes back to ``Owned`` by its source, or is finished as
  ``Deleted`` when the split progressed; a ``Releasing`` goes back to ``Owned`` by its source
  (the move is undone); an ``Assigning`` is moved on with a ``Releasing`` from its destination,
  which may have taken the bundle. No fix ever lets a second broker serve;
- **tombstones**: ``Free`` and ``Deleted`` values older than ``tombstone_after_s`` are deleted.

Forced writes carry the leader's term, so that a deposed leader's late overrides are rejected by
every sidecar; the monitor also stops writing as soon as its table shows a higher term. Each fix
is logged once, as one line with its reason.

A sweep decides bundle by bundle, each on the value it read, and publishes its writes in a window
of up to ``WRITE_WINDOW`` at once instead of one after another: a broker that leaves with ten
thousand bundles is ten thousand announcements, then as many hand-overs. Each write's value is
made in the same step as the check that the bundle did not move on (its version follows the value
the fix was decided on), and the sweep ends when every write it started is persisted or failed.
The namespace records and the registry's word on each gone broker are read once per sweep.

Between full sweeps, the leader hands each announced move over as its wait ends, in a pass over
the moves then due and the orphans held back for the recovery budget (:meth:`run_held`): a
hand-over waits ``handover_wait_s``, not that plus up to an interval. A pass checks each bundle
by the same rules as a full sweep, on its value then.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from lbd.core.admission import MoveKind, Ticket
from lbd.core.assign import Selection
from lbd.core.broker_info import BrokerInfo
from lbd.core.bundles import parse_bundle_id, split_points
from lbd.core.errors import DeadlineError, InvalidInputError, LbdError, NotFoundError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.namespace import NamespaceRecord
from lbd.core.probes import probe
from lbd.core.settings import MonitorConfig
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, server_of
from lbd.core.table import StateTable
from lbd.metrics import CANCEL, FAILURE, SUCCESS, Metrics
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.ports.metadata import RegistryEvent
from lbd.services.channel.deadlines import within
from lbd.services.channel.follower import ChannelFollower
from lbd.services.channel.proposals import Proposer
from lbd.services.cluster.assigner import Assigner
from lbd.services.cluster.namespaces import NamespaceService
from lbd.services.cluster.registry import BrokerRegistry, GoneBrokers
from lbd.services.leader.decisions import DecisionLog
from lbd.services.leader.governor import ExecutionGovernor
from lbd.tasks import cancel_and_wait, guard, yield_now

_log = logging.getLogger(__name__)

_S = ServiceUnitState

SWEEP_SLICE = 1_000
"""A sweep lets the event loop run after each slice of this many bundles: when a broker with
100k bundles is gone, checking them is a few hundred milliseconds, which would otherwise hold up
every lookup."""
HANDOVER_PASS_GAP_S = 0.05
"""The least time between two passes that hand over announced moves as their waits end."""
_SLACK_S = 1e-6
"""A full sweep due this close is due now (a clock's sleep may end a rounding error early)."""
_GRACE_SLACK_S = 0.001
"""A sweep for a grace that ends runs this much after it, so that it finds the broker away for
the whole grace, not a rounding error less (which would leave it waiting, for a sweep at once)."""
GRACE_RETRY_S = 1.0
"""A full sweep due because a gone broker's grace ended, or a new leader's first, but skipped
(safe mode, the channel not caught up), is tried again this much later rather than at the next
interval; so is one (or a pass) some of whose writes the channel did not take, twice as late
each time in a row that it is so again, up to the interval."""
WRITE_WINDOW = 4096
"""Channel writes one sweep has in flight at once. The channel writer sends them in batches, so
a write in flight costs a queued entry, not a message: announcing 10,000 orphans took 1.6 s of
walking the table with 512, 0.9 s with 4,096."""
DECISION_LINES = 20
"""A sweep logs its first this many fixes one line each at INFO, the rest at DEBUG, and then
one INFO line saying how many more there were: a repair of 10,000 orphans spent a sixteenth of
the leader's time writing a log line per bundle. ``lbd ctl decisions`` and the decision history
keep every one."""


@dataclass(frozen=True, slots=True)
class Fix:
    """One override the monitor wrote: the bundle, the kind of problem, and the new value."""

    bundle: BundleId
    kind: str
    """``orphan``, ``inflight`` or ``tombstone`` (the metric's ``kind`` label)."""
    state: ServiceUnitState | None
    """The state written (None: a tombstone)."""
    dst: BrokerId | None
    reason: str


@dataclass(slots=True)
class _Sweep:
    """The state of one sweep, shared by the rules."""

    term: int
    now_ms: int
    mono: float
    """When the sweep read the table (monotonic): every value in it was applied before, and
    every read of the store during the sweep comes after."""
    live: Mapping[BrokerId, BrokerInfo]
    skipped: str | None
    away: dict[BrokerId, float] = field(default_factory=dict)
    """Seconds each unregistered broker the sweep met in the table has been away, found when
    the sweep first meets it."""
    fixes: list[Fix] = field(default_factory=list)
    failed: list[tuple[BundleId, str]] = field(default_factory=list)
    unwritten: int = 0
    """How many of ``failed`` are writes the channel did not take."""
    waiting: dict[BrokerId, float] = field(default_factory=dict)
    handing_over: dict[BundleId, float] = field(default_factory=dict)
    records: list[NamespaceRecord] | None = None
    """The namespace records, read once by the first fix that places a bundle."""
    registered_now: dict[BrokerId, bool] = field(default_factory=dict)
    """What the store itself said of each gone broker, asked once per sweep."""
    writes: list[tuple[Fix, ServiceUnitStateData, asyncio.Task[object]]] = field(
        default_factory=list
    )
    """The writes started, with their fix and the value each was decided on."""
    window: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(WRITE_WINDOW))
    """Taken before a fix checks its value, given back when its write is done."""
    full: set[BrokerId] = field(default_factory=set)
    """Brokers the recovery budget admitted no more orphans to during this sweep."""

    def report(self) -> SweepReport:
        """What the sweep did."""
        return SweepReport(
            tuple(self.fixes),
            tuple(self.failed),
            dict(self.waiting),
            dict(self.handing_over),
            self.skipped,
            self.unwritten,
        )


@dataclass(frozen=True, slots=True)
class SweepReport:
    """What one sweep did."""

    fixes: tuple[Fix, ...] = ()
    failed: tuple[tuple[BundleId, str], ...] = ()
    waiting: Mapping[BrokerId, float] = field(default_factory=dict)
    """Gone brokers whose bundles wait out the grace period, with the seconds they were away."""
    handing_over: Mapping[BundleId, float] = field(default_factory=dict)
    """Announced moves off gone brokers waiting out the hand-over, with the seconds waited."""
    skipped: str | None = None
    """Why orphans and stuck states were not looked at (safe mode, deposed, not caught up)."""
    unwritten: int = 0
    """Failed fixes whose write the channel did not take (unavailable, timed out): worth
    trying again soon, unlike one no broker can take."""


class OwnershipMonitor:
    """The leader's sweep for orphans, stuck in-flight states and old Free/Deleted values."""

    name = "ownership-monitor"
    """The leader duty's name."""

    def __init__(
        self,
        proposer: Proposer,
        follower: ChannelFollower,
        registry: BrokerRegistry,
        namespaces: NamespaceService,
        assigner: Assigner,
        clock: Clock,
        config: MonitorConfig,
        *,
        handover_wait_s: float,
        metrics: Metrics,
        governor: ExecutionGovernor,
        decisions: DecisionLog,
        channel_readable_since: Callable[[], float | None] = lambda: None,
    ) -> None:
        """``handover_wait_s``: see :attr:`lbd.core.settings.SidecarTimings.handover_wait_s`;
        an orphan's move to its new broker waits for a slot of ``governor``'s recovery
        budget; every fix is recorded in ``decisions``. ``channel_readable_since()`` says since
        when this sidecar has read the channel without a break (None: always): a value is
        stuck in flight only once the channel was readable for the whole in-flight timeout."""
        self._channel_readable_since = channel_readable_since
        self._governor = governor
        self._decisions = decisions
        self._proposer = proposer
        self._follower = follower
        self._registry = registry
        self._namespaces = namespaces
        self._assigner = assigner
        self._clock = clock
        self._settings = config
        self._handover_wait_s = handover_wait_s
        self._metrics = metrics
        self._gone = GoneBrokers(registry, unseen_extra_s=config.unseen_extra_s)
        self._undated: dict[tuple[BundleId, int], int] = {}
        """Values without a timestamp, by (bundle, version): when the monitor first saw them."""
        self._waiting: set[BrokerId] = set()
        self._announced: dict[tuple[BundleId, int], float] = {}
        """Moves off gone brokers, by (bundle, version): when this leader first saw them."""
        self._held: dict[BundleId, ServiceUnitStateData] = {}
        """Orphans the last sweeps held back for the recovery budget, with the value each was
        held back on, in the order met: handed over as slots free up (:meth:`run_held`)."""
        self._due: dict[BundleId, float] = {}
        """Announced moves off gone brokers, by when their hand-over wait ends (monotonic):
        handed over then (:meth:`run_held`) rather than at the next full sweep."""
        self._written_at: dict[BundleId, tuple[float, BrokerId | None, int]] = {}
        """When this leader's own announcements were persisted, until it reads them back."""
        self._grace_ends: dict[BrokerId, float] = {}
        """Gone brokers, by when their orphan grace ends (monotonic): a full sweep runs then,
        not at the next interval. From the registry's watch and from each full sweep."""
        self._registry_changed = asyncio.Event()

    async def run_leading(self, term: int) -> None:
        """The leader duty: a sweep at once, then every interval until cancelled, and one
        whenever a gone broker's orphan grace ends (the registry's watch says when a broker
        vanished): a crashed broker's bundles are announced when its grace ends, not up to an
        interval later. In between, announced moves are handed over as their hand-over waits
        end, and orphans held back for the governor's recovery budget go as soon as a quarter of
        the recovery slots in use are free again (:meth:`run_held`), each without a walk of the
        whole table; the whole table is swept every interval all the same.

        A quarter, not all: a broker's recovery slots hold two Own batches' worth of bundles
        (``governor.recovery_per_broker``), so that one batch is taken while the next is on its
        way, and the next pass starts as soon as one batch has settled."""
        # Subscribed before the first sweep: a broker gone after it is told of by the watch.
        watch = guard(self._follow_registry(self._registry.changes()), name="monitor-registry")
        try:
            await self._lead(term)
        finally:
            await cancel_and_wait(watch)

    async def _lead(self, term: int) -> None:
        last_full = -math.inf  # a new leader sweeps at once (and retries until one ran)
        last_pass = -math.inf
        swept = False
        unwritten_retry_s = GRACE_RETRY_S
        while True:
            self._registry_changed.clear()
            now = self._clock.monotonic()
            full_at = min(
                last_full + self._settings.interval_s,
                min(self._grace_ends.values(), default=math.inf) + _GRACE_SLACK_S,
            )
            if now >= full_at - _SLACK_S:
                report = await self.run_once(term)
                last_full = self._clock.monotonic()
                if report.skipped is None:
                    swept = True
                else:
                    self._retry_graces(last_full)
                if not swept:
                    last_full += GRACE_RETRY_S - self._settings.interval_s
                elif report.unwritten:
                    # Writes the channel did not take (a slow channel in a big failover, say):
                    # again in a second, not an interval later; later each time it goes on.
                    last_full += unwritten_retry_s - self._settings.interval_s
                    unwritten_retry_s = min(2 * unwritten_retry_s, self._settings.interval_s)
                else:
                    unwritten_retry_s = GRACE_RETRY_S
                continue
            # Passes are spaced a little: hand-overs come due in the batches their
            # announcements were written in, and one pass takes every one due by then.
            earliest = last_pass + HANDOVER_PASS_GAP_S
            due = min(self._due.values(), default=None)
            wake = full_at if due is None else min(full_at, max(due, earliest))
            if self._held:
                # A pass once a quarter of the recovery slots in use are free again, within a
                # second at most; with none in use, there is nothing to wait for but the second.
                in_flight = self._governor.in_flight(MoveKind.RECOVERY)
                limit = min(wake, now + 1.0)
                if in_flight:
                    with contextlib.suppress(DeadlineError):
                        await within(
                            self._clock,
                            max(0.0, limit - now),
                            self._governor.wait_in_flight_at_most(
                                MoveKind.RECOVERY, in_flight * 3 // 4
                            ),
                            "recovery slots",
                        )
                    wake = earliest  # but not sooner than the spacing allows
                else:
                    wake = max(limit, earliest)
            now = self._clock.monotonic()
            if wake > now:
                with contextlib.suppress(DeadlineError):
                    await within(
                        self._clock, wake - now, self._registry_changed.wait(), "a gone broker"
                    )
                if self._registry_changed.is_set():
                    continue  # a broker came or went: when is the next full sweep due?
                now = self._clock.monotonic()
            # Only sweeps and passes, run by this loop, change ``_due``: ``due`` is still its
            # earliest.
            if now < full_at - _SLACK_S and (self._held or (due is not None and due <= now)):
                passed = await self.run_held(term)
                last_pass = self._clock.monotonic()
                if passed.unwritten:  # its bundles are the next full sweep's: soon
                    retry_at = last_pass + unwritten_retry_s - self._settings.interval_s
                    last_full = min(last_full, retry_at)

    async def _follow_registry(self, changes: AsyncIterator[RegistryEvent]) -> None:
        """Note when each broker that vanishes from the registry ends its grace (one that
        registers again has none), and wake the duty."""
        grace_s = self._settings.orphan_cleanup_grace_s
        async for event in changes:
            since = self._registry.absent_since(event.broker) if event.value is None else None
            if since is None:
                self._grace_ends.pop(event.broker, None)
            else:
                self._grace_ends[event.broker] = since + grace_s
            self._registry_changed.set()

    def _note_graces(self, sweep: _Sweep) -> None:
        """After a full sweep: the graces of the gone brokers it left waiting, and of those the
        watch told of since it began; the ones that ended before it began it has dealt with."""
        grace_s = self._settings.orphan_cleanup_grace_s
        ends = {b: t for b, t in self._grace_ends.items() if t > sweep.mono}
        for broker, gone_s in sweep.waiting.items():
            ends[broker] = sweep.mono + grace_s - gone_s
        self._grace_ends = ends

    def _retry_graces(self, now: float) -> None:
        """A skipped sweep dealt with no grace that ended: try again shortly."""
        for broker, at in self._grace_ends.items():
            if at <= now:
                self._grace_ends[broker] = now + GRACE_RETRY_S

    async def run_held(self, term: int) -> SweepReport:
        """Hand over the orphans sweeps held back for the recovery budget, and the announced
        moves whose hand-over wait has ended, as far as the budget lets, without walking the
        whole table.

        Each is checked on its value now by the same rules as in a full sweep (:meth:`_check`).
        A held-back orphan whose value changed since it was held back is left to the next full
        sweep, as is every other bundle.
        """
        reason = self._cannot_sweep(term)
        sweep = None if reason is not None else self._new_sweep(term)
        if sweep is None or sweep.skipped is not None:
            return SweepReport(skipped=reason if sweep is None else sweep.skipped)
        held, self._held = self._held, {}
        due = [bundle for bundle, at in self._due.items() if at <= sweep.mono]
        for bundle in due:
            del self._due[bundle]
        pending = itertools.chain(held.items(), ((bundle, None) for bundle in due))
        table = self._follower.table
        try:
            for n, (bundle, seen) in enumerate(pending, 1):
                if n % SWEEP_SLICE == 0:
                    await yield_now()  # as in a full sweep
                value = table.get(bundle)
                if value is None or (seen is not None and value != seen):
                    continue
                if value.state is _S.Owned and value.dst_broker in sweep.live:
                    continue  # as in a full sweep
                if len(sweep.full) >= len(sweep.live):
                    self._held[bundle] = value  # no broker has a slot left
                    continue
                if not await self._check_in(sweep, bundle, value):
                    break
            await self._settle_writes(sweep)
        finally:
            for _, _, task in sweep.writes:
                task.cancel()  # only left running when the sweep itself was cancelled
        return sweep.report()

    def _cannot_sweep(self, term: int) -> str | None:
        """Why no sweep of ``term`` may run now, if none may."""
        if self._deposed(term):
            return f"the channel shows a term above {term}"
        if not self._follower.is_ready:
            return "the channel is not caught up yet"
        return None

    def _new_sweep(self, term: int) -> _Sweep:
        """A sweep of ``term`` starting now; it leaves orphans and stuck states alone in safe
        mode (an unreachable registry says nothing about who is alive)."""
        return _Sweep(
            term=term,
            now_ms=self._clock.now_ms(),
            mono=self._clock.monotonic(),
            live=self._registry.brokers(),
            skipped=None
            if self._registry.reachable
            else "safe mode: the broker registry cannot be reached",
        )

    async def run_once(self, term: int) -> SweepReport:
        """One sweep as the leader of ``term``; failures of single fixes are logged and counted."""
        reason = self._cannot_sweep(term)
        if reason is not None:
            return SweepReport(skipped=reason)
        sweep = self._new_sweep(term)
        live = sweep.live
        self._held = {}  # the sweep finds again whatever is still held back, or waiting
        self._due = {}
        table = self._follower.table
        self._forget_undated(table)
        if self._announced:
            self._announced = {
                (bundle, version): t
                for (bundle, version), t in self._announced.items()
                if (value := table.get(bundle)) is not None and value.version_id == version
            }
        # Bundles Owned by a live broker, the common case, are left as _check leaves them,
        # without looking at each: the table keeps the others at hand.
        bundles = table.not_owned_by(live)
        try:
            for n, bundle in enumerate(bundles, 1):
                if n % SWEEP_SLICE == 0:
                    # Lookups and keepalives run between slices. Nothing the sweep decides
                    # depends on not yielding: each bundle is checked on its value as it is then,
                    # each write re-checks that its bundle did not move on, and the store is
                    # asked about a gone broker after every wait has ended.
                    await yield_now()
                value = table.get(bundle)
                if value is None:
                    continue  # tombstoned since the sweep began
                if value.state is _S.Owned and value.dst_broker in live:
                    continue  # Owned since the sweep began, and one _check leaves as it is
                if not await self._check_in(sweep, bundle, value):
                    break
            await self._settle_writes(sweep)
        finally:
            for _, _, task in sweep.writes:
                task.cancel()  # only left running when the sweep itself was cancelled
        if sweep.skipped is None:
            self._note_cancelled(sweep.waiting, live)
            self._note_graces(sweep)
            # A broker the table no longer names starts a new grace if it is named again.
            self._gone.keep_only(sweep.away)
        return sweep.report()

    async def _check_in(self, sweep: _Sweep, bundle: BundleId, value: ServiceUnitStateData) -> bool:
        """Check one bundle in ``sweep``, a failure logged and counted as the sweep's; False
        (and the sweep marked skipped) when the channel shows that this leader was deposed."""
        if self._deposed(sweep.term):
            probe("monitor.deposed")
            sweep.skipped = f"the channel shows a term above {sweep.term}"
            return False
        try:
            await self._check(bundle, value, sweep)
        except LbdError as e:
            sweep.failed.append((bundle, str(e)))
            _log.warning("monitor: could not fix %s: %s", bundle, e)
        return True

    async def _settle_writes(self, sweep: _Sweep) -> None:
        """Wait for every write the sweep started; account each as a fix or a failure."""
        if sweep.writes:
            await asyncio.wait([task for _, _, task in sweep.writes])
        for fix, seen, task in sweep.writes:
            error = task.exception()
            if error is not None:
                if not isinstance(error, LbdError):
                    raise error
                self._count(fix.kind, FAILURE)
                sweep.failed.append((fix.bundle, str(error)))
                # The channel did not take it (down, or slower than the publish timeout).
                sweep.unwritten += isinstance(error, UnavailableError)
                _log.warning("monitor: could not fix %s: %s", fix.bundle, error)
                continue
            sweep.fixes.append(fix)
            _log.log(
                logging.INFO if len(sweep.fixes) <= DECISION_LINES else logging.DEBUG,
                "monitor decision: bundle=%s kind=%s wrote=%s dst=%s term=%d reason=%s",
                fix.bundle,
                fix.kind,
                "tombstone" if fix.state is None else fix.state.value,
                fix.dst or "-",
                sweep.term,
                fix.reason,
            )
            self._count(fix.kind, SUCCESS)
            self._decisions.record(
                fix.kind,
                fix.bundle,
                reason=fix.reason,
                source="monitor",
                src=server_of(seen),
                dst=fix.dst,
            )
        sweep.writes.clear()
        if len(sweep.fixes) > DECISION_LINES:
            _log.info(
                "monitor: %d more decisions in this sweep (term %d), logged at DEBUG; "
                "`lbd ctl decisions` lists every one",
                len(sweep.fixes) - DECISION_LINES,
                sweep.term,
            )

    def _start_write(
        self,
        sweep: _Sweep,
        fix: Fix,
        seen: ServiceUnitStateData,
        write: Awaitable[object],
        on_persisted: Callable[[], None] | None = None,
    ) -> None:
        """Publish ``write`` in the background, in the window slot the caller took."""

        async def run() -> object:
            try:
                result = await write
            finally:
                sweep.window.release()
            if on_persisted is not None:
                on_persisted()
            return result

        sweep.writes.append((fix, seen, asyncio.ensure_future(run())))

    # -- the rules --------------------------------------------------------------------------

    async def _check(
        self, bundle: BundleId, value: ServiceUnitStateData, sweep: _Sweep
    ) -> Fix | None:
        age_ms = self._age_ms(bundle, value, sweep.now_ms)
        if value.state in (_S.Free, _S.Deleted):
            if age_ms < self._settings.tombstone_after_s * 1000:
                return None
            reason = f"{value.state.value} for {age_ms / 1000:.0f}s"
            fix = Fix(bundle, "tombstone", None, None, reason)
            await sweep.window.acquire()
            self._start_write(sweep, fix, value, self._proposer.tombstone(bundle))
            return fix
        if sweep.skipped is not None:
            return None
        server = server_of(value)
        if server is not None and server not in sweep.live:
            gone_s = self._away_s(server, sweep)
            if gone_s < self._settings.orphan_cleanup_grace_s:
                sweep.waiting[server] = gone_s
                return None
            return await self._orphan(bundle, value, server, sweep, f"{server} away {gone_s:.0f}s")
        if value.state.is_in_flight and age_ms >= self._settings.inflight_timeout_s * 1000:
            readable_since = self._channel_readable_since()
            if (
                readable_since is not None
                and sweep.mono - readable_since < self._settings.inflight_timeout_s
            ):
                # Nobody could move it on while the channel was unreadable: its sidecars get
                # the whole timeout again once it reads through.
                return None
            reason = f"{value.state.value} for {age_ms / 1000:.0f}s"
            return await self._unstick(bundle, value, sweep, reason)
        return None

    async def _orphan(
        self,
        bundle: BundleId,
        value: ServiceUnitStateData,
        server: BrokerId,
        sweep: _Sweep,
        reason: str,
    ) -> Fix | None:
        """Move a bundle off a gone broker in two steps: announce (``Releasing`` from it), then,
        a hand-over wait after this leader first saw the announcement, tell the new broker
        (``Assigning``). The gone broker's sidecar, if it still reads the channel, releases the
        bundle itself meanwhile; if it cannot, its broker's lease has run out by then."""
        if value.state is _S.Splitting and await self._split_progressed(bundle, value):
            if not await self._cut_layout(bundle, value):
                return None
            probe("split.finish")
            return await self._force(
                bundle,
                sweep,
                "orphan",
                _S.Deleted,
                None,
                server,
                f"{reason}; finishing the split",
                seen=value,
            )
        if value.state is not _S.Releasing:
            selection = await self._choose(bundle, sweep, avoid=server)
            term, dst = sweep.term, selection.broker

            def persisted() -> None:
                # The wait may count from here, before this sidecar reads the announcement.
                at = self._clock.monotonic()
                self._written_at[bundle] = (at, dst, term)
                self._due[bundle] = at + self._handover_wait_s

            probe("orphan.announce")
            return await self._force(
                bundle,
                sweep,
                "orphan",
                _S.Releasing,
                dst,
                server,
                f"{reason}; announcing the move; {selection.reason}",
                seen=value,
                on_persisted=persisted,
            )
        # Due by the time the sweep read the table: the store's word on the gone broker, asked
        # once during the sweep, is then read after every hand-over's wait ended.
        now = sweep.mono
        written = self._written_at.pop(bundle, None)
        start = now
        if written is not None and value.force:
            at, dst, term = written
            if (dst, term) == (value.dst_broker, value.leader_term):
                start = at  # this very announcement, persisted before this sweep read it
        seen = self._announced.setdefault((bundle, value.version_id), start)
        announced_s = now - seen
        wait_s = self._handover_wait_s
        if announced_s < wait_s:
            probe("orphan.wait")
            sweep.handing_over[bundle] = announced_s
            self._due[bundle] = seen + wait_s
            return None
        if await self._registered_now(server, sweep):
            probe("orphan.returned")
            return None  # it came back: its sidecar finishes the move itself
        dst = value.dst_broker
        if dst is None or dst not in sweep.live:
            selection = await self._choose(bundle, sweep, avoid=server)
            dst = selection.broker
            reason = f"{reason}; {selection.reason}"
        if dst in sweep.full and not self._governor.holds(bundle):
            # Its broker's budget was full when this sweep last asked: held back at once.
            sweep.handing_over[bundle] = announced_s
            self._held[bundle] = value
            return None
        reason = f"{reason}; announced {announced_s:.0f}s ago (hand-over wait {wait_s:g}s)"
        # The recovery budget paces what lands on each broker at once.
        # A bundle whose move (a drain's, say) was under way keeps that move's slot, which the
        # bundle gives back when it settles; waiting for a second slot would wait for itself.
        # Never waited for inside the sweep: the slots it waits for may be held by bundles only
        # this very sweep can unstick. An orphan the budget holds back waits for the next sweep.
        slot = None
        if not self._governor.holds(bundle):
            slot = self._governor.try_admit(Ticket(bundle, None, dst, MoveKind.RECOVERY))
            if slot is None:
                sweep.handing_over[bundle] = announced_s
                if dst is not None:
                    sweep.full.add(dst)
                self._held[bundle] = value
                return None
        probe("orphan.handover")
        assigned = await self._force(
            bundle, sweep, "orphan", _S.Assigning, dst, server, reason, seen=value
        )
        if assigned is None and slot is not None:
            slot.release()  # nothing was written: the slot is not in use
        return assigned

    async def _choose(
        self, bundle: BundleId, sweep: _Sweep, *, avoid: BrokerId | None
    ) -> Selection:
        """A live broker for ``bundle``, placed by the namespace records read once per sweep."""
        if sweep.records is None:
            sweep.records = await self._namespaces.list()
        return await self._assigner.choose(
            bundle, among=sweep.live, avoid=avoid, records=sweep.records
        )

    async def _registered_now(self, broker: BrokerId, sweep: _Sweep) -> bool:
        """Whether the store itself (not the watch, which may lag) has ``broker`` registered,
        asked once per sweep."""
        known = sweep.registered_now.get(broker)
        if known is None:
            known = sweep.registered_now[broker] = await self._registry.registered_now(broker)
        return known

    async def _unstick(
        self, bundle: BundleId, value: ServiceUnitStateData, sweep: _Sweep, reason: str
    ) -> Fix | None:
        """Fix an in-flight value stuck with its server registered, never letting a second
        broker serve: a split is finished or undone, a move to a broker that never finished
        taking the bundle is announced again elsewhere, a move its source never finished is
        undone."""
        src = value.source_broker
        if value.state is _S.Splitting and await self._split_progressed(bundle, value):
            if not await self._cut_layout(bundle, value):
                return None
            probe("split.finish")
            return await self._force(
                bundle,
                sweep,
                "inflight",
                _S.Deleted,
                None,
                src,
                f"{reason}; finishing the split",
                seen=value,
            )
        if value.state is _S.Assigning:
            # Its destination may have taken it: it releases it first, as in a transfer.
            stuck_on = value.dst_broker
            probe("inflight.reassign")
            selection = await self._choose(bundle, sweep, avoid=stuck_on)
            return await self._force(
                bundle,
                sweep,
                "inflight",
                _S.Releasing,
                selection.broker,
                stuck_on,
                f"{reason}; moving it off {stuck_on}; {selection.reason}",
                seen=value,
            )
        # Releasing, or a split that never got further: its source still holds it; undone.
        probe("inflight.undo")
        return await self._force(
            bundle,
            sweep,
            "inflight",
            _S.Owned,
            src,
            src,
            f"{reason}; back to its source",
            seen=value,
        )

    async def _force(
        self,
        bundle: BundleId,
        sweep: _Sweep,
        kind: str,
        state: ServiceUnitState,
        dst: BrokerId | None,
        src: BrokerId | None,
        reason: str,
        *,
        seen: ServiceUnitStateData,
        on_persisted: Callable[[], None] | None = None,
    ) -> Fix | None:
        """Start writing the forced value, on top of ``seen`` (the value the fix was decided
        on), or nothing if the bundle moved on since: a fix decided on an old value (the sweep
        awaited the registry, the layout, or a slot of its write window meanwhile) must never
        land on a newer one. The value is made in the same step as this check, its version
        following ``seen``; ``on_persisted`` runs once the write is persisted."""
        await sweep.window.acquire()
        if self._follower.get(bundle) != seen:
            sweep.window.release()
            _log.info("%s moved on since the sweep read it: %s not written", bundle, state.value)
            return None
        value = self._proposer.next_value(
            bundle, state, dst=dst, src=src, force=True, leader_term=sweep.term
        )
        fix = Fix(bundle, kind, state, dst, reason)
        self._start_write(sweep, fix, seen, self._proposer.publish(bundle, value), on_persisted)
        return fix

    async def _cut_layout(self, bundle: BundleId, value: ServiceUnitStateData) -> bool:
        """Cut the parent in its namespace layout as the split planned, before the split is
        finished as Deleted (idempotent: a layout already cut is left alone). A parent Deleted
        while the layout still held it would leave its children out of every lookup. False
        (and the split left as it is) when the split's children cannot be laid out."""
        parsed = parse_bundle_id(bundle)
        try:
            at = split_points(bundle, value.split_children or {})
            await self._namespaces.split(parsed.namespace, parsed.range, at)
        except NotFoundError:
            return True  # the namespace, or the parent, is gone from the layout already
        except InvalidInputError as e:
            _log.error("cannot finish the split of %s: %s", bundle, e)
            return False
        return True

    async def _split_progressed(self, bundle: BundleId, value: ServiceUnitStateData) -> bool:
        """Whether a child has a value already, or the namespace layout no longer has the parent
        (either way, restoring the parent would leave a bundle that no longer exists)."""
        if any(child in self._follower.table for child in value.split_children or {}):
            return True
        parsed = parse_bundle_id(bundle)
        try:
            record = await self._namespaces.refresh(parsed.namespace)
        except NotFoundError:
            return True
        return parsed.range not in {b.range for b in record.bundles().bundles()}

    # -- bookkeeping --------------------------------------------------------------------------

    def _away_s(self, broker: BrokerId, sweep: _Sweep) -> float:
        """Seconds the unregistered ``broker`` has been away, as of the sweep's start."""
        away = sweep.away.get(broker)
        if away is None:  # asked once per sweep (one that vanished unseen: since noticed)
            away = sweep.away[broker] = self._gone.away_s(broker, sweep.mono)
        return away

    def _age_ms(self, bundle: BundleId, value: ServiceUnitStateData, now_ms: int) -> int:
        if value.timestamp_ms > 0:
            return now_ms - value.timestamp_ms
        # A writer that sets no timestamp: age it from when this sidecar first saw the value.
        return now_ms - self._undated.setdefault((bundle, value.version_id), now_ms)

    def _forget_undated(self, table: StateTable) -> None:
        if not self._undated:
            return
        current = {(b, v.version_id) for b, v in table.items() if v.timestamp_ms == 0}
        self._undated = {k: t for k, t in self._undated.items() if k in current}

    def _note_cancelled(
        self, waiting: Mapping[BrokerId, float], live: Mapping[BrokerId, BrokerInfo]
    ) -> None:
        for broker in sorted(self._waiting - waiting.keys()):
            if broker in live:
                probe("orphan.grace_kept")
                _log.info("monitor: %s registered again: orphan cleanup cancelled", broker)
                self._count("orphan", CANCEL)
        self._waiting = set(waiting)

    def _deposed(self, term: int) -> bool:
        return self._follower.table.highest_term > term

    def _count(self, kind: str, result: str) -> None:
        self._metrics.cleanup_series(kind, result).inc()
