"""End-to-end fixtures: a real dev cluster per test module (the helpers are in clusters.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.clusters import Cluster, start_cluster, stop_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A 3-broker dev cluster for the whole module; no periodic shedding, so that the tests
    alone move bundles."""
    running = start_cluster(tmp_path_factory.mktemp("dev"), 3, "shedding.interval_s=3600")
    try:
        yield running
    finally:
        stop_cluster(running)
