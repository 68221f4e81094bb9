"""The checkpoint store on etcd (DESIGN §4): the leader's snapshot of the channel table.

Why etcd: a checkpoint must survive restarts of either server (the Pulsar server alone cannot lose
the only copy of lbd's compaction, and etcd alone cannot lose the channel position it covers);
the channel topic has no ``seek`` in pulsar-lite, so finding "the newest" checkpoint in a topic
would mean reading all of them; and etcd is already the cluster's metadata store, with the
transactions the "never roll back" rule needs.

Layout under the cluster prefix: the body, zlib-compressed, is cut into chunks below etcd's
request limit (1.5 MiB) and written first under ``checkpoints/<id>/<n>``; then one transaction
compares the manifest's mod revision, writes the manifest ``checkpoint`` (id, position, leader
term, chunk count, sha256 of the body) and deletes the previous checkpoint's chunks. A reader reads
the manifest, then its chunks one request each, and checks the hash; when that fails because a
writer replaced the checkpoint meanwhile, it starts over once. Chunks of a save that died before
its transaction stay behind (they are small in number: one set per crashed save).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import uuid
import zlib
from dataclasses import dataclass

from lbd.adapters.etcd import EtcdConnection, EtcdKeys
from lbd.core.errors import InvalidInputError
from lbd.core.table import ChannelPosition
from lbd.ports.checkpoint import CorruptCheckpointError, StoredCheckpoint, supersedes

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
"""Compressed bytes per chunk: well below etcd's default 1.5 MiB request limit."""


@dataclass(frozen=True, slots=True)
class _Manifest:
    checkpoint_id: str
    position: ChannelPosition
    leader_term: int
    chunks: int
    sha256: str

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "id": self.checkpoint_id,
                "position": self.position.to_json(),
                "leader_term": self.leader_term,
                "chunks": self.chunks,
                "sha256": self.sha256,
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> _Manifest:
        try:
            obj = json.loads(raw)
            return cls(
                checkpoint_id=str(obj["id"]),
                position=ChannelPosition.from_json(obj["position"]),
                leader_term=int(obj["leader_term"]),
                chunks=int(obj["chunks"]),
                sha256=str(obj["sha256"]),
            )
        except (ValueError, KeyError, TypeError, InvalidInputError) as e:
            raise CorruptCheckpointError(f"checkpoint manifest is malformed: {e}") from e

    def fence(self) -> StoredCheckpoint:
        """The manifest's position and term as a body-less checkpoint, for :func:`supersedes`."""
        return StoredCheckpoint(self.position, self.leader_term, b"")


class EtcdCheckpointStore:
    """:class:`~lbd.ports.checkpoint.CheckpointStore` on etcd (see the module docstring)."""

    def __init__(self, conn: EtcdConnection, prefix: str, chunk_bytes: int = CHUNK_BYTES) -> None:
        if chunk_bytes <= 0:
            raise InvalidInputError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        self._conn = conn
        self._keys = EtcdKeys(prefix)
        self._chunk_bytes = chunk_bytes

    async def save(self, checkpoint: StoredCheckpoint) -> bool:
        """Write ``checkpoint`` unless the stored one is as new or newer; True if written."""
        current = await self._conn.get(self._keys.checkpoint)
        old = None if current is None else _Manifest.from_json(current.value)
        if old is not None and not supersedes(checkpoint, old.fence()):
            return False
        # Compression of a multi-megabyte table would stall the event loop.
        compressed = await asyncio.to_thread(zlib.compress, checkpoint.body)
        parts = [
            compressed[i : i + self._chunk_bytes]
            for i in range(0, len(compressed), self._chunk_bytes)
        ] or [b""]
        manifest = _Manifest(
            checkpoint_id=uuid.uuid4().hex,
            position=checkpoint.position,
            leader_term=checkpoint.leader_term,
            chunks=len(parts),
            sha256=hashlib.sha256(checkpoint.body).hexdigest(),
        )
        chunk_dir = self._keys.chunk_dir(manifest.checkpoint_id)
        for n, part in enumerate(parts):
            await self._conn.put(_chunk_key(chunk_dir, n), part)
        expected = 0 if current is None else current.mod_revision
        while True:
            written, now = await self._conn.swap(
                self._keys.checkpoint,
                manifest.to_json(),
                expected,
                delete_prefix=None if old is None else self._keys.chunk_dir(old.checkpoint_id),
            )
            if written:
                log.info(
                    "checkpoint %s saved: position %s, term %d, %d chunk(s)",
                    manifest.checkpoint_id,
                    manifest.position,
                    manifest.leader_term,
                    manifest.chunks,
                )
                return True
            # Another writer got in between: judge against what it wrote.
            old = None if now is None else _Manifest.from_json(now.value)
            expected = 0 if now is None else now.mod_revision
            if old is not None and not supersedes(checkpoint, old.fence()):
                await self._conn.delete_prefix(chunk_dir)
                return False

    async def load(self) -> StoredCheckpoint | None:
        """The newest checkpoint, read whole and verified, or None."""
        current = await self._conn.get(self._keys.checkpoint)
        if current is None:
            return None
        try:
            return await self._read(current.value)
        except CorruptCheckpointError:
            again = await self._conn.get(self._keys.checkpoint)
            if again is None or again.mod_revision == current.mod_revision:
                raise
        # Replaced while we read it (its chunks were deleted): once more, and only once — a
        # checkpoint replaced twice during one read would not be caught by more retries either.
        return await self._read(again.value)

    async def _read(self, raw_manifest: bytes) -> StoredCheckpoint:
        manifest = _Manifest.from_json(raw_manifest)
        body = await self._read_body(manifest)
        return StoredCheckpoint(manifest.position, manifest.leader_term, body)

    async def _read_body(self, manifest: _Manifest) -> bytes:
        chunk_dir = self._keys.chunk_dir(manifest.checkpoint_id)
        parts: list[bytes] = []
        for n in range(manifest.chunks):
            kv = await self._conn.get(_chunk_key(chunk_dir, n))
            if kv is None:
                raise CorruptCheckpointError(
                    f"checkpoint {manifest.checkpoint_id}: chunk {n} of {manifest.chunks} missing"
                )
            parts.append(kv.value)
        try:
            body = await asyncio.to_thread(zlib.decompress, b"".join(parts))
        except zlib.error as e:
            raise CorruptCheckpointError(
                f"checkpoint {manifest.checkpoint_id}: body does not decompress: {e}"
            ) from e
        if hashlib.sha256(body).hexdigest() != manifest.sha256:
            raise CorruptCheckpointError(
                f"checkpoint {manifest.checkpoint_id}: sha256 of the body does not match"
            )
        return body


def _chunk_key(chunk_dir: bytes, n: int) -> bytes:
    return chunk_dir + f"{n:06d}".encode()
