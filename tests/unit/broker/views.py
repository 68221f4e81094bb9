"""Helpers for tests of the ownership view: messages, a clock the test moves, topics by hash."""

from __future__ import annotations

import zlib

from lbd.core.bundles import topic_hash
from lbd.gen.v1 import lbd_pb2

DONE = lbd_pb2.OwnershipChange(snapshot_done=True)


def owned(bundle: str, owner: str, version: int = 1) -> lbd_pb2.OwnershipChange:
    """``bundle`` Owned by ``owner``."""
    return lbd_pb2.OwnershipChange(
        bundle=bundle, state=lbd_pb2.BUNDLE_STATE_OWNED, owner_broker_id=owner, version_id=version
    )


def value(
    bundle: str, state: lbd_pb2.BundleState, owner: str = "", version: int = 1
) -> lbd_pb2.OwnershipChange:
    """``bundle`` in ``state`` (INIT: tombstoned)."""
    return lbd_pb2.OwnershipChange(
        bundle=bundle, state=state, owner_broker_id=owner, version_id=version
    )


def heartbeat(age_ms: int = 0) -> lbd_pb2.OwnershipChange:
    """A heartbeat vouching for the instant ``age_ms`` before it was sent."""
    return lbd_pb2.OwnershipChange(heartbeat=True, vouched_age_ms=age_ms)


class ManualClock:
    """A monotonic clock (seconds) that moves only when the test moves it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def topic_with_hash(namespace: str, target: int) -> str:
    """A valid topic of ``namespace`` whose CRC-32 is ``target``.

    CRC-32 is affine over GF(2) for messages of one length: turning some letters of a name from
    'a' to 'b' changes its CRC by the XOR of what each change alone does. So pick the set of
    changes whose XOR turns the CRC into ``target`` (Gaussian elimination on 32-bit words).
    """
    prefix = f"persistent://{namespace}/"
    letters = 64
    base = prefix + "a" * letters
    base_crc = zlib.crc32(base.encode())
    # Each basis row: (pivot bit, its delta, the letters whose changes make up that delta).
    basis: list[tuple[int, int, int]] = []
    for i in range(letters):
        flipped = prefix + "a" * i + "b" + "a" * (letters - i - 1)
        delta, used = zlib.crc32(flipped.encode()) ^ base_crc, 1 << i
        for pivot, row, row_used in basis:
            if delta & pivot:
                delta, used = delta ^ row, used ^ row_used
        if delta:
            basis.append((delta & -delta, delta, used))
    want, used = target ^ base_crc, 0
    for pivot, row, row_used in basis:
        if want & pivot:
            want, used = want ^ row, used ^ row_used
    assert want == 0, "the letters do not span every CRC"
    topic = prefix + "".join("b" if used >> i & 1 else "a" for i in range(letters))
    assert topic_hash(topic) == target
    return topic
