"""The SparkSession of ``lbd analytics``: local mode by default, any Spark master by flag."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from lbd.core.errors import InvalidInputError, LbdError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[*]"

_DEFAULT_CONF = {
    # Everything lbd reads and writes is in UTC epoch milliseconds; so are its partitions.
    "spark.sql.session.timeZone": "UTC",
    # lbd draws its own progress bars; Spark's console bar would interleave with them.
    "spark.ui.showConsoleProgress": "false",
}


class SparkUnavailableError(LbdError):
    """``lbd analytics`` was run without the ``analytics`` extra."""


def require_pyspark() -> None:
    """Raise :class:`SparkUnavailableError` with the fix when pyspark cannot be imported."""
    try:
        import pyspark  # noqa: F401
    except ImportError as e:
        raise SparkUnavailableError(
            f"lbd analytics needs pyspark ({e}); install the analytics extra: "
            "pip install 'lbd[analytics]'"
        ) from None


def parse_conf(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` flags as a dict; InvalidInputError names a malformed one."""
    conf: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise InvalidInputError(f"--spark-conf {pair!r}: expected KEY=VALUE")
        conf[key.strip()] = value
    return conf


def spark_session(
    master: str = DEFAULT_MASTER, *, app_name: str = "lbd", conf: Mapping[str, str] | None = None
) -> SparkSession:
    """A SparkSession on ``master`` (``local[*]``, ``spark://host:port``, ``yarn``, ...).

    Python workers run this interpreter; the driver binds to loopback unless ``SPARK_LOCAL_IP``
    says otherwise (a cluster whose executors live elsewhere needs it set to a reachable address).
    """
    require_pyspark()
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.master(master).appName(app_name)
    settings = {"spark.pyspark.python": sys.executable, **_DEFAULT_CONF, **(conf or {})}
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    return session
