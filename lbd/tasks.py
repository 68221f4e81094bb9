"""Named, guarded background tasks (kopf's ``aiotasks.guard`` in spirit).

A guarded task logs its own death with its name; a *root* task's death is also reported to a
callback so that the daemon can stop loudly instead of running on without a vital part.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

_log = logging.getLogger(__name__)


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
