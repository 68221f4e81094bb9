"""The channel's group commit: what is handed over while a write is on its way goes as one batch."""

from __future__ import annotations

import asyncio

import pytest

from lbd.adapters.clock import ManualClock
from lbd.adapters.memory.channel import MemoryChannelLog, MemoryLog
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.state import ServiceUnitState, decode_value
from lbd.core.table import ChannelPosition
from lbd.metrics import Metrics
from lbd.ports.errors import UnavailableError
from lbd.services.channel.batching import BatchingWriter
from lbd.services.channel.follower import ChannelFollower
from lbd.services.channel.proposals import Proposer

S = ServiceUnitState


def _writer(log: MemoryLog, max_values: int = 256) -> BatchingWriter:
    return BatchingWriter(
        MemoryChannelLog(log), ManualClock(), max_values=max_values, send_timeout_s=2.0
    )


async def test_a_lone_value_goes_alone_and_at_once() -> None:
    log = MemoryLog()
    writer = _writer(log)
    assert await writer.publish("t/ns/a", b"1") == ChannelPosition(0, 0)
    assert await writer.publish("t/ns/b", b"2") == ChannelPosition(0, 1)
    assert writer.messages_sent == 2
    await writer.close()


async def test_values_handed_over_while_a_write_is_on_its_way_go_as_one_batch() -> None:
    log = MemoryLog()
    writer = _writer(log)
    keys = [f"t/ns/{i}" for i in range(6)]
    positions = await asyncio.gather(*(writer.publish(k, k.encode()) for k in keys))

    # All handed over before the writer's next turn: one message, in the order handed over.
    assert positions == [ChannelPosition(0, 0, i) for i in range(6)]
    assert [(m.key, m.value) for m in log.messages] == [(k, k.encode()) for k in keys]
    assert writer.messages_sent == 1

    # One on its way: what comes meanwhile goes as the next message.
    first = asyncio.ensure_future(writer.publish("t/ns/first", b"1"))
    await asyncio.sleep(0)
    more = await asyncio.gather(*(writer.publish(k, b"2") for k in keys[:3]))
    assert await first == ChannelPosition(0, 1)
    assert more == [ChannelPosition(0, 2, i) for i in range(3)]
    assert writer.messages_sent == 3
    await writer.close()


async def test_a_batch_holds_at_most_max_values() -> None:
    log = MemoryLog()
    writer = _writer(log, max_values=2)
    positions = await asyncio.gather(*(writer.publish(f"t/ns/{i}", b"v") for i in range(5)))
    assert [(p.entry_id, p.batch_index) for p in positions] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (2, -1),
    ]
    await writer.close()


async def test_a_value_withdrawn_before_it_was_sent_is_never_written() -> None:
    log = MemoryLog()
    writer = _writer(log)
    first = asyncio.ensure_future(writer.publish("t/ns/first", b"1"))
    withdrawn = asyncio.ensure_future(writer.publish("t/ns/withdrawn", b"2"))
    kept = asyncio.ensure_future(writer.publish("t/ns/kept", b"3"))
    await asyncio.sleep(0)  # all three queued; the first is on its way
    withdrawn.cancel()
    await asyncio.gather(first, kept)
    assert [m.key for m in log.messages] == ["t/ns/first", "t/ns/kept"]
    await writer.close()


async def test_a_failed_message_fails_every_value_in_it_and_the_writer_goes_on() -> None:
    log = MemoryLog()
    writer = _writer(log)
    log.go_down()
    results = await asyncio.gather(
        *(writer.publish(f"t/ns/{i}", b"v") for i in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, UnavailableError) for r in results), results
    log.come_back()
    assert await writer.publish("t/ns/later", b"v") == ChannelPosition(0, 0)
    await writer.close()


async def test_a_bad_key_fails_alone() -> None:
    log = MemoryLog()
    writer = _writer(log)
    good = asyncio.ensure_future(writer.publish("t/ns/a", b"1"))
    with pytest.raises(InvalidInputError, match="reserved"):
        await writer.publish("__lbd_x", b"2")
    await good
    assert [m.key for m in log.messages] == ["t/ns/a"]
    await writer.close()


async def test_closing_fails_what_was_not_written_and_refuses_more() -> None:
    log = MemoryLog()
    log.hang_publishes(True)
    writer = _writer(log)
    waiting = [asyncio.ensure_future(writer.publish(f"t/ns/{i}", b"v")) for i in range(3)]
    await asyncio.sleep(0)
    await writer.close()
    for future in waiting:
        with pytest.raises(UnavailableError, match="closed"):
            await future
    with pytest.raises(UnavailableError, match="closed"):
        await writer.publish("t/ns/a", b"v")
    await writer.close()
    log.hang_publishes(False)
    assert log.messages == ()


async def test_conflicting_proposals_batched_together_have_one_winner_on_every_sidecar() -> None:
    """Two sidecars propose different owners for one bundle in the same batch: each value is
    judged in order, so the first wins everywhere and the second is rejected everywhere."""
    log = MemoryLog()
    clock = ManualClock()
    followers = [ChannelFollower(MemoryChannelLog(log)) for _ in range(2)]
    for follower in followers:
        await follower.start()
        await follower.wait_ready()
    proposer = Proposer(
        MemoryChannelLog(log),
        followers[0],
        clock,
        apply_timeout_s=30.0,
        publish_timeout_s=2.0,
        metrics=Metrics(),
        batch_max_values=256,
    )
    bundles = [BundleId(f"public/default/0x{i:08x}_0x{i + 1:08x}") for i in range(3)]
    try:
        # Something on its way first, so that what follows is batched.
        opener = asyncio.ensure_future(proposer.propose(bundles[0], S.Assigning, dst=BrokerId("z")))
        await asyncio.sleep(0)
        wins = await asyncio.gather(
            proposer.propose_and_wait(bundles[1], S.Assigning, dst=BrokerId("a")),
            proposer.propose_and_wait(bundles[1], S.Assigning, dst=BrokerId("b")),
            proposer.propose_and_wait(bundles[2], S.Assigning, dst=BrokerId("c")),
        )
        await opener
        assert wins == [True, False, True]
        batch = [m for m in log.messages if m.position.batch_index >= 0]
        assert [decode_value(m.value).dst_broker for m in batch] == ["a", "b", "c"]
        for follower in followers:
            await follower.wait_applied(log.messages[-1].position)
            assert [follower.get(b).dst_broker for b in bundles] == ["z", "a", "c"]
            assert follower.stats.rejected == 1
    finally:
        await proposer.close()
        for follower in followers:
            await follower.close()
