"""Broker maintenance on in-process sidecars: a cordon keeps new bundles off (and explicit moves
to it are refused), a drain empties a broker under the governor's limits with no dual serving, a
decommissioned broker stays deregistered until uncordoned, a new leader resumes a drain, and an
uncordon stops one."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import grpc
import pytest
from harness import Harness, Sidecar
from rig import QUIET, settle, turns

from lbd.core.bundles import NamespaceBundles
from lbd.core.errors import InvalidInputError, NotFoundError, PreconditionError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.maintenance import MaintenanceMode, MaintenanceRecord
from lbd.core.names import NamespaceName
from lbd.core.operations import MoveState, Operation, OperationKind, OperationState
from lbd.core.settings import Budget, GovernorConfig
from lbd.core.state import ServiceUnitState
from lbd.core.table import StateTable
from lbd.gen.v1 import lbd_pb2
from lbd.ports.errors import UnavailableError
from tests.unit.api.served import serve_api, until

S = ServiceUnitState
M = MaintenanceMode
WAIT_S = 60.0
"""Real-time bound of a whole drain in process (moves need no clock time, only loop turns)."""


def budget(per_broker: int, cluster: int, per_minute: int) -> GovernorConfig:
    return GovernorConfig(balancing=Budget(per_broker, cluster, per_minute))


async def namespace_on(h: Harness, name: str, bundles: int, owner: Sidecar) -> list[BundleId]:
    """Create ``name`` with ``bundles`` bundles, every one Owned by ``owner``."""
    ns = NamespaceName.parse(name)
    record = await owner.namespaces.create(ns, bundles)
    ids = [b.id for b in record.bundles().bundles()]
    for start in range(0, len(ids), 50):
        chunk = ids[start : start + 50]
        owners = await asyncio.gather(*(owner.operations.assign(b, owner.me) for b in chunk))
        assert set(owners) == {owner.me}
    await h.idle()
    return ids


async def seen_everywhere(h: Harness, broker: BrokerId, mode: MaintenanceMode | None) -> None:
    await turns(lambda: all(s.maintenance.mode(broker) is mode for s in h.live()))


async def finished(h: Harness, leader: Sidecar, op: Operation) -> Operation:
    async with asyncio.timeout(WAIT_S):
        return await leader.tracker.wait(op.id)


def owned_by(h: Harness, bundles: list[BundleId]) -> Counter[BrokerId | None]:
    return Counter(h.owner(b) for b in bundles)


# -- the record -------------------------------------------------------------------------------


def test_a_maintenance_record_reads_back_what_it_wrote_and_names_what_is_wrong() -> None:
    broker = BrokerId("broker-1")
    record = MaintenanceRecord(broker, M.DRAINING, "disk swap", 1_700_000_000_000, "broker-0")
    assert MaintenanceRecord.from_json(broker, record.to_json()) == record
    assert record.describe() == "draining by broker-0 (reason: disk swap)"
    assert M.DECOMMISSIONING.draining and not M.CORDONED.draining
    with pytest.raises(InvalidInputError, match="mode 'resting' is not one of cordoned"):
        MaintenanceRecord.from_json(broker, b'{"mode": "resting"}')
    with pytest.raises(InvalidInputError, match="since_ms must be an integer >= 0"):
        MaintenanceRecord.from_json(broker, b'{"mode": "cordoned", "since_ms": -1}')
    with pytest.raises(InvalidInputError, match="not JSON"):
        MaintenanceRecord.from_json(broker, b"cordoned")


# -- cordon -----------------------------------------------------------------------------------


async def test_a_cordon_keeps_new_bundles_off_until_uncordoned() -> None:
    async with Harness(config=QUIET) as h:
        a, b, c = await h.start(3)
        record = await b.drainer.cordon(c.me, "disk swap")
        assert (record.mode, record.reason, record.who) == (M.CORDONED, "disk swap", b.me)
        await seen_everywhere(h, c.me, M.CORDONED)
        await a.namespaces.create(NamespaceName("t", "cordon"), 32)
        sidecars = [a, b, c]
        topics = [f"persistent://t/cordon/topic-{i}" for i in range(120)]
        first = [await sidecars[i % 3].lookup.lookup(t) for i, t in enumerate(topics[:60])]
        owners = Counter(r.owner.broker_id for r in first if r.owner is not None)
        assert sum(owners.values()) == 60 and c.me not in owners, owners
        # Even when asked on the cordoned broker's own sidecar (above) or with every other
        # broker excluded, nothing goes to it.
        with pytest.raises(UnavailableError, match="every candidate is cordoned"):
            await a.assigner.choose(first[0].bundle, exclude=(a.me, b.me))

        await a.drainer.uncordon(c.me)
        await seen_everywhere(h, c.me, None)
        rest = [await sidecars[i % 3].lookup.lookup(t) for i, t in enumerate(topics[60:])]
        again = Counter(r.owner.broker_id for r in rest if r.owner is not None)
        assert again[c.me] > 0, again


async def test_explicit_moves_to_a_cordoned_broker_are_refused_and_change_nothing() -> None:
    async with Harness(config=QUIET) as h:
        a, b = await h.start(2)
        bundles = await namespace_on(h, "t/refuse", 4, a)
        await a.drainer.cordon(b.me, "")
        await seen_everywhere(h, b.me, M.CORDONED)
        before = len(h.log)
        with pytest.raises(PreconditionError, match=r"transfer of .* refused: broker broker-1 is "):
            await h.admin_move(bundles[0], b.me)
        with pytest.raises(PreconditionError, match="broker broker-1 is cordoned by broker-0"):
            await h.admin_move(bundles[1], b.me)
        other = NamespaceBundles.default(NamespaceName("public", "default"), 4).bundles()[0].id
        with pytest.raises(PreconditionError, match=r"assignment of .* to broker-1 refused"):
            await a.operations.assign(other, b.me)
        assert len(h.log) == before
        # The shedder may move no bundle there either, bound by a placement rule or not.
        allowed = (await a.assigner.move_rules()).destinations(bundles)
        assert allowed == dict.fromkeys(bundles, frozenset({a.me}))
        await a.drainer.uncordon(b.me)
        await seen_everywhere(h, b.me, None)
        assert (await a.assigner.move_rules()).destinations(bundles) == {}


async def test_cordon_and_drain_requests_are_checked() -> None:
    async with Harness(config=QUIET) as h:
        (a,) = await h.start(1)
        leader = await h.elected()
        with pytest.raises(NotFoundError, match="broker nobody is not registered"):
            await a.drainer.cordon(BrokerId("nobody"))
        with pytest.raises(NotFoundError, match="broker nobody is not registered"):
            await leader.drainer.drain(BrokerId("nobody"))
        with pytest.raises(PreconditionError, match="it is the only registered broker"):
            await leader.drainer.drain(a.me)
        b = await h.add("broker-1")
        await h.ready()
        await a.drainer.cordon(b.me, "bad disk")
        with pytest.raises(PreconditionError, match=r"every other broker is cordoned \(broker-1\)"):
            await leader.drainer.decommission(a.me)
        assert a.maintenance.mode(a.me) is None  # nothing was written
        # A second cordon keeps the mode and takes the new reason.
        again = await a.drainer.cordon(b.me, "bad fan")
        assert (again.mode, again.reason) == (M.CORDONED, "bad fan")


# -- drain ------------------------------------------------------------------------------------


async def test_the_governor_holds_its_limits_under_a_drain_of_200_bundles() -> None:
    per_broker, cluster = 3, 5
    config = dataclasses.replace(QUIET, governor=budget(per_broker, cluster, 0))
    async with Harness(config=config) as h:
        a, b, c, d, e = await h.start(5, auto_ack=False, fake_broker=True)
        leader = await h.elected()
        bundles = await namespace_on(h, "t/drain", 200, d)
        # A second, smaller drain at the same time: two sources of 3 moves each would make 6,
        # so the cluster's limit is the one that binds while both run.
        others = await namespace_on(h, "t/drain-too", 20, e)
        start = len(h.log)

        op = await leader.drainer.drain(d.me)
        assert (op.kind, op.broker, len(op.moves)) == (OperationKind.DRAIN, d.me, 200)
        op_too = await leader.drainer.drain(e.me)
        await seen_everywhere(h, d.me, M.DRAINING)
        done, done_too = await finished(h, leader, op), await finished(h, leader, op_too)

        assert done.state is OperationState.SUCCEEDED, done.error
        assert done.moves_done == 200 and all(m.state is MoveState.DONE for m in done.moves)
        assert done_too.state is OperationState.SUCCEEDED and done_too.moves_done == 20
        owners = owned_by(h, bundles + others)
        assert sum(owners[s.me] for s in (a, b, c)) == 220, owners
        assert min(owners[s.me] for s in (a, b, c)) >= 60, owners  # spread over the rest
        # Replayed: from the drains' first write on, never more in flight than the budget.
        table = StateTable()
        most, most_at = 0, Counter[BrokerId]()
        for position, message in enumerate(h.log.messages):
            table.apply(message.position, BundleId(message.key), message.value)
            if position < start:
                continue  # the assignments before the drains
            moving = [v for _, v in table.items() if v.state in (S.Releasing, S.Assigning)]
            most = max(most, len(moving))
            at = Counter(x for v in moving for x in {v.source_broker, v.dst_broker} if x)
            for broker, count in at.items():
                most_at[broker] = max(most_at[broker], count)
        assert most == cluster, most  # the budget was used, and never exceeded
        assert max(most_at.values()) == per_broker == most_at[d.me], most_at
        assert h.violations == []
        # Drained: still cordoned, so that nothing comes back.
        await seen_everywhere(h, d.me, M.CORDONED)
        record = d.maintenance.get(d.me)
        assert record is not None and record.reason == f"drained by {op.id}"
        assert d.me in leader.registry.brokers()


async def test_a_decommissioned_broker_stays_deregistered_until_uncordoned() -> None:
    async with Harness(config=QUIET) as h:
        await h.start(3, auto_ack=False, fake_broker=True)
        leader = await h.elected()
        victim, other = [s for s in h.live() if s is not leader]
        bundles = await namespace_on(h, "t/decommission", 8, victim)

        op = await leader.drainer.decommission(victim.me)
        done = await finished(h, leader, op)

        assert done.state is OperationState.SUCCEEDED, done.error
        assert done.kind is OperationKind.DECOMMISSION and done.moves_done == 8
        assert victim.me not in owned_by(h, bundles)
        await seen_everywhere(h, victim.me, M.DECOMMISSIONED)
        await turns(lambda: all(victim.me not in s.registry.brokers() for s in h.live()))
        assert h.violations == []
        # Its broker comes back, its lease is lost and renewed: it stays deregistered.
        assert victim.broker is not None
        await victim.broker.disconnect()
        await victim.broker.connect(victim.link)
        h.metadata.revoke_lease(victim.metadata.lease_id)
        await h.clock.run_for(5)
        assert f"brokers/{victim.me}" not in h.metadata.list("brokers/")[0]
        assert all(victim.me not in s.registry.brokers() for s in h.live())
        with pytest.raises(PreconditionError, match=r"decommissioned .*uncordon it"):
            await leader.drainer.drain(victim.me)

        await other.drainer.uncordon(victim.me)
        await seen_everywhere(h, victim.me, None)
        await h.ready()  # registered again, seen by every sidecar


async def test_a_new_leader_resumes_a_drain() -> None:
    # Four moves a minute: the first leader gets four done, then waits for the clock.
    config = dataclasses.replace(QUIET, governor=budget(2, 2, 4))
    async with Harness(config=config) as h:
        a, b, c = await h.start(3)
        leader = await h.elected()
        assert leader is a
        bundles = await namespace_on(h, "t/resume", 12, c)
        await a.drainer.cordon(a.me, "leaving")  # only b may take them
        op = await a.drainer.drain(c.me)
        await turns(lambda: op.moves_done == 4 and len(set(owned_by(h, bundles))) == 2, 5000)
        await h.idle()
        assert op.state is OperationState.RUNNING

        await a.close()
        successor = await h.elected()
        resumed = successor.tracker.active(OperationKind.DRAIN)
        assert [r.broker for r in resumed] == [c.me]
        assert len(resumed[0].moves) == 8  # what was left
        await settle(h.clock, lambda: resumed[0].state.finished, seconds=180)
        assert resumed[0].state is OperationState.SUCCEEDED, resumed[0].error
        assert owned_by(h, bundles) == {b.me: 12}
        assert successor.maintenance.mode(c.me) is M.CORDONED


async def test_uncordon_on_any_sidecar_stops_a_drain() -> None:
    config = dataclasses.replace(QUIET, governor=budget(1, 1, 2))
    async with Harness(config=config) as h:
        a, b, c = await h.start(3)
        leader = await h.elected()
        assert leader is a
        bundles = await namespace_on(h, "t/stop", 6, c)
        op = await a.drainer.drain(c.me)
        await turns(lambda: op.moves_done == 2, 5000)

        await b.drainer.uncordon(c.me)  # a follower: the leader's duty sees the record go
        done = await finished(h, a, op)

        assert done.state is OperationState.CANCELLED
        assert done.moves_done == 2
        assert [m.state for m in done.moves].count(MoveState.CANCELLED) == 4
        assert owned_by(h, bundles)[c.me] == 4
        await seen_everywhere(h, c.me, None)


# -- the Admin API ------------------------------------------------------------------------------


async def test_the_admin_api_cordons_anywhere_and_drains_on_the_leader() -> None:
    async with Harness(config=QUIET) as h:
        a, b, c = await h.start(3)
        assert await h.elected() is a
        await namespace_on(h, "t/api", 6, c)
        async with serve_api(h, a) as on_a, serve_api(h, b) as on_b:
            await until(lambda: b.registry.get(a.me).sidecar_grpc_addr == on_a.addr)  # type: ignore[union-attr]
            cordoned = await on_b.admin.Cordon(
                lbd_pb2.CordonRequest(broker_id=c.me, reason="rack move")
            )
            assert (cordoned.broker_id, cordoned.maintenance) == (c.me, "cordoned")
            await seen_everywhere(h, c.me, M.CORDONED)
            listed = await on_a.admin.ListBrokers(lbd_pb2.ListBrokersRequest())
            modes = {s.info.broker_id: s.maintenance for s in listed.brokers}
            assert modes == {a.me: "", b.me: "", c.me: "cordoned"}

            op = await on_b.admin.Drain(lbd_pb2.DrainRequest(broker_id=c.me))  # forwarded
            assert (op.kind, op.broker_id, len(op.moves)) == ("drain", c.me, 6)
            done = await finished(h, a, a.tracker.get(op.id))
            assert done.state is OperationState.SUCCEEDED, done.error
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await on_b.admin.Decommission(lbd_pb2.DecommissionRequest(broker_id="nobody"))
            assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as blank:
                await on_a.admin.Cordon(lbd_pb2.CordonRequest())
            assert blank.value.code() is grpc.StatusCode.INVALID_ARGUMENT

            back = await on_b.admin.Uncordon(lbd_pb2.UncordonRequest(broker_id=c.me))
            assert (back.broker_id, back.maintenance) == (c.me, "")


async def test_a_broker_that_leaves_is_drained_and_back_in_service_when_it_returns() -> None:
    async with Harness(config=QUIET) as h:
        await h.start(3, auto_ack=False, fake_broker=True)
        leader = await h.elected()
        victim = next(s for s in h.live() if s is not leader)
        bundles = await namespace_on(h, "t/leave", 8, victim)
        assert victim.broker is not None

        victim.broker.leave("shutting down")
        await turns(lambda: victim.me not in owned_by(h, bundles), 20_000)
        await seen_everywhere(h, victim.me, M.CORDONED)  # drained, and kept empty
        record = victim.maintenance.get(victim.me)
        assert record is not None and record.leave and "shutting down" in record.reason
        assert h.violations == []

        await victim.broker.disconnect()
        await victim.broker.connect(victim.link)
        await seen_everywhere(h, victim.me, None)  # it said Hello: back in service


async def test_a_leave_leaves_an_operators_record_as_it_is() -> None:
    async with Harness(config=QUIET) as h:
        await h.start(3, auto_ack=False, fake_broker=True)
        leader = await h.elected()
        victim = next(s for s in h.live() if s is not leader)
        assert victim.broker is not None
        await leader.drainer.cordon(victim.me, "disk swap")
        await seen_everywhere(h, victim.me, M.CORDONED)

        victim.broker.leave("shutting down")
        await victim.broker.disconnect()
        await victim.broker.connect(victim.link)
        await h.idle()
        record = victim.maintenance.get(victim.me)
        assert record is not None and record.reason == "disk swap" and not record.leave


async def test_an_uncordon_on_another_sidecar_is_not_undone_by_the_drain_ending() -> None:
    # The leader's drain empties c and writes "cordoned" over its "draining" record; an operator
    # uncordons c on b just before, and the leader's view has not seen that yet. The write must
    # lose: c stays in service (it was left cordoned, the operator's uncordon undone).
    async with Harness(config=QUIET) as h:
        a, b, c = await h.start(3)
        leader = await h.elected()
        assert leader is a
        await a.maintenance.set(c.me, M.DRAINING, "drain-1")
        await seen_everywhere(h, c.me, M.DRAINING)

        await b.maintenance.clear(c.me)
        assert a.maintenance.mode(c.me) is M.DRAINING  # not seen on a yet
        with pytest.raises(PreconditionError, match="changed in the store"):
            await a.maintenance.set(c.me, M.CORDONED, "drained by drain-1", over=M.DRAINING)

        await seen_everywhere(h, c.me, None)
        # Over the record it holds, the write goes through.
        await a.maintenance.set(c.me, M.DRAINING, "drain-2")
        record = await a.maintenance.set(c.me, M.CORDONED, "drained by drain-2", over=M.DRAINING)
        assert record.mode is M.CORDONED
        await seen_everywhere(h, c.me, M.CORDONED)
        with pytest.raises(PreconditionError, match="not draining"):
            await a.maintenance.set(c.me, M.CORDONED, "again", over=M.DRAINING)
