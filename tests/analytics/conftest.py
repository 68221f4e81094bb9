"""One small local SparkSession for every analytics test (helpers: histories.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="the analytics extra is not installed")


SPARK_TIMEOUT_S = 240
"""A test's timeout here when it sets none: the first test to ask for the session starts Spark's
JVM within its own timeout, which takes a minute or more on a slow machine running the cluster
tiers beside it."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SPARK_TIMEOUT_S))


SPARK_CONF = {
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.driver.memory": "1g",
}


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """The session's SparkSession, local[2] on loopback."""
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from lbd.analytics.spark import spark_session

    session = spark_session("local[2]", app_name="lbd-tests", conf=SPARK_CONF)
    yield session
    session.stop()
