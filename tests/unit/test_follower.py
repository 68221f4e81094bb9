"""The channel follower and checkpoints over the in-memory channel (the real one: integration)."""

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from channel_values import value

from lbd.adapters.memory.channel import MemoryChannelLog, MemoryLog
from lbd.adapters.memory.checkpoint import MemoryCheckpointStore
from lbd.core.ids import BrokerId, BundleId
from lbd.core.state import ServiceUnitState
from lbd.core.table import ChannelPosition, Outcome, StateTable
from lbd.ports.checkpoint import StoredCheckpoint
from lbd.ports.errors import UnavailableError
from lbd.services.channel import checkpoints
from lbd.services.channel.follower import ChannelFollower

B1 = BundleId("public/default/0x00000000_0x40000000")
B2 = BundleId("public/default/0x40000000_0x80000000")
A, B = BrokerId("broker-a"), BrokerId("broker-b")


def is_state(state: ServiceUnitState):
    return lambda v: v is not None and v.state is state


def replay(log: MemoryLog) -> StateTable:
    table = StateTable()
    for m in log.messages:
        if not m.key.startswith("__lbd_"):
            table.apply(m.position, BundleId(m.key), m.value)
    return table


@contextlib.asynccontextmanager
async def caught_up(log: MemoryLog) -> AsyncIterator[ChannelFollower]:
    """A follower of ``log``, once it has read what the log held."""
    async with ChannelFollower(MemoryChannelLog(log)) as follower:
        async with asyncio.timeout(2):
            await follower.wait_ready()
        yield follower


async def test_catches_up_then_follows_and_wakes_waiters() -> None:
    log = MemoryLog()
    writer = MemoryChannelLog(log)
    await writer.publish(B1, value(ServiceUnitState.Assigning, 1, dst=A))
    async with caught_up(log) as follower:
        assert follower.get(B1).state is ServiceUnitState.Assigning
        waiting = asyncio.create_task(follower.wait_for(B1, is_state(ServiceUnitState.Owned)))
        await asyncio.sleep(0)
        assert not waiting.done()
        position = await writer.publish(B1, value(ServiceUnitState.Owned, 2, dst=A))
        async with asyncio.timeout(2):
            owned = await waiting
            await follower.wait_applied(position)
        assert owned.dst_broker == A
        assert follower.table.last_position == position
    await writer.close()


async def test_a_wait_that_times_out_leaves_no_waiter_behind() -> None:
    log = MemoryLog()
    async with ChannelFollower(MemoryChannelLog(log)) as follower:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await follower.wait_for(B1, is_state(ServiceUnitState.Owned))
        assert follower._waiters == {}


async def test_malformed_and_repeated_messages_neither_crash_nor_stall() -> None:
    log = MemoryLog()
    writer = MemoryChannelLog(log)
    async with ChannelFollower(MemoryChannelLog(log)) as follower:
        await writer.publish(B1, b"{not json")
        await writer.publish(B1, value(ServiceUnitState.Assigning, 1, dst=A))
        log.redeliver(2)
        last = await writer.publish(B2, value(ServiceUnitState.Assigning, 1, dst=B))
        async with asyncio.timeout(2):
            await follower.wait_applied(last)
        assert follower.stats.malformed == 1
        assert follower.stats.accepted == 2
        assert follower.get(B1).dst_broker == A and follower.get(B2).dst_broker == B
        assert dict(follower.table.items()) == dict(replay(log).items())
    await writer.close()


async def test_the_change_feed_sees_accepted_changes_in_order() -> None:
    log = MemoryLog()
    writer = MemoryChannelLog(log)
    async with caught_up(log) as follower:
        # Subscribed by the call itself: changes applied before the first iteration count.
        feed = follower.changes()
        await writer.publish(B1, value(ServiceUnitState.Assigning, 1, dst=A))
        await writer.publish(B1, value(ServiceUnitState.Assigning, 1, dst=B))  # rejected: stale
        await writer.publish(B1, value(ServiceUnitState.Owned, 2, dst=A))
        await follower.wait_applied(log.messages[-1].position)
        async with asyncio.timeout(2):
            got = [await anext(feed), await anext(feed)]
        await feed.aclose()
        assert [r.outcome for r in got] == [Outcome.ACCEPTED, Outcome.ACCEPTED]
        assert [r.new.state for r in got] == [ServiceUnitState.Assigning, ServiceUnitState.Owned]
        assert follower.stats.rejected == 1
    await writer.close()


async def test_the_batched_change_feed_gives_what_was_queued_at_once_in_order() -> None:
    log = MemoryLog()
    writer = MemoryChannelLog(log)
    async with caught_up(log) as follower:
        one_by_one, batches = follower.changes(), follower.change_batches()
        await writer.publish(B1, value(ServiceUnitState.Assigning, 1, dst=A))
        await writer.publish(B1, value(ServiceUnitState.Assigning, 1, dst=B))  # rejected: stale
        await writer.publish(B1, value(ServiceUnitState.Owned, 2, dst=A))
        await writer.publish(B2, value(ServiceUnitState.Assigning, 1, dst=B))
        await follower.wait_applied(log.messages[-1].position)
        async with asyncio.timeout(2):
            first = await anext(batches)  # all three were queued before it asked
            singles = [await anext(one_by_one) for _ in range(3)]
            await writer.publish(B2, value(ServiceUnitState.Owned, 2, dst=B))
            later = await anext(batches)
        await batches.aclose()
        await one_by_one.aclose()
        assert first == singles
        assert [(r.key, r.new.state) for r in first] == [
            (B1, ServiceUnitState.Assigning),
            (B1, ServiceUnitState.Owned),
            (B2, ServiceUnitState.Assigning),
        ]
        assert [(r.key, r.new.state) for r in later] == [(B2, ServiceUnitState.Owned)]
        assert len(follower._subscribers) == 0  # closing unsubscribed both
    await writer.close()


