"""Fixtures shared by all tests: real etcd and pulsar-lite servers, their clients, task-leak checks.

Servers are session-scoped and start only when a test asks for them, so unit tests never pay for
them. A test that disturbs a server (freeze, kill, restart) takes a ``private_*`` server of its own,
so the shared ones stay healthy for everyone else.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aetcd
import pulsar
import pulsar.asyncio
import pytest
from pytest_asyncio import is_async_test

from lbd.adapters.pulsar_client import native_logger
from lbd.devcluster import EtcdServer, PulsarLiteServer

CLIENT_TIMEOUT_S = 5
LEAK_GRACE_S = 2.0
"""How long a task still running after a test's teardown may take to end before it counts as
leaked (a stopped gRPC server's call tasks end from its poller thread)."""


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    """One etcd for the whole session; tests separate their keys with ``etcd_prefix``."""
    with EtcdServer() as server:
        yield server


@pytest.fixture(scope="session")
def pulsar_server() -> Iterator[PulsarLiteServer]:
    """One pulsar-lite for the whole session; tests separate their topics with ``pulsar_topic``."""
    with PulsarLiteServer() as server:
        yield server


@pytest.fixture
def private_etcd_server() -> Iterator[EtcdServer]:
    """An etcd of this test's own, free to be frozen, killed or restarted."""
    with EtcdServer() as server:
        yield server


@pytest.fixture
def private_pulsar_server() -> Iterator[PulsarLiteServer]:
    """A pulsar-lite of this test's own, free to be frozen, killed or restarted."""
    with PulsarLiteServer() as server:
        yield server


@pytest.fixture
def etcd_prefix() -> bytes:
    """A key prefix no other test uses, ending in ``/``."""
    return f"/lbd-test/{uuid.uuid4().hex}/".encode()


EtcdClientFactory = Callable[..., aetcd.Client]
PulsarClientFactory = Callable[[PulsarLiteServer], pulsar.asyncio.Client]


@pytest.fixture
async def etcd_clients() -> AsyncIterator[EtcdClientFactory]:
    """Make aetcd clients of any server (they connect on first use); all are closed after."""
    clients: list[aetcd.Client] = []

    def make(server: EtcdServer, timeout_s: float = CLIENT_TIMEOUT_S) -> aetcd.Client:
        client = aetcd.Client(server.host, server.port, timeout=timeout_s)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


@pytest.fixture
async def etcd_client(
    etcd_server: EtcdServer, etcd_prefix: bytes, etcd_clients: EtcdClientFactory
) -> AsyncIterator[aetcd.Client]:
    """A client of the shared etcd; the test's prefix is deleted afterwards."""
    client = etcd_clients(etcd_server)
    yield client
    await client.delete_prefix(etcd_prefix)


@pytest.fixture
def pulsar_topic() -> str:
    """A persistent topic name no other test uses."""
    return f"persistent://public/default/lbd-test-{uuid.uuid4().hex}"


@pytest.fixture
async def pulsar_clients() -> AsyncIterator[PulsarClientFactory]:
    """Make asyncio Pulsar clients of any server; all (with their producers/readers) closed after.

    Timeouts are short. The client logs natively (warnings and errors only, see
    :func:`~lbd.adapters.pulsar_client.native_logger`).
    """
    clients: list[pulsar.asyncio.Client] = []

    def make(server: PulsarLiteServer) -> pulsar.asyncio.Client:
        client = pulsar.asyncio.Client(
            server.service_url,
            operation_timeout_seconds=CLIENT_TIMEOUT_S,
            connection_timeout_ms=CLIENT_TIMEOUT_S * 1000,
            logger=native_logger(),
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


@pytest.fixture
def pulsar_client(
    pulsar_server: PulsarLiteServer, pulsar_clients: PulsarClientFactory
) -> pulsar.asyncio.Client:
    """An asyncio client of the shared pulsar-lite."""
    return pulsar_clients(pulsar_server)


@pytest.fixture(autouse=True)
def _fail_on_leaked_tasks(request: pytest.FixtureRequest) -> None:
    """Check async tests for leaked tasks; sync tests have no loop to check."""
    # Requested from an autouse fixture so that it is set up before, and torn down after, every
    # fixture the test asks for: tasks those fixtures own are stopped by the time it looks.
    if is_async_test(request.node):
        request.getfixturevalue("_no_leaked_tasks")


@pytest.fixture
async def _no_leaked_tasks() -> AsyncIterator[None]:
    """Fail the test if tasks it (or its fixtures) started still run after their teardown."""
    before = asyncio.all_tasks()
    yield
    # Tasks cancelled or finished in the last step need a few loop turns to be marked done.
    for _ in range(3):
        await asyncio.sleep(0)
    leaked = asyncio.all_tasks() - before - {asyncio.current_task()}
    # A stopped gRPC server's call tasks end once its poller thread has delivered their last
    # events, which takes a moment on a loaded machine: a task that leaked still runs after it.
    deadline = time.monotonic() + LEAK_GRACE_S
    while leaked and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        leaked = {task for task in leaked if not task.done()}
    if leaked:
        described = sorted(map(repr, leaked))
        for task in leaked:
            task.cancel()
        pytest.fail(f"the test left {len(leaked)} asyncio task(s) running: {described}")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Print a failure or error as it happens, not only in the summary at the end: a native
    library that aborts the whole process later (Fatal Python error: Aborted) takes the summary
    with it, and CI's log would say only that something failed. Each phase's time is counted to
    its tier as well (:func:`pytest_terminal_summary`)."""
    _count_time(report)
    if not report.failed:
        return
    reporter = _REPORTER.get("terminal")
    if reporter is None:
        return
    reporter.write_line("")
    reporter.write_line(f"--- {report.nodeid} failed ({report.when}), at once:", red=True)
    for line in report.longreprtext.splitlines()[-60:]:
        reporter.write_line(line)


_REPORTER: dict[str, pytest.TerminalReporter] = {}


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        _REPORTER["terminal"] = reporter


_TIER_SECONDS: dict[str, float] = {}
_TIER_TESTS: dict[str, int] = {}


def _tier(nodeid: str) -> str:
    """The tier of a test: its folder under tests/ (unit, contract, integration, e2e, chaos...)."""
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]


def _count_time(report: pytest.TestReport) -> None:
    """Count each phase's time (setup, call, teardown) to its tier, for the summary below."""
    tier = _tier(report.nodeid)
    _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration
    if report.when == "call" or (report.when == "setup" and report.skipped):
        _TIER_TESTS[tier] = _TIER_TESTS.get(tier, 0) + 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Where the suite's time went: seconds and tests per tier, slowest first (session fixtures
    such as the servers count to the first test that uses them)."""
    if not _TIER_SECONDS:
        return
    terminalreporter.section("time per tier")
    for tier, seconds in sorted(_TIER_SECONDS.items(), key=lambda item: -item[1]):
        tests = _TIER_TESTS.get(tier, 0)
        terminalreporter.write_line(f"{tier:<12} {seconds:8.1f} s  {tests:5d} tests")
    terminalreporter.write_line(f"{'all':<12} {sum(_TIER_SECONDS.values()):8.1f} s")
    # scripts/run_tests.py runs several pytest side by side and adds their tiers up from here.
    if path := os.environ.get("LBD_TIER_FILE"):
        tiers = {
            tier: {"seconds": seconds, "tests": _TIER_TESTS.get(tier, 0)}
            for tier, seconds in _TIER_SECONDS.items()
        }
        Path(path).write_text(json.dumps(tiers))
