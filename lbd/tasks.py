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
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Final, Self, TypeVar

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


class _Expiry:
    """What a :func:`sleep_timeout` scope yields: whether its time ran out."""

    def __init__(self) -> None:
        self._expired = False

    def expired(self) -> bool:
        """Whether the scope's time ran out (its body was cancelled for it)."""
        return self._expired


@contextlib.asynccontextmanager
async def sleep_timeout(
    sleep: Callable[[float], Awaitable[None]], seconds: float
) -> AsyncIterator[_Expiry]:
    """``asyncio.timeout`` on another clock: cancel the body once ``sleep(seconds)`` returns,
    and raise :class:`TimeoutError` then.

    The timer is a task that cancels the body's task, so a cancellation from elsewhere is told
    apart by the task's cancel count, as ``asyncio.timeout`` does.
    """
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("sleep_timeout must be used inside a task")
    cancelling = task.cancelling()
    expiry = _Expiry()

    async def expire() -> None:
        await sleep(seconds)
        expiry._expired = True
        task.cancel()

    timer = asyncio.ensure_future(expire())
    try:
        yield expiry
    except asyncio.CancelledError as e:
        if expiry.expired() and task.uncancel() <= cancelling:
            raise TimeoutError from e
        raise
    else:
        if expiry.expired():
            task.uncancel()  # the body swallowed the cancellation the timer sent
    finally:
        # A timer whose sleep ended but that has not run yet is cancelled before it cancels.
        timer.cancel()


MIN_WAIT_S = 0.01
"""The shortest wait before a deadline a periodic task computed (:func:`seconds_until`): one
that ends this instant is looked at at once, yet the task never spins."""


def seconds_until(clock: Clock, deadline: float) -> float:
    """How long to sleep on ``clock`` until ``deadline`` (clock-monotonic), at least
    :data:`MIN_WAIT_S`."""
    return max(MIN_WAIT_S, deadline - clock.monotonic())


def idle_timeout(
    clock: Clock, seconds: float, progress: Callable[[], object]
) -> contextlib.AbstractAsyncContextManager[_Expiry]:
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
