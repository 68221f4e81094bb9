"""Plans, operations and the execution governor on in-process sidecars: plan, execute, track,
cancel; the governor's limits as the channel shows them; admin moves through the leader."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import pytest
from harness import DEFAULT_NAMESPACE, Harness, Sidecar
from rig import QUIET, publish_load, settle, turns

from lbd.core.admission import MoveKind
from lbd.core.bundles import NamespaceBundles
from lbd.core.errors import NotFoundError, PreconditionError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.operations import Move, MoveState, OperationKind, OperationState
from lbd.core.settings import MB, Budget, GovernorConfig, OperationsConfig, SheddingConfig
from lbd.core.state import ServiceUnitState
from lbd.core.table import StateTable
from lbd.ports.errors import UnavailableError

S = ServiceUnitState
BUNDLES = [b.id for b in NamespaceBundles.default(DEFAULT_NAMESPACE).bundles()]
ONE_AT_A_TIME = GovernorConfig(
    balancing=Budget(per_broker=1, cluster=1, per_minute=0), recovery=Budget(0, 0, 0)
)
CONFIG = dataclasses.replace(
    QUIET,
    shedding=SheddingConfig(hit_count_threshold=0, min_throughput_threshold=0.0),
    shedding_strategy="transfer_shedder",
    governor=ONE_AT_A_TIME,
    operations=OperationsConfig(plan_ttl_s=60.0),
)


async def all_on_first(h: Harness) -> tuple[Sidecar, Sidecar]:
    """Two sidecars with fake brokers; every bundle of public/default Owned by broker-0."""
    a, b = await h.start(2, auto_ack=False, fake_broker=True)
    for bundle in BUNDLES:
        assert await a.operations.assign(bundle, a.me) == a.me
    await h.idle()
    await settle(h.clock, lambda: any(s.elector.is_leader for s in h.live()))
    return a, b


def max_in_flight(h: Harness) -> tuple[int, dict[BrokerId, int]]:
    """Replaying the channel: the most bundles in Releasing/Assigning at any position, in all
    and per broker (as source or destination)."""
    table = StateTable()
    most, per_broker = 0, Counter[BrokerId]()
    for message in h.log.messages:
        table.apply(message.position, BundleId(message.key), message.value)
        moving = [v for _, v in table.items() if v.state in (S.Releasing, S.Assigning)]
        most = max(most, len(moving))
        counts = Counter(b for v in moving for b in {v.dst_broker, v.source_broker} if b)
        for broker, n in counts.items():
            per_broker[broker] = max(per_broker[broker], n)
    return most, dict(per_broker)


async def test_a_plan_is_kept_then_executed_once_and_tracked_to_the_end() -> None:
    async with Harness(config=CONFIG) as h:
        a, b = await all_on_first(h)
        leader = h.elected_now()
        await publish_load(h, a.me, 0.9, BUNDLES, 25 * MB)
        await publish_load(h, b.me, 0.1, [], 25 * MB)
        await turns(lambda: len(leader.loads.brokers()) == 2)

        before = len(h.log)
        report = await leader.unload_scheduler.run_cycle(dry_run=True)
        plan = report.plan
        assert plan is not None and plan.moves and report.operation is None
        assert len(h.log) == before  # a plan moves nothing
        assert plan.std_before > plan.std_after >= 0
        assert plan.bytes_to_move == pytest.approx(25 * MB * len(plan.moves))
        assert all(m.src == a.me and m.dst == b.me for m in plan.moves)

        op = await leader.unload_scheduler.execute(plan.id)
        assert op.kind is OperationKind.PLAN and op.plan_id == plan.id
        seen = []
        async for current in _watch(h, leader, op.id):
            seen.append((current.version, current.moves_done))
        assert op.state is OperationState.SUCCEEDED and op.ended_at_ms > 0
        assert [m.state for m in op.moves] == [MoveState.DONE] * len(plan.moves)
        assert all(m.unavailable_ms is not None and m.unavailable_ms >= 0 for m in op.moves)
        assert seen[-1][1] == len(plan.moves) and [v for v, _ in seen] == sorted(v for v, _ in seen)
        for move in plan.moves:
            assert h.owner(move.bundle) == b.me
        assert h.violations == []
        logged = [d for d in leader.decisions.since() if d.operation_id == op.id]
        assert {(d.kind, d.source, d.bundle) for d in logged} == {
            ("transfer", "plan", m.bundle) for m in plan.moves
        }
        with pytest.raises(NotFoundError, match="no plan"):
            await leader.unload_scheduler.execute(plan.id)


async def test_an_expired_plan_is_refused() -> None:
    async with Harness(config=CONFIG) as h:
        a, b = await all_on_first(h)
        leader = h.elected_now()
        await publish_load(h, a.me, 0.9, BUNDLES, 25 * MB)
        await publish_load(h, b.me, 0.1, [], 25 * MB)
        await turns(lambda: len(leader.loads.brokers()) == 2)
        plan = (await leader.unload_scheduler.run_cycle(dry_run=True)).plan
        assert plan is not None
        await h.clock.run_for(61)
        with pytest.raises(PreconditionError, match="expired"):
            await leader.unload_scheduler.execute(plan.id)
        assert all(h.owner(b) == a.me for b in BUNDLES)


async def test_cancel_lets_the_move_in_flight_finish_and_starts_no_other() -> None:
    async with Harness(config=CONFIG) as h:
        a, b = await all_on_first(h)
        leader = h.elected_now()
        moves = [Move(bundle, a.me, b.me, "Admin") for bundle in BUNDLES[:3]]
        op = leader.tracker.start_operation(OperationKind.ADMIN, "three moves", moves)
        await turns(lambda: op.moves[0].state is MoveState.IN_FLIGHT)
        assert leader.governor.queued(MoveKind.BALANCING) == 2  # one at a time
        assert leader.tracker.cancel(op.id).state is OperationState.CANCELLING
        await settle(h.clock, lambda: op.state.finished)
        assert op.state is OperationState.CANCELLED
        assert [m.state for m in op.moves] == [
            MoveState.DONE,
            MoveState.CANCELLED,
            MoveState.CANCELLED,
        ]
        assert [h.owner(m.bundle) for m in op.moves] == [b.me, a.me, a.me]
        assert leader.governor.queued(MoveKind.BALANCING) == 0
        assert leader.governor.in_flight(MoveKind.BALANCING) == 0
        assert leader.tracker.list_operations(active_only=True) == []
        assert h.violations == []


async def test_a_stopping_sidecar_ends_its_operations_and_wakes_whoever_waits_for_them() -> None:
    async with Harness(config=CONFIG) as h:
        a, b = await all_on_first(h)
        leader = h.elected_now()
        moves = [Move(bundle, a.me, b.me, "Admin") for bundle in BUNDLES[:3]]
        op = leader.tracker.start_operation(OperationKind.ADMIN, "three moves", moves)
        await turns(lambda: leader.governor.queued(MoveKind.BALANCING) == 2)
        waiter = asyncio.ensure_future(leader.tracker.wait(op.id))
        await leader.tracker.close()
        # Not left waiting for an operation nobody runs any more (a crashed leader's, say).
        ended = await asyncio.wait_for(waiter, 5)
        assert ended.state is OperationState.CANCELLED
        assert "stopped" in (ended.error or "")
        assert leader.tracker.list_operations(active_only=True) == []


async def test_the_governor_holds_its_limits_as_the_channel_shows_them() -> None:
    budget = GovernorConfig(balancing=Budget(per_broker=2, cluster=3, per_minute=0))
    config = dataclasses.replace(CONFIG, governor=budget)
    async with Harness(config=config) as h:
        sidecars = await h.start(4, auto_ack=False, fake_broker=True)
        await settle(h.clock, lambda: any(s.elector.is_leader for s in h.live()))
        leader = h.elected_now()
        for bundle in BUNDLES:
            assert await sidecars[0].operations.assign(bundle, sidecars[0].me)
        await h.idle()
        start = len(h.log)
        dsts = [s.me for s in sidecars[1:]]
        moves = [
            Move(bundle, sidecars[0].me, dsts[i % 3], "Admin") for i, bundle in enumerate(BUNDLES)
        ]
        op = leader.tracker.start_operation(OperationKind.ADMIN, "spread", moves)
        await settle(h.clock, lambda: op.state.finished)
        assert op.state is OperationState.SUCCEEDED, op.error
        assert len(h.log) > start
        most, per_broker = max_in_flight(h)
        assert most <= 3 and max(per_broker.values()) <= 2
        assert [h.owner(m.bundle) for m in moves] == [m.dst for m in moves]
        assert h.violations == []


async def test_a_move_whose_bundle_changed_meanwhile_is_skipped_and_writes_nothing() -> None:
    async with Harness(config=CONFIG) as h:
        a, b = await all_on_first(h)
        leader = h.elected_now()
        # The bundle moved (to b) after the operation was planned from a.
        assert await h.admin_move(BUNDLES[0], b.me) == a.me
        await h.idle()
        before = len(h.log)
        op = leader.tracker.start_operation(
            OperationKind.ADMIN, "stale", [Move(BUNDLES[0], a.me, b.me, "Admin")]
        )
        await settle(h.clock, lambda: op.state.finished)
        assert op.moves[0].state is MoveState.SKIPPED
        assert "Owned by broker-1 now" in op.moves[0].error
        assert op.state is OperationState.SUCCEEDED  # nothing failed: there was nothing to do
        assert len(h.log) == before


async def test_an_admin_transfer_runs_on_the_leader_as_an_operation() -> None:
    async with Harness(config=CONFIG) as h:
        a, b = await all_on_first(h)
        leader = h.elected_now()
        ops = leader.tracker.list_operations()
        assert await h.admin_move(BUNDLES[1], b.me) == a.me
        assert h.owner(BUNDLES[1]) == b.me
        [op] = [op for op in leader.tracker.list_operations() if op not in ops]
        assert (op.kind, op.state) == (OperationKind.ADMIN, OperationState.SUCCEEDED)
        assert [(m.bundle, m.src, m.dst, m.state) for m in op.moves] == [
            (BUNDLES[1], a.me, b.me, MoveState.DONE)
        ]
        metric = leader.metrics.registry.get_sample_value(
            "lbd_unload_total", {"result": "Success", "reason": "Admin"}
        )
        assert metric == 1.0
        # The destination measured how long the bundle went unserved.
        count = b.metrics.registry.get_sample_value("lbd_transfer_unavailable_seconds_count")
        assert count == 1.0


async def _watch(h: Harness, leader: Sidecar, op_id: str):  # type: ignore[no-untyped-def]
    """The tracker's watch, with the clock moving while it waits."""
    import asyncio

    watcher = leader.tracker.watch(op_id)
    while True:
        step = asyncio.ensure_future(anext(watcher))
        while not step.done():
            await h.clock.run_for(0.05)
        try:
            yield step.result()
        except StopAsyncIteration:
            return


