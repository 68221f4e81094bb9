"""Proposer: next versions, who won, settle deadlines on the injected clock."""

import asyncio

import pytest

from lbd.adapters.clock import ManualClock, SystemClock
from lbd.adapters.memory.channel import MemoryChannelLog, MemoryLog
from lbd.core.errors import DeadlineError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.state import ServiceUnitState, decode_value
from lbd.metrics import Metrics
from lbd.services.channel.deadlines import within
from lbd.services.channel.follower import ChannelFollower
from lbd.services.channel.proposals import Proposer

B = BundleId("public/default/0x00000000_0x40000000")
A, X = BrokerId("a"), BrokerId("x")
S = ServiceUnitState


@pytest.fixture
async def proposers():
    clock = ManualClock()
    log = MemoryLog()
    followers = [ChannelFollower(MemoryChannelLog(log)) for _ in range(2)]
    for follower in followers:
        await follower.start()
        await follower.wait_ready()
    yield (
        clock,
        log,
        [
            Proposer(
                MemoryChannelLog(log),
                f,
                clock,
                apply_timeout_s=30.0,
                publish_timeout_s=2.0,
                metrics=Metrics(),
            )
            for f in followers
        ],
    )
    for follower in followers:
        await follower.close()


async def test_proposals_carry_the_next_version_and_the_clock(proposers) -> None:
    clock, log, (p, _) = proposers
    assert await p.propose_and_wait(B, S.Assigning, dst=A)
    assert await p.propose_and_wait(B, S.Owned, dst=A)
    values = [decode_value(m.value) for m in log.messages]
    assert [(v.state, v.version_id, v.timestamp_ms) for v in values] == [
        (S.Assigning, 1, clock.now_ms()),
        (S.Owned, 2, clock.now_ms()),
    ]
    # Only a bundle nobody serves may be tombstoned: released first.
    assert await p.propose_and_wait(B, S.Releasing, src=A)
    assert await p.propose_and_wait(B, S.Free, src=A)
    await p.tombstone(B)
    await p.follower.wait_applied(log.messages[-1].position)
    assert p.follower.get(B) is None


async def test_of_two_conflicting_proposals_the_first_wins(proposers) -> None:
    _clock, _log, (p, q) = proposers
    first = asyncio.create_task(p.propose_and_wait(B, S.Assigning, dst=A))
    second = asyncio.create_task(q.propose_and_wait(B, S.Assigning, dst=X))
    assert sorted([await first, await second]) == [False, True]
    winner = A if await first else X
    assert p.follower.get(B).dst_broker == q.follower.get(B).dst_broker == winner


async def test_a_won_proposal_counts_even_if_the_next_step_follows_at_once(proposers) -> None:
    _clock, _log, (p, q) = proposers
    await p.propose_and_wait(B, S.Assigning, dst=A)
    # q writes the next step as soon as it sees p's value, before p looks at its table.
    waiting = asyncio.create_task(p.propose_and_wait(B, S.Owned, dst=A))
    await q.settle(B, lambda v: v is not None and v.state is S.Owned, 5)
    await q.propose(B, S.Releasing, dst=X, src=A)
    assert await waiting is True


async def test_settle_times_out_on_the_clock_with_the_bundles_state(proposers) -> None:
    clock, _log, (p, _) = proposers
    await p.propose_and_wait(B, S.Assigning, dst=A)
    settling = asyncio.create_task(p.settle(B, lambda v: v.state is S.Owned, 10))
    await asyncio.sleep(0)
    await clock.run_for(9.5, step=0.5)
    assert not settling.done()
    await clock.run_for(1, step=0.5)
    with pytest.raises(DeadlineError, match=r"did not settle within 10s; it is Assigning \(dst=a"):
        async with asyncio.timeout(2):
            await settling


async def test_within_returns_the_result_or_cancels_the_work() -> None:
    clock = ManualClock()
    assert await within(clock, 1, asyncio.sleep(0, result=7), "quick") == 7
    never = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(within(clock, 1, never, "the slow thing"))
    for _ in range(3):  # the deadline starts once within() and its timer have run
        await asyncio.sleep(0)
    await clock.run_for(0.9, step=0.5)
    assert not task.done()
    await clock.run_for(0.2, step=0.1)
    with pytest.raises(DeadlineError, match="the slow thing did not finish within 1s"):
        await task
    assert never.cancelled()


async def test_within_lets_the_work_s_own_timeout_and_the_caller_s_cancellation_through() -> None:
    clock = ManualClock()

    async def times_out_itself() -> None:
        raise TimeoutError("the work's own")

    # Not the deadline's: the work's own TimeoutError is not reported as a missed deadline.
    with pytest.raises(TimeoutError, match="the work's own"):
        await within(clock, 1, times_out_itself(), "work")

    never = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(within(clock, 1, never, "work"))
    for _ in range(3):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert never.cancelled()
    # The timer went with the scope: nothing sleeps on the clock any more.
    await asyncio.sleep(0)
    assert clock.sleepers == 0


@pytest.mark.parametrize("real", [True, False], ids=["system-clock", "manual-clock"])
async def test_within_on_either_clock_reports_a_missed_deadline(real: bool) -> None:
    clock = SystemClock() if real else ManualClock()
    never = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(within(clock, 0.05, never, "the slow thing"))
    if not real:
        for _ in range(3):
            await asyncio.sleep(0)
        await clock.run_for(0.1, step=0.05)
    with pytest.raises(DeadlineError, match=r"the slow thing did not finish within 0\.05s"):
        async with asyncio.timeout(2):
            await task
    assert never.cancelled()
    # A result that beats the deadline leaves no pending cancellation behind.
    assert await within(clock, 0.05, asyncio.sleep(0, result=3), "quick") == 3
    await asyncio.sleep(0.06 if real else 0)
    assert asyncio.current_task().cancelling() == 0
