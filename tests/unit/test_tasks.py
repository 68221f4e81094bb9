"""Guarded tasks: deaths are reported, cancellation is not a death; a component's tasks are
reaped at its close."""

import asyncio
import contextlib
import logging
import subprocess
import sys
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from lbd.adapters.clock import ManualClock
from lbd.ports.clock import TimeoutScope
from lbd.tasks import (
    Component,
    Mailbox,
    Tasks,
    WakeTimeout,
    cancel_and_wait,
    guard,
    idle_timeout,
    sleep_timeout,
    tasks_outliving,
)

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


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


async def _forever() -> None:
    await asyncio.Event().wait()


async def _turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _stubborn(started: asyncio.Event, release: asyncio.Event) -> None:
    """Ignores its cancellation until ``release`` is set."""
    started.set()
    while True:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await release.wait()
            return


async def test_close_cancels_every_task_spawned_and_waits_for_all() -> None:
    tasks = Tasks("the test component")
    deaths: list[str] = []
    spawned = [
        tasks.spawn(_forever(), name="a"),
        tasks.spawn(_forever(), name="b", on_death=lambda n, e: deaths.append(n)),
    ]
    await _turns()
    assert [t.get_name() for t in spawned] == ["a", "b"]  # the names are kept as given
    assert not any(t.done() for t in spawned)
    assert await tasks.close() == []
    assert all(t.cancelled() for t in spawned)  # ended, not merely told to end
    assert len(tasks) == 0 and deaths == []  # a cancellation is not a death


async def test_close_is_idempotent_and_a_closed_tasks_may_spawn_again() -> None:
    tasks = Tasks("the test component")
    assert await tasks.close() == []  # nothing spawned: nothing to do
    first = tasks.spawn(_forever(), name="first")
    assert await tasks.close() == []
    assert await tasks.close() == []
    assert first.cancelled()
    again = tasks.spawn(_forever(), name="again")  # started again after its close
    await _turns()
    assert not again.done() and len(tasks) == 1
    await tasks.close()
    assert again.cancelled()


async def test_a_task_that_ignores_its_cancellation_is_named_and_given_up_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tasks = Tasks("the test component")
    started, release = asyncio.Event(), asyncio.Event()
    tasks.spawn(_forever(), name="polite")
    stubborn = tasks.spawn(_stubborn(started, release), name="stubborn")
    await started.wait()
    loop = asyncio.get_running_loop()
    began = loop.time()
    with caplog.at_level(logging.ERROR, logger="lbd.tasks"):
        assert await tasks.close(within_s=0.05) == ["stubborn"]
    assert loop.time() - began >= 0.05
    assert [r.getMessage() for r in caplog.records] == [
        "task stubborn of the test component did not end within 0.05 s of its cancellation"
    ]
    assert not stubborn.done() and not tasks  # still running, but no longer kept
    release.set()
    await stubborn


async def test_the_closer_being_cancelled_stops_waiting_and_the_cancellation_propagates() -> None:
    tasks = Tasks("the test component")
    started, release = asyncio.Event(), asyncio.Event()
    stubborn = tasks.spawn(_stubborn(started, release), name="stubborn")
    await started.wait()
    closer = asyncio.create_task(tasks.close())
    await _turns()
    assert stubborn.cancelling() and not closer.done()
    closer.cancel()
    await _turns()
    assert closer.cancelled()  # at once, not after REAP_S
    assert tasks and not stubborn.done()  # not reaped yet: kept for the next close
    release.set()
    assert await tasks.close() == []
    assert stubborn.done() and not tasks


async def test_a_close_in_a_task_being_cancelled_reaps_everything_then_lets_it_end() -> None:
    tasks = Tasks("the test component")
    spawned = [tasks.spawn(_forever(), name=name) for name in ("a", "b")]
    reaped: list[bool] = []

    async def component_task() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await tasks.close()
            reaped.append(all(t.done() for t in spawned))

    task = asyncio.create_task(component_task())
    await _turns()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert reaped == [True] and not tasks


