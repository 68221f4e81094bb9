"""Guarded tasks: deaths are reported, cancellation is not a death."""

import asyncio

import pytest

from lbd.tasks import cancel_and_wait, guard


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
