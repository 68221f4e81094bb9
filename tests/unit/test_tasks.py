"""Guarded tasks: deaths are reported, cancellation is not a death."""

import asyncio
import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

from lbd.adapters.clock import ManualClock
from lbd.tasks import cancel_and_wait, guard, idle_timeout, sleep_timeout

ROOT = Path(__file__).resolve().parents[2]


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


async def test_idle_timeout_counts_only_the_time_without_progress() -> None:
    clock = ManualClock()
    progress = [0]

    async def body() -> None:
        async with idle_timeout(clock, 1.0, lambda: progress[0]):
            await asyncio.get_running_loop().create_future()  # never done

    task = asyncio.create_task(body())
    for _ in range(3):
        await asyncio.sleep(0)
    for _ in range(6):  # 3 s in all, with progress every half second
        await clock.run_for(0.5, step=0.25)
        progress[0] += 1
    assert not task.done()
    await clock.run_for(0.9, step=0.25)
    assert not task.done()  # idle for 0.9 s only
    await clock.run_for(0.6, step=0.25)
    with pytest.raises(TimeoutError):
        await task


RUFF = (sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format=concise")


def _ruff(source: str, as_file: str) -> subprocess.CompletedProcess[str]:
    """ruff's findings on ``source`` checked as if it were ``as_file`` of the repository."""
    return subprocess.run(
        [*RUFF, "--stdin-filename", as_file, "-"],
        input=source,
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )


def test_the_services_may_wait_only_on_the_clock_port() -> None:
    """lbd/services/ruff.toml bans the event loop's own waits there (TID251)."""
    planted = "import asyncio\n\n\nasync def f() -> None:\n    await asyncio.sleep(1)\n"
    found = _ruff(planted, "lbd/services/planted.py")
    assert "TID251 `asyncio.sleep` is banned" in found.stdout
    elsewhere = _ruff(planted, "lbd/adapters/planted.py")
    assert elsewhere.returncode == 0, elsewhere.stdout
