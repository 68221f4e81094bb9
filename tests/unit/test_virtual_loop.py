"""The simulated world's event loop: virtual time that jumps over idle spans, callbacks in order,
a failing callback reported and the loop going on, a deadlock named."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from lbd.adapters.clock import ManualClock
from lbd.simulation import loop


def test_idle_time_is_jumped_over_for_clock_sleeps_and_loop_timers_alike() -> None:
    clock = ManualClock()
    woke: list[tuple[str, float]] = []

    async def main() -> float:
        running = asyncio.get_running_loop()
        running.call_later(300.0, lambda: woke.append(("timer", clock.monotonic())))
        start = clock.monotonic()
        await clock.sleep(600.0)
        woke.append(("sleep", clock.monotonic()))
        return clock.monotonic() - start

    started = time.perf_counter()
    assert loop.run(clock, main) == 600.0
    assert time.perf_counter() - started < 5.0  # ten virtual minutes, not ten real ones
    assert woke == [("timer", 1300.0), ("sleep", 1600.0)]


def test_callbacks_run_in_order_and_a_failing_one_is_reported_without_stopping_the_rest() -> None:
    clock = ManualClock()
    ran: list[str] = []
    reported: list[dict[str, Any]] = []

    def fail() -> None:
        raise ValueError("boom")

    async def main() -> None:
        running = asyncio.get_running_loop()
        running.set_exception_handler(lambda _, context: reported.append(context))
        running.call_soon(ran.append, "first")
        running.call_soon(fail)
        skipped = running.call_soon(ran.append, "cancelled")
        running.call_soon(ran.append, "last")
        skipped.cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    loop.run(clock, main)
    assert ran == ["first", "last"]
    assert [type(c["exception"]) for c in reported] == [ValueError]
    assert "fail" in reported[0]["message"]


def test_a_task_waiting_for_what_nobody_will_do_is_a_deadlock() -> None:
    clock = ManualClock()

    async def main() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(loop.SimulationStuck, match="deadlock"):
        loop.run(clock, main)


def test_the_loop_is_never_in_debug_mode() -> None:
    clock = ManualClock()

    async def main() -> bool:
        return asyncio.get_running_loop().get_debug()

    assert loop.run(clock, main) is False
