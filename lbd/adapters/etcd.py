"""etcd access shared by the etcd adapters: options, key layout, one connection with deadlines.

This module and its siblings ``etcd_session``, ``etcd_store`` and ``etcd_checkpoint`` are the only
ones in lbd that import ``aetcd``. Every request goes through :meth:`EtcdConnection.call`, which
puts a deadline on it and turns every client error into an lbd error: connection failures and
timeouts become :class:`~lbd.ports.errors.UnavailableError`, so no ``aetcd`` exception leaves the
adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.utils

from lbd.adapters.session import SessionPolicy
from lbd.config import Settings
from lbd.core.errors import InvalidInputError, LbdError
from lbd.ports.errors import UnavailableError

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EtcdOptions:
    """Where etcd is and how this sidecar's session behaves (from ``[etcd]`` and ``[cluster]``)."""

    endpoints: tuple[str, ...]
    """Client URLs (``http://host:port``); requests fail over to the next one."""
    prefix: str
    """Root of every key, e.g. ``/lbd/standalone`` (a trailing ``/`` is optional)."""
    session: SessionPolicy
    request_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise InvalidInputError("etcd endpoints: at least one URL is needed")
        for url in self.endpoints:
            parse_endpoint(url)
        if not self.prefix.startswith("/"):
            raise InvalidInputError(f"etcd prefix must start with '/', got {self.prefix!r}")
        if not self.request_timeout_s > 0:
            raise InvalidInputError(
                f"etcd request timeout must be > 0, got {self.request_timeout_s}"
            )

    @classmethod
    def from_settings(cls, settings: Settings) -> EtcdOptions:
        """The options of a loaded configuration."""
        etcd = settings.etcd
        return cls(
            endpoints=tuple(etcd.endpoints),
            prefix=settings.cluster.etcd_prefix,
            request_timeout_s=etcd.request_timeout_s,
            session=SessionPolicy(
                lease_ttl_s=etcd.lease_ttl_s,
                keepalive_interval_s=etcd.keepalive_interval_s,
                session_expired_policy=etcd.session_expired_policy,
                reconnect_retries=etcd.reconnect_retries,
            ),
        )


def parse_endpoint(url: str) -> tuple[str, int]:
    """``http://host:port`` as ``(host, port)``; InvalidInputError naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise InvalidInputError(
            f"etcd endpoint {url!r}: only http:// is supported (the etcd client has no TLS)"
        )
    try:
        port = parts.port
    except ValueError as e:
        raise InvalidInputError(f"etcd endpoint {url!r}: bad port ({e})") from e
    if not parts.hostname:
        raise InvalidInputError(f"etcd endpoint {url!r}: no host")
    return parts.hostname, port if port is not None else 2379


class EtcdKeys:
    """The key layout under the cluster prefix (DESIGN §3)."""

    def __init__(self, prefix: str) -> None:
        root = prefix.rstrip("/") + "/"
        self.root = root.encode()
        self.brokers = self.root + b"brokers/"
        self.leader = self.root + b"leader/"
        self.namespaces = self.root + b"namespaces/"
        self.checkpoint = self.root + b"checkpoint"
        self.checkpoint_chunks = self.root + b"checkpoints/"

    def broker(self, broker: str) -> bytes:
        """``brokers/<broker>``."""
        return self.brokers + broker.encode()

    def candidate(self, lease_id: int) -> bytes:
        """``leader/<lease id in hex>``: one candidacy per session lease (the etcd recipe)."""
        return self.leader + f"{lease_id:x}".encode()

    def namespace(self, namespace: str) -> bytes:
        """``namespaces/<tenant>/<ns>``."""
        return self.namespaces + namespace.encode()

    def chunk_dir(self, checkpoint_id: str) -> bytes:
        """``checkpoints/<id>/``: the chunks of one checkpoint body."""
        return self.checkpoint_chunks + checkpoint_id.encode() + b"/"


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One stored key with its revisions."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A put (``value`` set) or delete (``value`` None) seen by a watch, at ``revision``."""

    key: bytes
    value: bytes | None
    create_revision: int
    revision: int


class RevisionCompactedError(Exception):
    """The revision a watch or a read asked for is compacted (internal to the etcd adapters)."""


_REFUSALS = (
    aetcd.InvalidArgumentError,
    aetcd.exceptions.UnauthenticatedError,
    aetcd.PreconditionFailedError,
)


