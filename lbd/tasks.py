"""Named, guarded background tasks (kopf's ``aiotasks.guard`` in spirit), the lifecycle of the
components that run them, and the event loop the processes run them on.

A guarded task logs its own death with its name; a *root* task's death is also reported to a
callback so that the daemon can stop loudly instead of running on without a vital part.

A component keeps its long-running tasks in one :class:`Tasks`, started in its ``start`` and
reaped in its ``close``; :class:`Component` gives it ``async with``. Once everything is closed,
:func:`tasks_outliving` names what still runs: a task that outlived its component.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import gc
import logging
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Final, Generic, Self, TypeVar

if TYPE_CHECKING:
    from lbd.ports.clock import Clock

_log = logging.getLogger(__name__)

T = TypeVar("T")

GC_YOUNG_THRESHOLD: Final = 20_000
"""Allocations between two collections of the youngest generation (Python's default: 700).

A sidecar allocates a handful of short-lived objects per channel message and per broker command.
At the default, the busiest sidecar of a 10,000-orphan repair spent about 2 s of its 10 s in the
cycle collector; at this threshold, 0.25 s (``python -m bench.recovery_bench --bundles 10000``).
"""


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on uvloop (the stdlib loop if it is not installed), with the
    collector tuned for a process that handles many small messages (:data:`GC_YOUNG_THRESHOLD`).
    The daemon and the simulated broker run on it."""
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, GC_YOUNG_THRESHOLD), middle, old)
    try:
        import uvloop
    except ImportError:  # optional: the default loop is only slower
        return asyncio.run(main)
    return uvloop.run(main)


