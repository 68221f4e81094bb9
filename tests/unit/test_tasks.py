"""Guarded tasks: deaths are reported, cancellation is not a death."""

import asyncio
import contextlib

import pytest

from lbd.adapters.clock import ManualClock
from lbd.tasks import cancel_and_wait, guard, sleep_timeout


async def test_a_failing_task_is_reported_and_still_raises_to_whoever_awaits_it() -> None:
    deaths: list[tuple[str, BaseException]] = []

    async def boom() -> None:
        raise ValueError("broken")

    task = guard(boom(), name="boom", on_death=lambda n, e: deaths.append((n, e)))
    with pytest.raises(ValueError, match="broken"):
        await task
    assert [(n, str(e)) for n, e in deaths] == [("boom", "broken")]
    assert task.get_name() == "boom"


async def test_a_root_task_that_returns_is_a_death_too() -> None:
    deaths: list[str] = []

    async def quits() -> None:
        return None

    await guard(quits(), name="quits", on_death=lambda n, e: deaths.append(f"{n}: {e}"))
    assert deaths == ["quits: task quits returned"]


async def test_cancellation_is_not_a_death_even_before_the_task_starts() -> None:
    deaths: list[str] = []
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    never = guard(forever(), name="never", on_death=lambda n, e: deaths.append(n))
    await cancel_and_wait(never)  # cancelled before it ran: no "never awaited" warning
    running = guard(forever(), name="running", on_death=lambda n, e: deaths.append(n))
    await started.wait()
    await cancel_and_wait(running)
    await cancel_and_wait(running)  # idempotent
    await cancel_and_wait(None)
    assert deaths == [] and never.cancelled() and running.cancelled()


async def test_sleep_timeout_cancels_the_body_once_the_clock_passed_its_time() -> None:
    clock = ManualClock()

    async def body() -> None:
        async with sleep_timeout(clock.sleep, 1.0) as scope:
            await asyncio.get_running_loop().create_future()  # never done
        assert scope  # not reached

    task = asyncio.create_task(body())
    for _ in range(3):  # the body enters the scope, then its timer starts sleeping
        await asyncio.sleep(0)
    await clock.run_for(0.9, step=0.3)
    assert not task.done()
    await clock.run_for(0.2, step=0.1)
    with pytest.raises(TimeoutError):
        await task


async def test_sleep_timeout_lets_a_cancellation_from_elsewhere_through() -> None:
    clock = ManualClock()
    expired: list[bool] = []

    async def body() -> None:
        async with sleep_timeout(clock.sleep, 1.0) as scope:
            try:
                await asyncio.get_running_loop().create_future()
            finally:
                expired.append(scope.expired())

    task = asyncio.create_task(body())
    for _ in range(3):  # the body enters the scope, then its timer starts sleeping
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert expired == [False]
    await asyncio.sleep(0)
    assert clock.sleepers == 0  # the timer went with the scope


async def test_a_body_that_swallows_the_timeout_leaves_no_cancellation_pending() -> None:
    clock = ManualClock()

    async def body() -> int:
        async with sleep_timeout(clock.sleep, 1.0):
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.get_running_loop().create_future()
        current = asyncio.current_task()
        assert current is not None
        return current.cancelling()

    task = asyncio.create_task(body())
    for _ in range(3):  # the body enters the scope, then its timer starts sleeping
        await asyncio.sleep(0)
    await clock.run_for(1.1, step=0.5)
    assert await task == 0