async def test_checkpoint_plus_tail_equals_full_replay_with_tombstones() -> None:
    log = MemoryLog()
    writer = MemoryChannelLog(log)
    for bundle in (B1, B2):
        await writer.publish(bundle, value(ServiceUnitState.Assigning, 1, dst=A))
        await writer.publish(bundle, value(ServiceUnitState.Owned, 2, dst=A))
    store = MemoryCheckpointStore()
    async with ChannelFollower(MemoryChannelLog(log)) as leader:
        await leader.wait_applied(log.messages[-1].position)
        saved = await checkpoints.save(store, leader.table, leader_term=7)
        assert saved == log.messages[-1].position
    # The tail: B1 is unloaded then tombstoned, B2 moves.
    await writer.publish(B1, value(ServiceUnitState.Releasing, 3, src=A))
    await writer.publish(B1, value(ServiceUnitState.Free, 4, src=A))
    await writer.publish(B1, b"")
    await writer.publish(B2, value(ServiceUnitState.Releasing, 3, dst=B, src=A))
    restored = await checkpoints.restore(store)
    assert len(restored) == 2
    async with ChannelFollower(MemoryChannelLog(log), restored) as starter:
        async with asyncio.timeout(2):
            await starter.wait_ready()
        assert dict(starter.table.items()) == dict(replay(log).items())
        assert starter.get(B1) is None
        assert starter.stats.accepted == 4  # only the tail was applied
    await writer.close()


async def test_a_stale_leader_cannot_overwrite_a_newer_checkpoint() -> None:
    store = MemoryCheckpointStore()
    table = StateTable()
    log = MemoryLog()
    writer = MemoryChannelLog(log)
    position = await writer.publish(B1, value(ServiceUnitState.Assigning, 1, dst=A))
    table.apply(position, B1, log.messages[-1].value)
    assert await checkpoints.save(store, table, leader_term=9) == position
    assert await checkpoints.save(store, table, leader_term=8) is None
    assert (await store.load()).leader_term == 9
    assert await checkpoints.save(store, StateTable(), leader_term=10) is None  # empty table
    await writer.close()


async def test_an_unreadable_checkpoint_falls_back_to_a_full_replay() -> None:
    store = MemoryCheckpointStore()
    await store.save(StoredCheckpoint(ChannelPosition(0, 5), 1, b"\x00 not a table"))
    restored = await checkpoints.restore(store)
    assert len(restored) == 0 and restored.last_position is None


def sliced_table(count: int) -> StateTable:
    table = StateTable()
    for i in range(count):
        bundle = BundleId(f"public/default/0x{i:08x}_0x{i + 1:08x}")
        state = (ServiceUnitState.Owned, ServiceUnitState.Assigning)[i % 2]
        table.apply(ChannelPosition(1, i), bundle, value(state, 1, dst=(A, B)[i % 3 % 2]))
    table.apply(ChannelPosition(1, count), B1, b"not json")  # a position past the last value
    return table


@pytest.mark.parametrize("count", [0, 1, 6, 7])
async def test_a_checkpoint_made_in_slices_is_the_one_made_at_once(
    count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checkpoints, "SERIALISE_SLICE", 3)
    table = sliced_table(count)
    body = await checkpoints.serialised(table)
    whole = checkpoints.encode(table, leader_term=4)
    assert whole is not None and body == whole.body
    restored = checkpoints.decode(StoredCheckpoint(table.last_position, 4, body))
    assert (restored.digest, len(restored)) == (table.digest, count)


async def test_a_checkpoint_lets_the_event_loop_run_between_slices_of_one_instant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(checkpoints, "SERIALISE_SLICE", 3)
    table = sliced_table(9)
    expected = checkpoints._serialise(table.snapshot())
    turns: list[int] = []
    making = asyncio.ensure_future(checkpoints.serialised(table))

    async def meanwhile() -> None:
        while not making.done():
            turns.append(len(table))
            # The table moves on while the checkpoint is made: the checkpoint does not.
            table.apply(ChannelPosition(2, len(turns)), B2, value(ServiceUnitState.Free, 9, src=A))
            await asyncio.sleep(0)

    await asyncio.gather(making, meanwhile())
    assert len(turns) >= 3  # one at least after every slice
    assert making.result() == expected


async def test_a_waiter_left_when_the_follower_stops_gets_an_error_not_a_cancellation() -> None:
    # An admin split waiting for its bundle to settle when its sidecar stops must end with an
    # error the API can answer with; a CancelledError would leak into a caller nobody cancelled
    # (the simulation's seed 1191 died of it).
    log = MemoryLog()
    follower = ChannelFollower(MemoryChannelLog(log))
    await follower.start()
    async with asyncio.timeout(2):
        await follower.wait_ready()
    settling = asyncio.create_task(follower.wait_for(B1, is_state(ServiceUnitState.Owned)))
    applied = asyncio.create_task(follower.wait_applied(ChannelPosition(1_000_000, 0, -1)))
    with follower.watching(B2, lambda v: False):
        await asyncio.sleep(0)
        await follower.close()
    for task in (settling, applied):
        with pytest.raises(UnavailableError, match="the channel follower stopped"):
            await task
        assert not task.cancelled()