def guard(
    coro: Coroutine[Any, Any, None],
    *,
    name: str,
    on_death: Callable[[str, BaseException], None] | None = None,
) -> asyncio.Task[None]:
    """Start ``coro`` as a task called ``name`` whose failure is logged (and reported).

    Cancellation is not a failure. ``on_death`` is called with the name and the exception when the
    task fails, and with a :class:`RuntimeError` when it returns although it was meant to run for
    as long as its owner (pass ``on_death`` only for such tasks).
    """

    async def guarded() -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as e:
            _log.exception("task %s died", name)
            if on_death is not None:
                on_death(name, e)
            raise
        else:
            if on_death is not None:
                on_death(name, RuntimeError(f"task {name} returned"))

    def done(task: asyncio.Task[None]) -> None:
        if task.cancelled():
            coro.close()  # cancelled before it started: not a "never awaited" coroutine
        else:
            task.exception()  # seen: the guard logged it; whoever awaits the task still gets it

    task = asyncio.get_running_loop().create_task(guarded(), name=name)
    task.add_done_callback(done)
    return task


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait for it to end, whatever it ends with. Idempotent."""
    if task is None or task.done():
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if (current := asyncio.current_task()) is not None and current.cancelling():
            raise
    except Exception:
        pass  # the guard logged it when it happened


REAP_S: Final = 5.0
"""How long :meth:`Tasks.close` waits for cancelled tasks to end, by default (the event loop's
time). A cancelled task ends within a few turns of the loop, or within the bound of its last
clean-up (closing a Pulsar reader is bounded at 2 s); one still running after this is a bug,
named in the log, and the close goes on without it."""


class Mailbox(Generic[T]):
    """An unbounded first-in first-out queue with one reader: :class:`asyncio.Queue`'s
    ``put_nowait`` and ``get``, woken in the same order, without its bound, its task accounting
    and its list of waiting readers. A broker session's messages pass through two of these,
    every quarter of a serving lease each way."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: T) -> None:
        """Append ``item`` and wake the reader if it waits."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def get(self) -> T:
        """The oldest item, once there is one."""
        items = self._items
        while not items:
            if self._waiter is not None:
                raise RuntimeError("a Mailbox has one reader; a second one waits on it")
            waiter: asyncio.Future[None] = asyncio.Future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        return items.popleft()

    def qsize(self) -> int:
        """How many items wait to be read."""
        return len(self._items)


class Tasks:
    """The long-running tasks of one component, from its start to its close.

    ``start`` spawns them (each a :func:`guard` task), ``close`` reaps them: every one is
    cancelled and waited for, within a bound. Kept tasks count until they are reaped, ended or
    not, so that ``if self._tasks:`` tells whether the component was started. A closed
    ``Tasks`` may spawn again (a component started again after its close).
    """

    __slots__ = ("_owner", "_tasks")

    def __init__(self, owner: str) -> None:
        """``owner`` names the component in the log (a task that did not end)."""
        self._owner = owner
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def owner(self) -> str:
        """The component's name."""
        return self._owner

    def spawn(
        self,
        coro: Coroutine[Any, Any, None],
        *,
        name: str,
        on_death: Callable[[str, BaseException], None] | None = None,
    ) -> asyncio.Task[None]:
        """Start ``coro`` as a guarded task called ``name`` (see :func:`guard`) and keep it."""
        task = guard(coro, name=name, on_death=on_death)
        self._tasks.append(task)
        return task

    def __len__(self) -> int:
        """Tasks kept and not yet reaped (ended ones included)."""
        return len(self._tasks)

    def __bool__(self) -> bool:
        return bool(self._tasks)

    def __repr__(self) -> str:
        return f"<Tasks of {self._owner}: {', '.join(t.get_name() for t in self._tasks)}>"

    async def close(self, *, within_s: float | None = REAP_S) -> list[str]:
        """Cancel every task and wait until all have ended, at most ``within_s`` seconds of the
        event loop's time in all (None: for as long as they take); the names of those still
        running then (each logged as an error, and no longer kept). Idempotent.

        What the tasks end with is not raised (the guard logged a failure when it happened). A
        cancellation of the caller is: it stops the wait at once, the tasks being cancelled
        already; those not yet ended stay kept for the next close.
        """
        tasks = list(self._tasks)
        if not tasks:
            return []
        for task in tasks:
            task.cancel()
        try:
            _, pending = await asyncio.wait(tasks, timeout=within_s)
        except asyncio.CancelledError:
            self._forget(t for t in tasks if t.done())
            raise
        self._forget(tasks)
        late = [task.get_name() for task in tasks if task in pending]
        for name in late:
            _log.error(
                "task %s of %s did not end within %g s of its cancellation",
                name,
                self._owner,
                within_s,
            )
        return late

    def _forget(self, tasks: Iterable[asyncio.Task[None]]) -> None:
        gone = set(tasks)
        self._tasks = [task for task in self._tasks if task not in gone]


