"""The load topics as typed values: every broker's BrokerLoadData and TopBundlesLoadData.

The two non-persistent topics (DESIGN §3) carry JSON keyed by broker id. This is the only place
they are decoded, with one rule for both: a value is used only when it decodes and names the
broker of the key it was published under (a value under another broker's key is a publisher's
bug or a forgery, and must not speak for that broker). A rejected value is logged once per key and
reason, then skipped quietly until the key publishes something else. Values older than the load
data TTL (``shedding.load_data_ttl_s``) are not returned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId
from lbd.core.load import BrokerLoadData, TopBundlesLoadData
from lbd.ports.clock import Clock
from lbd.ports.loadstore import LoadStore

_log = logging.getLogger(__name__)

_Data = TypeVar("_Data", BrokerLoadData, TopBundlesLoadData)


class LoadView:
    """Reads and publishes both load topics as core types."""

    def __init__(
        self, broker_loads: LoadStore, top_bundles: LoadStore, clock: Clock, *, ttl_s: float
    ) -> None:
        self._broker_loads = broker_loads
        self._top_bundles = top_bundles
        self._clock = clock
        self._ttl_ms = round(ttl_s * 1000)
        self._rejected: dict[tuple[str, str], str] = {}
        """(topic, key) -> the reason last logged, so a bad publisher is logged once."""
        self._decoded: dict[tuple[str, str], tuple[bytes, object]] = {}
        """(topic, key) -> the raw value last decoded and what it decoded to: the assigner
        reads every broker's load on every choice, and a value changes once per report."""

    async def start(self) -> None:
        """Start reading both topics (UnavailableError when Pulsar cannot be reached)."""
        await self._broker_loads.start()
        await self._top_bundles.start()

    async def close(self) -> None:
        """Stop reading. Idempotent."""
        await self._top_bundles.close()
        await self._broker_loads.close()

    def brokers(self) -> dict[BrokerId, BrokerLoadData]:
        """The fresh load data of every broker."""
        return self._read("broker-load", self._broker_loads, BrokerLoadData.from_json)

    def top_bundles(self) -> dict[BrokerId, TopBundlesLoadData]:
        """The fresh top-bundles report of every broker."""
        return self._read("top-bundles", self._top_bundles, TopBundlesLoadData.from_json)

    async def publish(self, data: BrokerLoadData, top: TopBundlesLoadData) -> None:
        """Publish one broker's load and top bundles, each under the broker's id."""
        await self._broker_loads.publish(data.broker, data.to_json())
        await self._top_bundles.publish(top.broker, top.to_json())

    async def delete(self, broker: BrokerId) -> None:
        """Remove ``broker``'s values from both topics (a broker that leaves)."""
        await self._broker_loads.delete(broker)
        await self._top_bundles.delete(broker)

    def _read(
        self, topic: str, store: LoadStore, decode: Callable[[bytes], _Data]
    ) -> dict[BrokerId, _Data]:
        out: dict[BrokerId, _Data] = {}
        for key, raw in store.latest(self._clock.now_ms(), self._ttl_ms).items():
            known = self._decoded.get((topic, key))
            if known is not None and known[0] == raw:
                out[BrokerId(key)] = known[1]  # type: ignore[assignment]  # decoded as _Data
                continue
            try:
                value = decode(raw)
            except InvalidInputError as e:
                self._reject(topic, key, f"malformed: {e}")
                continue
            if value.broker != key:
                self._reject(topic, key, f"names broker {value.broker}")
                continue
            self._rejected.pop((topic, key), None)
            self._decoded[(topic, key)] = (raw, value)
            out[BrokerId(key)] = value
        return out

    def _reject(self, topic: str, key: str, reason: str) -> None:
        if self._rejected.get((topic, key)) != reason:
            self._rejected[(topic, key)] = reason
            _log.warning("ignoring the %s value under key %s: %s", topic, key, reason)
