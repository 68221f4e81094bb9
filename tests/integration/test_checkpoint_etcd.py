"""The checkpoint contract against a real etcd, plus the chunk layout only etcd has."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator

import aetcd
import pytest

from lbd.adapters.etcd import EtcdConnection
from lbd.adapters.etcd_checkpoint import EtcdCheckpointStore
from lbd.devcluster import EtcdServer
from lbd.ports.checkpoint import CorruptCheckpointError
from lbd.ports.errors import UnavailableError
from tests.conftest import EtcdClientFactory
from tests.contract.checkpoint_suite import CheckpointStoreContract, StoreFactory, checkpoint

pytestmark = pytest.mark.servers

CHUNK = 256 * 1024


@pytest.fixture
async def conn(etcd_server: EtcdServer) -> AsyncIterator[EtcdConnection]:
    connection = EtcdConnection([etcd_server.client_url], request_timeout_s=5)
    yield connection
    await connection.close()


@pytest.fixture
async def admin(
    etcd_server: EtcdServer, etcd_prefix: bytes, etcd_clients: EtcdClientFactory
) -> AsyncIterator[aetcd.Client]:
    client = etcd_clients(etcd_server)
    yield client
    await client.delete_prefix(etcd_prefix)


class TestEtcdCheckpointStore(CheckpointStoreContract):
    @pytest.fixture
    def make_store(
        self, conn: EtcdConnection, etcd_prefix: bytes, admin: aetcd.Client
    ) -> StoreFactory:
        # The default chunk size: the large-body test checks it against etcd's request limit.
        return lambda: EtcdCheckpointStore(conn, etcd_prefix.decode())


async def test_body_is_chunked_and_old_chunks_are_deleted(
    conn: EtcdConnection, etcd_prefix: bytes, admin: aetcd.Client
) -> None:
    store = EtcdCheckpointStore(conn, etcd_prefix.decode(), chunk_bytes=CHUNK)
    assert await store.save(checkpoint(1, 1, os.urandom(3 * CHUNK)))
    first = await _chunk_dirs(admin, etcd_prefix)
    assert len(first) == 1
    assert sum(first.values()) >= 3
    assert await store.save(checkpoint(1, 2, b"small"))
    second = await _chunk_dirs(admin, etcd_prefix)
    assert list(second.values()) == [1]
    assert not set(first) & set(second)
    manifest = json.loads((await admin.get(etcd_prefix + b"checkpoint")).value)
    assert manifest["position"] == [1, 2, -1]
    assert manifest["leader_term"] == 1
    assert manifest["chunks"] == 1


async def test_a_missing_chunk_is_reported_as_corrupt(
    conn: EtcdConnection, etcd_prefix: bytes, admin: aetcd.Client
) -> None:
    store = EtcdCheckpointStore(conn, etcd_prefix.decode(), chunk_bytes=CHUNK)
    assert await store.save(checkpoint(1, 1, os.urandom(2 * CHUNK)))
    (chunk_dir,) = await _chunk_dirs(admin, etcd_prefix)
    await admin.delete(etcd_prefix + b"checkpoints/" + chunk_dir.encode() + b"/000001")
    with pytest.raises(CorruptCheckpointError, match="chunk 1 of"):
        await store.load()


async def test_a_dead_server_is_unavailable(private_etcd_server: EtcdServer) -> None:
    connection = EtcdConnection([private_etcd_server.client_url], request_timeout_s=1)
    store = EtcdCheckpointStore(connection, "/lbd/test")
    try:
        assert await store.save(checkpoint(1, 1))
        private_etcd_server.restart()
        assert await _load_eventually(store) == checkpoint(1, 1), "it survives a restart"
        private_etcd_server.kill()
        with pytest.raises(UnavailableError):
            await store.load()
    finally:
        await connection.close()


async def _load_eventually(store: EtcdCheckpointStore) -> object:
    for _ in range(50):
        try:
            return await store.load()
        except UnavailableError:
            continue
    return await store.load()


async def _chunk_dirs(admin: aetcd.Client, prefix: bytes) -> dict[str, int]:
    """Chunk count per checkpoint id under ``checkpoints/``."""
    found: dict[str, int] = {}
    for kv in await admin.get_prefix(prefix + b"checkpoints/"):
        checkpoint_id = kv.key[len(prefix + b"checkpoints/") :].decode().split("/")[0]
        found[checkpoint_id] = found.get(checkpoint_id, 0) + 1
    return found