async def test_tasks_are_true_from_the_first_spawn_until_reaped() -> None:
    tasks = Tasks("the test component")
    assert not tasks and len(tasks) == 0

    async def brief() -> None:
        return None

    done = tasks.spawn(brief(), name="brief")
    assert tasks and len(tasks) == 1
    await done
    assert tasks and len(tasks) == 1  # ended on its own, but not reaped: still started
    tasks.spawn(_forever(), name="forever")
    assert len(tasks) == 2
    await tasks.close()
    assert not tasks and len(tasks) == 0


class _Part(Component):
    def __init__(self) -> None:
        self.events: list[str] = []
        self._tasks = Tasks("the part")

    async def start(self) -> None:
        self.events.append("start")
        self._tasks.spawn(_forever(), name="part-work")

    async def close(self) -> None:
        self.events.append(f"close ({len(self._tasks)} task)")
        await self._tasks.close()


async def test_async_with_starts_a_component_and_closes_it_even_on_error() -> None:
    async with _Part() as part:
        assert isinstance(part, _Part)
        assert part.events == ["start"]
    assert part.events == ["start", "close (1 task)"]
    assert tasks_outliving() == []
    failing = _Part()
    with pytest.raises(ValueError, match="inside"):
        async with failing:
            raise ValueError("inside")
    assert failing.events == ["start", "close (1 task)"]


def test_a_component_must_say_how_it_starts_and_closes() -> None:
    class Half(Component):
        async def start(self) -> None:
            pass

    with pytest.raises(TypeError, match="close"):
        Half()  # type: ignore[abstract]


async def test_tasks_outliving_names_what_still_runs_but_the_current_task_and_exclude() -> None:
    assert tasks_outliving() == []
    left = asyncio.create_task(_forever(), name="left-behind")
    known = asyncio.create_task(_forever(), name="known")
    await _turns()
    assert tasks_outliving() == ["known", "left-behind"]
    assert tasks_outliving(exclude={known}) == ["left-behind"]
    for task in (left, known):
        await cancel_and_wait(task)
    assert tasks_outliving() == []


Scope = Callable[[ManualClock, float], contextlib.AbstractAsyncContextManager[TimeoutScope]]
SCOPES: dict[str, Scope] = {
    "sleep_timeout": lambda clock, seconds: sleep_timeout(clock.sleep, seconds),
    "WakeTimeout": lambda clock, seconds: WakeTimeout(clock.wake_after, seconds),
}
"""The two timeouts on a clock's time: a timer task that sleeps, and a clock's wake-up future
(what :meth:`ManualClock.timeout` gives). Each behaves as ``asyncio.timeout`` does."""


@pytest.fixture(params=sorted(SCOPES))
def scope(request: pytest.FixtureRequest) -> Scope:
    return SCOPES[request.param]


async def _never() -> None:
    await asyncio.get_running_loop().create_future()


