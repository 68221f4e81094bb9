"""An asyncio event loop that runs on virtual time, for the simulated world.

The loop never waits: it runs every ready callback, and when none is left it moves the world's
:class:`~lbd.adapters.clock.ManualClock` straight to the earliest pending deadline (a clock sleep
or a ``call_at`` timer, whichever ends first). Ten virtual minutes cost only the work done in
them, and every ordering is the loop's FIFO and the deadlines' order: nothing depends on the
machine's speed.

There is no I/O: the simulated world is one process talking to in-memory ports, and what would
run on a thread (``asyncio.to_thread``) runs inline. A task that
waits for something no one will ever do, with nothing scheduled, is a deadlock; a burst of work
that never lets virtual time move is a livelock. Both raise :class:`SimulationStuck`.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
from asyncio import base_events
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from lbd.adapters.clock import ManualClock

T = TypeVar("T")

LIVELOCK_CALLBACKS = 2_000_000
"""Callbacks run at one virtual instant beyond which the run counts as a livelock (a settled
instant of a five-broker world runs a few hundred)."""


class SimulationStuck(RuntimeError):
    """The simulated world can make no progress: nothing to run and nothing scheduled, or work
    that never lets virtual time move."""


class VirtualTimeLoop(base_events.BaseEventLoop):
    """An event loop whose time is ``clock``'s and which jumps over idle time (see the module
    docstring)."""

    # The base loop's own state, which this loop drives (typeshed does not declare it).
    _ready: collections.deque[asyncio.Handle]
    _scheduled: list[asyncio.TimerHandle]
    _stopping: bool
    _timer_cancelled_count: int

    def __init__(self, clock: ManualClock) -> None:
        super().__init__()
        self._clock = clock
        self._clock_resolution = 0.0

    # Never in debug mode. Every future and task made asks, from C: ``bool()`` answers False
    # without a Python frame.
    get_debug = staticmethod(bool)

    def time(self) -> float:
        """The virtual time (``call_at`` deadlines are on this scale)."""
        return self._clock.monotonic()

    def call_soon(  # type: ignore[override]
        self, callback: Callable[..., object], *args: Any, context: Any = None
    ) -> asyncio.Handle:
        """Queue ``callback`` (as the base loop does, without its debug-mode checks: every
        task of the world calls this, so it is the simulation's hottest path)."""
        handle = asyncio.Handle(callback, args, self, context)
        self._ready.append(handle)
        return handle

    def run_in_executor(  # type: ignore[override]
        self, executor: Any, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        """Run ``func`` here and now (``asyncio.to_thread`` included): a thread would finish at
        a time of the machine's choosing, and the loop does not wait for what it cannot see."""
        future: asyncio.Future[T] = self.create_future()
        try:
            future.set_result(func(*args))
        except BaseException as e:  # handed to whoever awaits it, as a thread would
            future.set_exception(e)
        return future

    def _process_events(self, event_list: Any) -> None:  # no I/O to process
        return None

    def _write_to_self(self) -> None:  # nothing to wake: the loop never blocks
        return None

    def _run_once(self) -> None:
        scheduled = self._scheduled
        while scheduled and scheduled[0].cancelled():
            heapq.heappop(scheduled)._scheduled = False  # type: ignore[attr-defined]
            self._timer_cancelled_count -= 1
        ready = self._ready
        if not ready and not self._stopping:
            self._advance()
        now = self._clock.monotonic()
        while scheduled and scheduled[0].when() <= now:
            timer = heapq.heappop(scheduled)
            timer._scheduled = False  # type: ignore[attr-defined]
            ready.append(timer)
        # Run what is ready and what that makes ready, in order, until the instant settles (or
        # the loop is told to stop): with no I/O to poll there is nothing to go back for.
        ran = 0
        popleft = ready.popleft
        while ready and not self._stopping:
            handle = popleft()
            if not handle._cancelled:
                # Handle._run, inline: a frame less for each of the world's callbacks.
                try:
                    handle._context.run(handle._callback, *handle._args)  # type: ignore[attr-defined]
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as e:
                    self.call_exception_handler(
                        {
                            "message": f"Exception in callback {handle!r}",
                            "exception": e,
                            "handle": handle,
                        }
                    )
            ran += 1
            if ran > LIVELOCK_CALLBACKS:
                raise SimulationStuck(
                    f"livelock: {ran} callbacks at virtual time {now:.3f} without time moving on"
                )

    def _advance(self) -> None:
        """Move the clock to the earliest deadline (that wakes its sleepers into ``_ready``)."""
        timer = self._scheduled[0].when() if self._scheduled else None
        if not self._clock.advance_to_next(timer) and timer is None:
            raise SimulationStuck(
                f"deadlock at virtual time {self._clock.monotonic():.3f}: "
                "no callback is ready and nothing is scheduled"
            )


def run(clock: ManualClock, main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``main()`` to completion on a :class:`VirtualTimeLoop` over ``clock``."""
    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(clock)) as runner:
        return runner.run(main())


async def settle(turns: int = 10_000) -> None:
    """Let every callback ready at this virtual instant run (and what they make ready, in turn)
    before going on: the world looks at a settled state, never one half-way through an
    instant's work."""
    loop = asyncio.get_running_loop()
    ready = loop._ready  # type: ignore[attr-defined]
    for _ in range(turns):
        if not ready:
            return
        await asyncio.sleep(0)
    raise SimulationStuck(f"the instant did not settle within {turns} turns")
