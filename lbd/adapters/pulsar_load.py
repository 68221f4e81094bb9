"""Load stores on non-persistent Pulsar topics (the :class:`~lbd.ports.loadstore.LoadStore` port).

A store publishes keyed values with its own producer and, once started, reads the topic with a
reader from "latest" in a named background task that keeps the newest value per key with the time
it arrived (from the injected clock). Non-persistent topics keep nothing, so a reader replaced after
an outage simply continues with what is published from then on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

import pulsar

from lbd.adapters.pulsar_client import (
    PULSAR_ERRORS,
    PulsarConnection,
    close_quietly,
    unavailable,
)
from lbd.core.errors import InvalidInputError
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.ports.loadstore import LatestValues
from lbd.tasks import Component, Tasks

_WATCH_INTERVAL_S: Final = 0.5
"""How often the receiving task checks that its reader is still connected."""
_RETRY_MIN_S: Final = 0.1
_RETRY_MAX_S: Final = 2.0

_log = logging.getLogger(__name__)


class PulsarLoadStore(Component):
    """Latest value per key of the non-persistent ``topic``, expiring by age on read."""

    def __init__(self, connection: PulsarConnection, topic: str, clock: Clock) -> None:
        self._connection = connection
        self._topic = topic
        self._clock = clock
        self._values = LatestValues()
        self._producer: Any = None
        self._producer_lock = asyncio.Lock()
        self._tasks = Tasks(f"the load store of {topic}")
        self._closed = False

    @property
    def topic(self) -> str:
        """The load-data topic."""
        return self._topic

    async def start(self) -> None:
        """Subscribe, then receive in a background task until closed (see the port)."""
        self._check_open()
        if self._tasks:
            return
        reader = await self._open_reader()
        self._tasks.spawn(self._receive(reader), name=f"lbd-load-receiver[{self._topic}]")

    async def publish(self, key: str, value: bytes) -> None:
        """Publish the latest ``value`` of ``key`` (see the port)."""
        if not value:
            raise InvalidInputError(f"load value of {key!r} is empty: use delete() for a tombstone")
        await self._send(key, value)

    async def delete(self, key: str) -> None:
        """Publish a tombstone (an empty value) for ``key``."""
        await self._send(key, b"")

    def latest(self, now_ms: int, ttl_ms: int) -> dict[str, bytes]:
        """Latest value of every key received less than ``ttl_ms`` before ``now_ms``."""
        return self._values.fresh(now_ms, ttl_ms)

    async def close(self) -> None:
        """Stop the receiving task and close the producer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._tasks.close()
        producer, self._producer = self._producer, None
        if producer is not None:
            await close_quietly(producer, f"the producer of {self._topic}")

    # -- internals --------------------------------------------------------------------------

    async def _send(self, key: str, value: bytes) -> None:
        if not key:
            raise InvalidInputError("a load value needs a non-empty key")
        producer = await self._get_producer()
        try:
            await producer.send(value, partition_key=key)
        except PULSAR_ERRORS as e:
            raise unavailable(f"publishing {key} to {self._topic}", e) from e

    async def _get_producer(self) -> Any:
        async with self._producer_lock:
            self._check_open()
            if self._producer is None:
                try:
                    self._producer = await self._connection.client.create_producer(
                        self._topic,
                        # Values are small and few; batching would only delay them.
                        batching_enabled=False,
                        send_timeout_millis=round(self._connection.operation_timeout_s * 1000),
                    )
                except PULSAR_ERRORS as e:
                    raise unavailable(f"creating a producer on {self._topic}", e) from e
            return self._producer

    async def _open_reader(self) -> Any:
        try:
            return await self._connection.client.create_reader(self._topic, pulsar.MessageId.latest)
        except PULSAR_ERRORS as e:
            raise unavailable(f"creating a reader on {self._topic}", e) from e

    async def _receive(self, reader: Any) -> None:
        """Apply every message to the table; replace the reader when it fails or disconnects."""
        delay = _RETRY_MIN_S
        try:
            while True:
                if reader is None:
                    try:
                        reader = await self._open_reader()
                    except UnavailableError as e:
                        _log.debug("%s", e)
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, _RETRY_MAX_S)
                        continue
                    _log.info("load store %s: receiving again", self._topic)
                    delay = _RETRY_MIN_S
                if not await self._receive_until_lost(reader):
                    await close_quietly(reader, f"a reader of {self._topic}")
                    reader = None
        finally:
            if reader is not None:
                await close_quietly(reader, f"a reader of {self._topic}")

    async def _receive_until_lost(self, reader: Any) -> bool:
        """Receive until the reader fails or is seen disconnected (False)."""
        read = asyncio.ensure_future(reader.read_next())
        try:
            while True:
                done, _ = await asyncio.wait((read,), timeout=_WATCH_INTERVAL_S)
                if done:
                    error = read.exception()
                    if isinstance(error, PULSAR_ERRORS):
                        _log.warning("load store %s: reading failed: %s", self._topic, error)
                        return False
                    if error is not None:
                        raise error
                    self._apply(read.result())
                    read = asyncio.ensure_future(reader.read_next())
                elif not reader.is_connected():
                    _log.warning("load store %s: reader lost its connection", self._topic)
                    return False
        finally:
            read.cancel()

    def _apply(self, message: Any) -> None:
        self._values.receive(message.partition_key(), message.data(), self._clock.now_ms())

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError(f"load store {self._topic} is closed")