async def test_a_new_broker_is_filled_as_soon_as_it_reports_not_at_the_next_interval() -> None:
    config = dataclasses.replace(
        CONFIG,
        shedding_strategy="cluster_planner",
        governor=GovernorConfig(balancing=Budget(per_broker=2, cluster=2, per_minute=0)),
    )
    async with Harness(config=config) as h:
        a, b = await all_on_first(h)
        leader = h.elected_now()
        await publish_load(h, a.me, 0.8, BUNDLES, 25 * MB)
        await publish_load(h, b.me, 0.1, [], 25 * MB)
        await turns(lambda: len(leader.loads.brokers()) == 2)
        await h.clock.run_for(1)
        assert leader.tracker.list_operations() == []  # the interval (NEVER) has not come
        c = await h.add("broker-2", auto_ack=False, fake_broker=True)
        await h.ready()
        await publish_load(h, c.me, 0.0, [], 25 * MB)
        # The leader's poll sees the report within a second; the shedding interval is NEVER.
        await settle(h.clock, lambda: bool(leader.tracker.list_operations()), seconds=3)
        op = leader.tracker.list_operations()[0]
        assert op.kind is OperationKind.SHEDDING
        await settle(h.clock, lambda: op.state.finished)
        assert op.state is OperationState.SUCCEEDED, op.error
        assert c.me in {m.dst for m in op.moves}
        assert all(h.owner(m.bundle) == m.dst for m in op.moves)
        assert h.violations == []


async def test_only_the_sidecar_that_leads_starts_an_operation() -> None:
    async with Harness(config=CONFIG) as h:
        a, b = await all_on_first(h)
        follower = next(s for s in h.live() if not s.elector.is_leader)
        with pytest.raises(UnavailableError, match="no longer leads"):
            follower.tracker.start_operation(
                OperationKind.ADMIN, "not here", [Move(BUNDLES[0], a.me, b.me, "Admin")]
            )
        assert follower.tracker.list_operations() == []
        assert h.owner(BUNDLES[0]) == a.me