async def _entered(body: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """``body`` as a task, once it entered its scope and the scope's timer started sleeping."""
    task = asyncio.create_task(body)
    for _ in range(3):
        await asyncio.sleep(0)
    return task


async def test_a_clock_timeout_cancels_the_body_once_the_clock_passed_its_time(
    scope: Scope,
) -> None:
    clock = ManualClock()
    expired: list[bool] = []

    async def body() -> None:
        async with scope(clock, 1.0) as timeout:
            try:
                await _never()
            finally:
                expired.append(timeout.expired())

    task = await _entered(body())
    await clock.run_for(0.9, step=0.3)
    assert not task.done()
    await clock.run_for(0.2, step=0.1)
    with pytest.raises(TimeoutError):
        await task
    assert expired == [True]
    assert task.cancelling() == 0


async def test_a_clock_timeout_lets_a_cancellation_from_elsewhere_through(scope: Scope) -> None:
    clock = ManualClock()
    expired: list[bool] = []

    async def body() -> None:
        async with scope(clock, 1.0) as timeout:
            try:
                await _never()
            finally:
                expired.append(timeout.expired())

    task = await _entered(body())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert expired == [False]
    await asyncio.sleep(0)
    assert clock.sleepers == 0  # the timer went with the scope


async def test_a_body_that_swallows_the_timeout_leaves_no_cancellation_pending(
    scope: Scope,
) -> None:
    clock = ManualClock()

    async def body() -> int:
        async with scope(clock, 1.0):
            with contextlib.suppress(asyncio.CancelledError):
                await _never()
        current = asyncio.current_task()
        assert current is not None
        return current.cancelling()

    task = await _entered(body())
    await clock.run_for(1.1, step=0.5)
    assert await task == 0


async def test_a_body_that_fails_otherwise_once_timed_out_leaves_no_cancellation_pending(
    scope: Scope,
) -> None:
    clock = ManualClock()

    async def body() -> None:
        async with scope(clock, 1.0):
            try:
                await _never()
            finally:
                raise ValueError("its clean-up failed")

    task = await _entered(body())
    await clock.run_for(1.1, step=0.5)
    with pytest.raises(ValueError, match="clean-up"):
        await task
    assert task.cancelling() == 0


async def test_a_clock_timeout_whose_time_runs_out_as_its_body_ends_does_not_cancel_it(
    scope: Scope,
) -> None:
    clock = ManualClock()
    answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def body() -> str:
        async with scope(clock, 1.0):
            result = await answer
        await asyncio.sleep(0)  # a cancellation sent late would land here
        return result

    task = await _entered(body())
    answer.set_result("done")  # the body is woken first ...
    clock.advance(1.0)  # ... and the timer in the same turn, behind it
    assert await task == "done"
    assert task.cancelling() == 0


async def test_a_held_wake_timeout_expires_once_its_hold_is_over() -> None:
    clock = ManualClock()
    resumed = asyncio.Event()

    def hold() -> Awaitable[object] | None:
        return None if resumed.is_set() else resumed.wait()

    async def body() -> None:
        async with WakeTimeout(clock.wake_after, 1.0, hold):
            await _never()

    task = await _entered(body())
    await clock.run_for(5.0, step=0.5)
    assert not task.done()  # the time ran out while held: nothing happens yet
    resumed.set()
    with pytest.raises(TimeoutError):
        await task


async def test_a_wake_timeout_of_no_time_expires_at_the_next_turn() -> None:
    clock = ManualClock()

    async def body() -> None:
        async with WakeTimeout(clock.wake_after, 0.0):
            await _never()

    task = asyncio.create_task(body())
    for _ in range(4):
        await asyncio.sleep(0)
    assert task.done()
    with pytest.raises(TimeoutError):
        await task


async def test_a_mailbox_hands_its_reader_every_item_in_order() -> None:
    mailbox: Mailbox[int] = Mailbox()
    mailbox.put_nowait(1)
    read: list[int] = []

    async def reader() -> None:
        while (item := await mailbox.get()) != 0:
            read.append(item)

    task = asyncio.create_task(reader())
    await asyncio.sleep(0)
    assert read == [1] and mailbox.qsize() == 0  # it waits for more now
    for item in (2, 3, 0):
        mailbox.put_nowait(item)
    await task
    assert read == [1, 2, 3]


async def test_a_mailbox_refuses_a_second_reader_and_keeps_what_a_cancelled_one_left() -> None:
    mailbox: Mailbox[str] = Mailbox()
    first = asyncio.create_task(mailbox.get())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="one reader"):
        await mailbox.get()
    await cancel_and_wait(first)
    mailbox.put_nowait("kept")
    assert mailbox.qsize() == 1
    assert await mailbox.get() == "kept"


async def test_idle_timeout_counts_only_the_time_without_progress() -> None:
    clock = ManualClock()
    progress = [0]

    async def body() -> None:
        async with idle_timeout(clock, 1.0, lambda: progress[0]):
            await asyncio.get_running_loop().create_future()  # never done

    task = await _entered(body())
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
