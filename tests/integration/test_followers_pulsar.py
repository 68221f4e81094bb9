"""Channel followers on the real pulsar-lite: concurrency, dump/replay, kill -9 of the server."""

import asyncio
import json
import os
import random
import sys
from pathlib import Path

import pytest
from channel_values import value

from lbd.adapters.pulsar_channel import PulsarChannelLog
from lbd.adapters.pulsar_client import PulsarConnection
from lbd.core.ids import BundleId
from lbd.core.state import ServiceUnitState, to_json_object
from lbd.core.table import ChannelPosition, StateTable
from lbd.devcluster.servers import PulsarLiteServer
from lbd.ports.errors import UnavailableError
from lbd.services.channel.follower import ChannelFollower

pytestmark = pytest.mark.servers
PUBLISH_ATTEMPTS = 20
LBD = Path(sys.executable).with_name("lbd")
S = ServiceUnitState


async def run_lbd(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run the ``lbd`` console script; its exit code, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        str(LBD), *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(60):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def full_replay(url: str, topic: str) -> StateTable:
    connection = PulsarConnection(url, operation_timeout_s=5)
    log = PulsarChannelLog(connection, topic)
    table = StateTable()
    try:
        async for m in log.catch_up(None):
            table.apply(m.position, BundleId(m.key), m.value)
    finally:
        await log.close()
        await connection.close()
    return table


async def publish_retrying(
    log: PulsarChannelLog, bundle: BundleId, proposal: bytes
) -> ChannelPosition:
    """Publish as a sidecar would: again while the channel is unavailable (a send that timed out
    on a busy machine, a restarting server). A failed send may still have been appended; the
    resolver rejects the repeat (same version), so it is never applied twice."""
    for attempt in range(PUBLISH_ATTEMPTS):
        try:
            return await log.publish(bundle, proposal)
        except UnavailableError:
            if attempt == PUBLISH_ATTEMPTS - 1:
                raise
            await asyncio.sleep(0.1)
    raise AssertionError("unreachable")


async def writer(
    url: str, topic: str, name: str, bundles: list[BundleId], seed: int
) -> ChannelPosition:
    """Race the other writers: assign every bundle to ``name``, then release some of them."""
    rng = random.Random(seed)
    connection = PulsarConnection(url, operation_timeout_s=5)
    log = PulsarChannelLog(connection, topic)
    last = ChannelPosition(0, -1)
    try:
        for bundle in rng.sample(bundles, len(bundles)):
            for proposal in (
                value(S.Assigning, 1, name),
                value(S.Owned, 2, name),
                value(S.Releasing, 3, None, name),
                value(S.Free, 4, None, name),
            )[: rng.choice((2, 4))]:
                last = max(last, await publish_retrying(log, bundle, proposal))
    finally:
        await log.close()
        await connection.close()
    return last


async def test_three_followers_agree_under_conflicting_writers_and_match_dump_replay(
    pulsar_server: PulsarLiteServer, pulsar_topic: str, tmp_path: Path
) -> None:
    url = pulsar_server.service_url
    bundles = [BundleId(f"public/default/0x{i:08x}_0x{i + 1:08x}") for i in range(30)]
    connections = [PulsarConnection(url, operation_timeout_s=5) for _ in range(3)]
    followers = [ChannelFollower(PulsarChannelLog(c, pulsar_topic)) for c in connections]
    try:
        for f in followers:
            await f.start()
        # A TaskGroup: a writer that fails cancels the others, and none outlives the test.
        async with asyncio.TaskGroup() as group:
            writers = [
                group.create_task(writer(url, pulsar_topic, f"broker-{i}", bundles, seed=i))
                for i in range(4)
            ]
        lasts = [w.result() for w in writers]
        async with asyncio.timeout(30):
            for f in followers:
                await f.wait_applied(max(lasts))
        tables = [dict(f.table.items()) for f in followers]
        assert tables[0] == tables[1] == tables[2]
        assert len(tables[0]) == len(bundles)
        assert sum(f.stats.rejected for f in followers) > 0, "the writers never conflicted"
        # Every bundle ended with one owner or free: the first writer to assign it won.
        for value in tables[0].values():
            assert value.state in (S.Owned, S.Free)
    finally:
        for f in followers:
            await f.close()
        for c in connections:
            await c.close()

    out = tmp_path / "channel.jsonl"
    env = {**os.environ, "LBD_PULSAR__STATE_CHANNEL_TOPIC": pulsar_topic}
    code, _, err = await run_lbd("channel", "dump", "--out", str(out), "--pulsar-url", url, env=env)
    assert code == 0, err
    code, replayed, err = await run_lbd("channel", "replay", str(out))
    assert code == 0, err
    expected = {bundle: to_json_object(value) for bundle, value in tables[0].items()}
    assert json.loads(replayed) == expected


CYCLE = (
    (S.Assigning, "broker-a", None),
    (S.Owned, "broker-a", None),
    (S.Releasing, None, "broker-a"),
    (S.Free, None, "broker-a"),
)
"""A bundle's life in a loop: every step is the valid next version of the one before."""


async def test_followers_survive_a_kill_9_of_pulsar_without_loss_or_double_apply(
    private_pulsar_server: PulsarLiteServer, pulsar_topic: str
) -> None:
    server = private_pulsar_server
    url = server.service_url
    bundles = [BundleId(f"public/default/0x{i:08x}_0x{i + 1:08x}") for i in range(10)]
    rounds = 20
    connections = [PulsarConnection(url, operation_timeout_s=3) for _ in range(3)]
    followers = [ChannelFollower(PulsarChannelLog(c, pulsar_topic)) for c in connections[:2]]
    log = PulsarChannelLog(connections[2], pulsar_topic)
    last = ChannelPosition(0, -1)
    try:
        for f in followers:
            await f.start()
        for version in range(1, rounds + 1):
            if version == rounds // 2:
                server.kill()
                server.restart()
            state, dst, src = CYCLE[(version - 1) % len(CYCLE)]
            for bundle in bundles:
                last = await publish_retrying(log, bundle, value(state, version, dst, src))
        async with asyncio.timeout(30):
            for f in followers:
                await f.wait_applied(last)
        expected = await full_replay(url, pulsar_topic)
        assert {v.version_id for _, v in expected.items()} == {rounds}
        for f in followers:
            assert dict(f.table.items()) == dict(expected.items())
            assert f.stats.accepted == rounds * len(bundles)  # each write applied exactly once
            assert f.stats.malformed == 0
    finally:
        await log.close()
        for f in followers:
            await f.close()
        for c in connections:
            await c.close()