class Component(abc.ABC):
    """A part with a lifecycle: ``start`` it, ``close`` it; ``async with`` does both."""

    __slots__ = ()

    @abc.abstractmethod
    async def start(self) -> None:
        """Start the component's work."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop it, and wait until its tasks have ended."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def tasks_outliving(exclude: Collection[asyncio.Task[Any]] = ()) -> list[str]:
    """The names of the tasks still running on this loop, sorted, other than the current one and
    ``exclude``: once every component is closed, each is a task that outlived its component
    (give the loop a few turns first, for tasks cancelled at the very end)."""
    me = asyncio.current_task()
    return sorted(
        task.get_name()
        for task in asyncio.all_tasks()
        if task is not me and task not in exclude and not task.done()
    )


class WakeTimeout:
    """``asyncio.timeout`` on another clock: the body is cancelled from the done callback of a
    wake-up future, and the scope raises :class:`TimeoutError` then; a cancellation from
    elsewhere is told apart by the task's cancel count, as ``asyncio.timeout`` does. A clock
    that hands out wake-up futures (:meth:`lbd.adapters.clock.ManualClock.wake_after`) needs
    no timer task: every deadline of the simulated world is one of these, and a task to make,
    start and cancel per deadline cost ten times as much (:func:`sleep_timeout` makes one).

    ``wake(seconds)`` gives the future (done once ``seconds`` of the clock have passed; seconds
    > 0). ``hold()``, when given, is asked as the time runs out: None lets the scope expire now,
    an awaitable defers that until it completes (a paused host's timers wait for its resume).
    Entered once, in a task; ``expired()`` says whether the time ran out.
    """

    __slots__ = ("_cancelling", "_held", "_hold", "_seconds", "_state", "_task", "_timer", "_wake")

    _OPEN, _EXPIRED, _CLOSED = 0, 1, 2

    def __init__(
        self,
        wake: Callable[[float], asyncio.Future[None]],
        seconds: float,
        hold: Callable[[], Awaitable[object] | None] | None = None,
    ) -> None:
        self._wake = wake
        self._seconds = seconds
        self._hold = hold
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._timer: asyncio.Future[None] | None = None
        self._held: asyncio.Future[None] | None = None
        self._state = self._OPEN

    def expired(self) -> bool:
        """Whether the scope's time ran out (its body was cancelled for it)."""
        return self._state == self._EXPIRED

    async def __aenter__(self) -> Self:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a clock's timeout must be used inside a task")
        self._task, self._cancelling = task, task.cancelling()
        if self._seconds > 0:
            timer = self._wake(self._seconds)
        else:  # the next turn of the loop, as a sleep of no time would
            timer = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(_resolve, timer)
        timer.add_done_callback(self._time_up)
        self._timer = timer
        return self

    def _time_up(self, timer: asyncio.Future[None]) -> None:
        if self._state != self._OPEN or timer.cancelled():
            return  # the scope closed before this callback ran
        timer.result()  # a wake-up that failed is reported (by the loop), not taken for time up
        pending = self._hold() if self._hold is not None else None
        if pending is None:
            self._expire()
        else:
            self._held = asyncio.ensure_future(self._expire_after(pending))

    async def _expire_after(self, pending: Awaitable[object]) -> None:
        await pending
        if self._state == self._OPEN:
            self._expire()

    def _expire(self) -> None:
        self._state = self._EXPIRED
        assert self._task is not None
        self._task.cancel()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: Any, tb: Any) -> None:
        expired = self._state == self._EXPIRED
        if not expired:
            self._state = self._CLOSED
        if self._timer is not None:
            self._timer.cancel()
        if self._held is not None:
            self._held.cancel()
        if not expired:
            return
        # The timer's cancellation is spent however the body ended (as asyncio.timeout's).
        assert self._task is not None
        if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def sleep_timeout(sleep: Callable[[float], Awaitable[None]], seconds: float) -> WakeTimeout:
    """A :class:`WakeTimeout` whose wake-up is a task running ``sleep(seconds)``: a timeout on a
    clock that can only sleep (or on any wait, as :func:`idle_timeout`'s)."""
    return WakeTimeout(lambda s: asyncio.ensure_future(sleep(s)), seconds)


MIN_WAIT_S = 0.01
"""The shortest wait before a deadline a periodic task computed (:func:`seconds_until`): one
that ends this instant is looked at at once, yet the task never spins."""


def seconds_until(clock: Clock, deadline: float) -> float:
    """How long to sleep on ``clock`` until ``deadline`` (clock-monotonic), at least
    :data:`MIN_WAIT_S`."""
    return max(MIN_WAIT_S, deadline - clock.monotonic())


def idle_timeout(clock: Clock, seconds: float, progress: Callable[[], object]) -> WakeTimeout:
    """A scope cancelled once ``seconds`` of ``clock``'s time have passed without ``progress()``
    changing its value (looked at every quarter of ``seconds``, at least once a second); it
    raises :class:`TimeoutError` then. Only idle time counts: a body that keeps moving may take
    as long as it needs."""
    step = min(1.0, seconds / 4)

    async def until_idle(_: float) -> None:
        last, since = progress(), clock.monotonic()
        while (remaining := since + seconds - clock.monotonic()) > 0:
            await clock.sleep(min(step, remaining))
            now = progress()
            if now != last:
                last, since = now, clock.monotonic()

    return sleep_timeout(until_idle, seconds)


async def yield_now() -> None:
    """Let every other task that is ready run once before going on (``asyncio.sleep(0)``): a
    turn of the event loop, not a wait on any clock."""
    await asyncio.sleep(0)