_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)
"""gRPC's reconnect backoff grows to two minutes by default: after a minute of etcd outage the
sidecar would come back up to tens of seconds after etcd did. Capped at half a second, it
reconnects within a keepalive interval of etcd's return (a few connection attempts per second
against one endpoint cost nothing)."""


class EtcdConnection:
    """A client of one endpoint at a time; every request has a deadline and mapped errors.

    When a request cannot reach the current endpoint, the next request goes to the next one
    (etcd members all serve the same data). ``on_unavailable`` is told of every such failure (the
    session turns it into an UNREACHABLE event).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        request_timeout_s: float,
        on_unavailable: Callable[[], None] | None = None,
    ) -> None:
        self._endpoints = [parse_endpoint(url) for url in endpoints]
        if not self._endpoints:
            raise InvalidInputError("etcd endpoints: at least one URL is needed")
        self._timeout = request_timeout_s
        self.on_unavailable = on_unavailable
        self._index = 0
        self._client = self._make_client()
        self._closed = False

    @classmethod
    def from_options(cls, options: EtcdOptions) -> EtcdConnection:
        """A connection to ``options.endpoints`` with its request timeout."""
        return cls(options.endpoints, options.request_timeout_s)

    @property
    def endpoint(self) -> str:
        """``host:port`` of the endpoint in use."""
        host, port = self._endpoints[self._index]
        return f"{host}:{port}"

    @property
    def request_timeout_s(self) -> float:
        """The deadline of one request."""
        return self._timeout

    def _make_client(self) -> aetcd.Client:
        host, port = self._endpoints[self._index]
        return aetcd.Client(host, port, timeout=self._timeout, options=dict(_CHANNEL_OPTIONS))

    async def call(self, op: Callable[[aetcd.Client], Awaitable[T]], what: str) -> T:
        """Run one request within the request timeout; errors become lbd errors."""
        if self._closed:
            raise UnavailableError(f"etcd {what}: the connection is closed")
        client = self._client
        try:
            async with asyncio.timeout(self._timeout):
                return await op(client)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise await self.translate(e, client, what) from e

    async def get(self, key: bytes) -> KeyValue | None:
        """One key, or None."""
        got = await self.call(lambda c: c.get(key), f"get {key.decode()}")
        return None if got is None else _key_value(got)

    async def put(self, key: bytes, value: bytes, lease_id: int | None = None) -> int:
        """Write one key (under a lease if given); the revision of the write."""
        put = await self.call(lambda c: c.put(key, value, lease=lease_id), f"put {key.decode()}")
        revision: int = put.header.revision
        return revision

    async def delete_prefix(self, prefix: bytes) -> None:
        """Delete every key under ``prefix``."""
        await self.call(lambda c: c.delete_prefix(prefix), f"delete {prefix.decode()}")

    async def list_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (sorted by key) and the revision it was read at."""
        got = await self.call(lambda c: c.get_prefix(prefix), f"list {prefix.decode()}")
        return [_key_value(kv) for kv in got], got.header.revision

    async def list_prefix_at(self, prefix: bytes, revision: int) -> list[KeyValue]:
        """Every key under ``prefix`` as it was at ``revision`` (RevisionCompactedError if gone).

        aetcd's range call has no revision argument, so this builds the request itself.
        """

        async def read(c: aetcd.Client) -> Any:
            await c.connect()
            request = aetcd.rpc.RangeRequest(
                key=prefix, range_end=aetcd.utils.prefix_range_end(prefix), revision=revision
            )
            return await c.kvstub.Range(request, timeout=self._timeout, metadata=c.metadata)

        got = await self.call(read, f"list {prefix.decode()} at revision {revision}")
        return [_key_value(kv) for kv in got.kvs]

    async def swap(
        self,
        key: bytes,
        value: bytes,
        expected_mod_revision: int,
        *,
        delete_prefix: bytes | None = None,
    ) -> tuple[bool, KeyValue | None]:
        """Compare-and-swap in one transaction: put ``value`` if ``key``'s mod revision is still
        ``expected_mod_revision`` (0: the key must not exist), and then delete every key under
        ``delete_prefix`` if given. Returns whether it was written and the key as it is after.
        """

        async def transact(c: aetcd.Client) -> Any:
            t = c.transactions
            success = [t.put(key, value), t.get(key)]
            if delete_prefix is not None:
                end = aetcd.utils.prefix_range_end(delete_prefix)
                success.insert(1, t.delete(delete_prefix, range_end=end))
            return await c.transaction(
                compare=[t.mod(key) == expected_mod_revision],
                success=success,
                failure=[t.get(key)],
            )

        succeeded, responses = await self.call(transact, f"compare-and-swap {key.decode()}")
        found = responses[-1]
        return bool(succeeded), _key_value(found[0][1]) if found else None

    async def watch(self, key: bytes, start_revision: int, *, prefix: bool) -> WatchStream:
        """Events of ``key`` (or of every key under it) from ``start_revision`` on.

        Creating the watch is one request (it may raise UnavailableError). The stream ends when
        cancelled, or when the connection is closed or moves to another endpoint; it raises
        UnavailableError when it breaks and RevisionCompactedError when ``start_revision`` is
        compacted.
        """
        range_end = aetcd.utils.prefix_range_end(key) if prefix else None
        client = self._client
        watch = await self.call(
            lambda c: c.watch(key, range_end=range_end, start_revision=start_revision),
            f"watch {key.decode()}",
        )
        return WatchStream(self, client, watch, key)

    async def translate(self, error: Exception, client: aetcd.Client, what: str) -> Exception:
        """The lbd error for a client error of a request on ``client`` (and fail over if due)."""
        if isinstance(error, aetcd.RevisionCompactedError):
            return RevisionCompactedError(str(error))
        if (
            isinstance(error, aetcd.rpc.AioRpcError)
            and error.code() == aetcd.rpc.StatusCode.OUT_OF_RANGE
        ) or (isinstance(error, aetcd.ClientError) and "compacted" in str(error)):
            return RevisionCompactedError(str(error))
        if isinstance(error, _REFUSALS):
            return LbdError(f"etcd at {self.endpoint} refused {what}: {error}")
        detail = str(error) or type(error).__name__
        if isinstance(error, TimeoutError):
            detail = f"no answer within {self._timeout:g}s"
        failed = UnavailableError(f"etcd at {self.endpoint} unavailable ({what}): {detail}")
        if self.on_unavailable is not None:
            self.on_unavailable()
        await self._fail_over(client)
        return failed

    async def _fail_over(self, failed: aetcd.Client) -> None:
        # Only the first failure of a client moves on; requests that were in flight on it fail too.
        if len(self._endpoints) == 1 or failed is not self._client or self._closed:
            return
        self._index = (self._index + 1) % len(self._endpoints)
        self._client = self._make_client()
        log.warning("etcd: switching to endpoint %s", self.endpoint)
        await _close_quietly(failed, self._timeout)

    async def close(self) -> None:
        """Close the client (its watches end). Idempotent."""
        if self._closed:
            return
        self._closed = True
        await _close_quietly(self._client, self._timeout)


