"""The Pulsar client shared by a sidecar's channel and load stores, and Pulsar error mapping.

Together with :mod:`lbd.adapters.pulsar_channel` and :mod:`lbd.adapters.pulsar_load`, this is the
only place that imports the ``pulsar`` client. Client failures become
:class:`~lbd.ports.errors.UnavailableError` here, so no Pulsar exception reaches the services.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

import pulsar
import pulsar.asyncio

from lbd.config.schema import PulsarSettings
from lbd.core.errors import InvalidInputError
from lbd.core.table import ChannelPosition
from lbd.ports.errors import UnavailableError

PULSAR_ERRORS: Final = (pulsar.asyncio.PulsarException, pulsar.PulsarException)
"""What the client raises when an operation fails (asyncio calls, and synchronous checks)."""

_PARTITION_NONE: Final = -1
"""Partition index of a message id on a non-partitioned topic."""
_CLOSE_TIMEOUT_S: Final = 2.0


def unavailable(action: str, error: BaseException) -> UnavailableError:
    """The :class:`UnavailableError` for a failed ``action`` (e.g. "publishing to TOPIC")."""
    return UnavailableError(f"Pulsar unavailable while {action}: {error}")


def is_unknown_error(error: BaseException) -> bool:
    """Whether ``error`` is Pulsar's ``UnknownError`` (pulsar-lite's answer on an empty topic)."""
    return (
        isinstance(error, pulsar.asyncio.PulsarException)
        and error.error() == pulsar.Result.UnknownError
    )


def to_position(message_id: Any) -> ChannelPosition:
    """The channel position of a Pulsar ``MessageId``."""
    return ChannelPosition(message_id.ledger_id(), message_id.entry_id(), message_id.batch_index())


def start_id(after: ChannelPosition | None) -> Any:
    """The ``MessageId`` a reader starts from to read what comes strictly after ``after``."""
    if after is None:
        return pulsar.MessageId.earliest
    return pulsar.MessageId(_PARTITION_NONE, after.ledger_id, after.entry_id, after.batch_index)


class PulsarConnection:
    """One Pulsar client; build the channel and the load stores on it, close it last.

    The client connects lazily and reconnects by itself, so making one never fails for an
    unreachable cluster; operations on it fail with :class:`UnavailableError` after
    ``operation_timeout_s``.
    """

    def __init__(self, service_url: str, *, operation_timeout_s: float = 30.0) -> None:
        if operation_timeout_s <= 0:
            raise InvalidInputError(
                f"Pulsar operation timeout must be > 0 seconds, got {operation_timeout_s}"
            )
        self._operation_timeout_s = operation_timeout_s
        timeout_ms = max(1, round(operation_timeout_s * 1000))
        try:
            self._client = pulsar.asyncio.Client(
                service_url,
                # The client takes whole seconds; rounding up keeps sub-second settings meaningful.
                operation_timeout_seconds=max(1, -(-timeout_ms // 1000)),
                connection_timeout_ms=timeout_ms,
                logger=logging.getLogger("pulsar"),
            )
        except (*PULSAR_ERRORS, ValueError) as e:
            raise InvalidInputError(f"cannot make a Pulsar client for {service_url!r}: {e}") from e
        self._service_url = service_url
        self._closed = False

    @classmethod
    def from_settings(cls, settings: PulsarSettings) -> PulsarConnection:
        """A connection as the ``[pulsar]`` settings say."""
        return cls(settings.service_url, operation_timeout_s=settings.operation_timeout_s)

    @property
    def service_url(self) -> str:
        """The cluster's service URL."""
        return self._service_url

    @property
    def operation_timeout_s(self) -> float:
        """Deadline of one client operation (producer and reader creation, send)."""
        return self._operation_timeout_s

    @property
    def client(self) -> Any:
        """The ``pulsar.asyncio.Client`` (for the Pulsar adapters only)."""
        if self._closed:
            raise UnavailableError(f"the Pulsar client of {self._service_url} is closed")
        return self._client

    async def close(self) -> None:
        """Close the client and whatever producers and readers are still open on it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._client.close()
        except PULSAR_ERRORS as e:
            logging.getLogger(__name__).warning(
                "closing the Pulsar client of %s: %s", self._service_url, e
            )


async def close_quietly(closeable: Any, what: str) -> None:
    """Close a producer or reader within a bound (closing needs the broker, which may be gone).

    A failure is logged, not raised: whoever closes is done with the object either way.
    """
    try:
        await asyncio.wait_for(closeable.close(), _CLOSE_TIMEOUT_S)
    except (*PULSAR_ERRORS, TimeoutError) as e:
        logging.getLogger(__name__).debug("closing %s: %s", what, e)
