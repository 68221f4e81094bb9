"""Fixtures of the API tests: a harness, and one sidecar served over gRPC."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.unit.api.served import Api, serve_api, until
from tests.unit.services.harness import Harness


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    """A harness with its sidecars closed after the test."""
    async with Harness() as h:
        yield h


@pytest.fixture
async def api(harness: Harness) -> AsyncIterator[Api]:
    """One auto-ack sidecar, ``broker-a``, behind a gRPC server, elected leader."""
    sidecar = await harness.add("broker-a")
    await harness.ready()
    async with serve_api(harness, sidecar) as served:
        await until(lambda: served.elector.is_leader)
        yield served