class WatchStream:
    """One etcd watch as an async iterator of :class:`WatchEvent`; :meth:`cancel` ends it."""

    def __init__(self, conn: EtcdConnection, client: aetcd.Client, watch: Any, key: bytes) -> None:
        self._conn = conn
        self._client = client
        self._watch = watch
        self._key = key
        self._cancelled = False

    async def __aiter__(self) -> AsyncIterator[WatchEvent]:
        events = aiter(self._watch)
        try:
            while True:
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    what = f"watch {self._key.decode()}"
                    raise await self._conn.translate(e, self._client, what) from e
                kv = event.kv
                deleted = event.kind == aetcd.EventKind.DELETE
                yield WatchEvent(
                    key=kv.key,
                    value=None if deleted else kv.value,
                    create_revision=kv.create_revision,
                    revision=kv.mod_revision,
                )
        finally:
            await self.cancel()

    async def cancel(self) -> None:
        """Stop the watch; a pending iteration ends. Idempotent."""
        if self._cancelled:
            return
        self._cancelled = True
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._conn.request_timeout_s):
                await self._watch.cancel()


async def _close_quietly(client: aetcd.Client, timeout_s: float) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout_s):
            await client.close()


def _key_value(kv: Any) -> KeyValue:
    return KeyValue(
        key=kv.key,
        value=kv.value,
        create_revision=kv.create_revision,
        mod_revision=kv.mod_revision,
    )
