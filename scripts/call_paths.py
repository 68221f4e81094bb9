"""How many of lbd's files, and cross-file calls, a never-owned Lookup and a Transfer run through.

``python scripts/call_paths.py`` builds two in-process sidecars with the unit tests' harness (the
wiring ``lbd serve`` uses, on the memory adapters), traces every call into ``lbd/`` from the
request until the cluster is idle again (the destination's reconciliation included), and prints
the counts and the files. A measure of how far a reader has to follow one request.

The Transfer is the one path an admin Transfer takes once the API has handed it to the leader's
sidecar (the gRPC layers, and the forwarding from a follower, are not in the count): the leader's
``OperationTracker.admin_move``, its checks, the governor, the proposal and the owners'
reconciliation.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "unit" / "services")]

from harness import Harness  # noqa: E402

PACKAGE = str(ROOT / "lbd") + "/"


async def traced(
    run: Callable[[], Awaitable[Any]], h: Harness
) -> tuple[set[str], set[tuple[str, str]]]:
    """The lbd files entered and the cross-file call edges while ``run`` and the settling after."""
    files: set[str] = set()
    edges: set[tuple[str, str]] = set()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        callee = frame.f_code.co_filename.removeprefix(PACKAGE)
        files.add(callee)
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(PACKAGE):
            caller = caller.f_back
        if (
            caller is not None
            and (source := caller.f_code.co_filename.removeprefix(PACKAGE)) != callee
        ):
            edges.add((source, callee))

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        await run()
        await h.idle()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return files, edges


async def main() -> None:
    async with Harness() as h:
        a, b = await h.start(2)
        topic = "persistent://public/default/never-owned"
        files, edges = await traced(lambda: a.lookup.lookup(topic), h)
        print(f"lookup of a never-owned topic: {len(files)} files, {len(edges)} cross-file calls")
        print("   ", " ".join(sorted(files)))
        result = await a.lookup.lookup(topic)
        dst = b if result.owner_id == a.me else a
        leader = await h.leader()
        files, edges = await traced(lambda: leader.tracker.admin_move(result.bundle, dst.me), h)
        print(f"transfer: {len(files)} files, {len(edges)} cross-file calls")
        print("   ", " ".join(sorted(files)))


if __name__ == "__main__":
    asyncio.run(main())
