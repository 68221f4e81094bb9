"""etcd access shared by the etcd adapters: options, key layout, one connection with deadlines.

This module and its siblings ``etcd_session``, ``etcd_store`` and ``etcd_checkpoint`` are the only
ones in lbd that import ``aetcd``. Every request goes through :meth:`EtcdConnection.call`, which
puts a deadline on it and turns every client error into an lbd error: connection failures and
timeouts become :class:`~lbd.ports.errors.UnavailableError`, so no ``aetcd`` exception leaves the
adapter.

aetcd 1.0 opens only plaintext channels: :class:`_Client` is aetcd's client over a TLS channel when
the endpoints are ``https://``, authenticating with the configured user when there is one (and
tolerating an etcd whose authentication is off, as etcd's own client does). aetcd never
re-authenticates, while etcd forgets simple tokens when it restarts and expires JWT ones: a request
refused for its token gets a new client (hence a new token) and is sent once more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.utils
import aetcd.watcher
import grpc

from lbd.adapters.session import SessionPolicy
from lbd.config import Settings
from lbd.core.errors import InvalidInputError, LbdError
from lbd.ports.errors import UnavailableError

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EtcdSecurity:
    """TLS files and credentials of the etcd client (``[etcd]``); each is optional.

    The files are read each time a client is made (at start, at a fail-over, after a TLS failure),
    so renewed certificates are picked up without a restart.
    """

    ca_file: str | None = None
    """PEM CA bundle for etcd's certificate; None: the system trust roots."""
    cert_file: str | None = None
    """PEM client certificate (with ``key_file``)."""
    key_file: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise InvalidInputError("etcd cert_file and key_file go together: set both or neither")
        if (self.username is None) != (self.password is None):
            raise InvalidInputError("etcd username and password go together: set both or neither")

    @property
    def has_tls_files(self) -> bool:
        """Whether a CA or a client certificate is configured (they need https:// endpoints)."""
        return self.ca_file is not None or self.cert_file is not None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS credentials from the files as they are now (OSError if one cannot be read)."""
        root = _read(self.ca_file) if self.ca_file is not None else _system_roots()
        key = _read(self.key_file) if self.key_file is not None else None
        chain = _read(self.cert_file) if self.cert_file is not None else None
        return grpc.ssl_channel_credentials(root, key, chain)


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def _system_roots() -> bytes | None:
    """OpenSSL's default CA file (env SSL_CERT_FILE overrides it), as etcd's Go client would use.

    gRPC ignores the system's trust store and uses the bundle it ships; None falls back to that.
    """
    cafile = ssl.get_default_verify_paths().cafile
    return _read(cafile) if cafile is not None else None


@dataclass(frozen=True, slots=True)
class EtcdOptions:
    """Where etcd is and how this sidecar's session behaves (from ``[etcd]`` and ``[cluster]``)."""

    endpoints: tuple[str, ...]
    """Client URLs (all ``http://host:port`` or all ``https://``); requests fail over to the next
    one."""
    prefix: str
    """Root of every key, e.g. ``/lbd/standalone`` (a trailing ``/`` is optional)."""
    session: SessionPolicy
    request_timeout_s: float = 5.0
    security: EtcdSecurity = field(default_factory=EtcdSecurity)

    def __post_init__(self) -> None:
        uses_tls(self.endpoints, self.security)
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
            security=EtcdSecurity(
                ca_file=etcd.ca_file,
                cert_file=etcd.cert_file,
                key_file=etcd.key_file,
                username=etcd.username,
                password=None if etcd.password is None else etcd.password.get_secret_value(),
            ),
            session=SessionPolicy(
                lease_ttl_s=etcd.lease_ttl_s,
                keepalive_interval_s=etcd.keepalive_interval_s,
                session_expired_policy=etcd.session_expired_policy,
                reconnect_retries=etcd.reconnect_retries,
            ),
        )


def parse_endpoint(url: str) -> tuple[str, int]:
    """``http(s)://host:port`` as ``(host, port)``; InvalidInputError naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise InvalidInputError(f"etcd endpoint {url!r}: must start with http:// or https://")
    try:
        port = parts.port
    except ValueError as e:
        raise InvalidInputError(f"etcd endpoint {url!r}: bad port ({e})") from e
    if not parts.hostname:
        raise InvalidInputError(f"etcd endpoint {url!r}: no host")
    return parts.hostname, port if port is not None else 2379


def uses_tls(endpoints: Sequence[str], security: EtcdSecurity) -> bool:
    """Whether ``endpoints`` are ``https://``; InvalidInputError if they are unusable as a set or
    with ``security`` (none, a bad URL, http and https mixed, TLS files for http)."""
    if not endpoints:
        raise InvalidInputError("etcd endpoints: at least one URL is needed")
    for url in endpoints:
        parse_endpoint(url)
    schemes = {urlsplit(url).scheme for url in endpoints}
    if len(schemes) > 1:
        raise InvalidInputError(
            f"etcd endpoints {list(endpoints)}: must not mix http:// and https://"
        )
    tls = schemes == {"https"}
    if security.has_tls_files and not tls:
        raise InvalidInputError(
            "etcd ca_file and cert_file need https:// endpoints: "
            "TLS settings have no effect on a plaintext connection"
        )
    return tls


class EtcdKeys:
    """The key layout under the cluster prefix (DESIGN §3)."""

    def __init__(self, prefix: str) -> None:
        root = prefix.rstrip("/") + "/"
        self.root = root.encode()
        self.brokers = self.root + b"brokers/"
        self.leader = self.root + b"leader/"
        self.namespaces = self.root + b"namespaces/"
        self.maintenance = self.root + b"maintenance/"
        self.checkpoint = self.root + b"checkpoint"
        self.checkpoint_chunks = self.root + b"checkpoints/"

    def broker(self, broker: str) -> bytes:
        """``brokers/<broker>``."""
        return self.brokers + broker.encode()

    def maintenance_of(self, broker: str) -> bytes:
        """``maintenance/<broker>``: the broker's maintenance record (no lease)."""
        return self.maintenance + broker.encode()

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


class _Client(aetcd.Client):  # type: ignore[misc]  # aetcd is untyped
    """aetcd's client over a TLS channel when given ``credentials``.

    :meth:`connect` is aetcd 1.0's with three changes: the channel may be a secure one; an etcd
    whose authentication is off is used without a token (etcd's Go client does the same, so
    credentials can be configured before ``auth enable``); and the channel is closed when
    connecting fails (aetcd leaks it, and would open another at the next request).
    """

    _is_connecting: bool  # aetcd's own state, typed here

    def __init__(
        self,
        host: str,
        port: int,
        *,
        credentials: grpc.ChannelCredentials | None,
        username: str | None,
        password: str | None,
        timeout: float,
        options: dict[str, Any],
    ) -> None:
        super().__init__(
            host, port, username=username, password=password, timeout=timeout, options=options
        )
        self._credentials = credentials

    async def connect(self) -> None:
        """Open the channel and authenticate (aetcd's ``connect``; raises grpc errors)."""
        if self._connected.is_set():
            return
        if self._is_connecting:
            # Another request is connecting: wait for it, as aetcd does.
            async with asyncio.timeout(self._connect_wait_timeout):
                await self._connected.wait()
            return
        self._is_connecting = True
        target = f"{self._host}:{self._port}"
        options = list(self._options.items())
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(target, options=options)
        else:
            channel = grpc.aio.secure_channel(target, self._credentials, options=options)
        try:
            metadata = await self._authenticate(channel)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(channel.close())
            raise
        finally:
            self._is_connecting = False
        self.channel = channel
        self.metadata = metadata
        self.kvstub = aetcd.rpc.KVStub(channel)
        self.clusterstub = aetcd.rpc.ClusterStub(channel)
        self.leasestub = aetcd.rpc.LeaseStub(channel)
        self.maintenancestub = aetcd.rpc.MaintenanceStub(channel)
        self._watcher = _Watcher(
            aetcd.rpc.WatchStub(channel), timeout=self._timeout, metadata=metadata
        )
        self._connected.set()

    async def _authenticate(self, channel: grpc.aio.Channel) -> tuple[tuple[str, str], ...] | None:
        """The token metadata of the configured user; None without one or with auth off."""
        if self._username is None:
            return None
        self.auth_stub = aetcd.rpc.AuthStub(channel)
        request = aetcd.rpc.AuthenticateRequest(name=self._username, password=self._password)
        try:
            reply = await self.auth_stub.Authenticate(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION and _AUTH_OFF in (e.details() or ""):
                log.warning(
                    "etcd at %s:%s has authentication off: etcd.username is not used",
                    self._host,
                    self._port,
                )
                return None
            raise
        return (("token", reply.token),)


_AUTH_OFF = "authentication is not enabled"
_TOKEN_REFUSED = ("invalid auth token", "revision of auth store is old", "user name is empty")
"""Details of etcd errors that a fresh token cures: the token expired (JWT) or is unknown (simple
tokens live in memory, an etcd restart forgets them), or the user's roles changed since it was
issued. etcd's Go client re-authenticates on these three (``shouldRefreshToken``)."""
_WATCH_REFUSED = "watch refused"
"""How :class:`_Watcher` reports a refused watch. etcd 3.4 refuses a watch with a stale token as
"permission denied", so a refused watch also gets a new token and one more try."""
_AUTH_FAILED = "authentication failed"
_PERMISSION_DENIED = ("permission denied", "user name is empty", "user name not found")
"""Refusals for want of credentials or rights. Without a username, etcd takes the client
certificate's common name as the user (with --client-cert-auth), or none at all."""


def _rpc_status(error: BaseException) -> tuple[grpc.StatusCode | None, str]:
    """The gRPC code and details behind an error (aetcd wraps them: the cause holds them)."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, grpc.aio.AioRpcError):
            return cause.code(), cause.details() or ""
        cause = cause.__cause__
    return None, str(error)


_OPENSSL_REASON = re.compile(r"OPENSSL_internal:([A-Z0-9_]+(?:: [^:]+)?)")


def _tls_hint(details: str, tls: bool) -> str | None:
    """What a connection failure likely means when TLS is at fault; None when nothing says so."""
    ssl_reason = _OPENSSL_REASON.search(details)
    why = f" ({ssl_reason.group(1)})" if ssl_reason else ""
    if not tls:
        # Closed while connecting (not refused, not mid-request): what a TLS port does to a
        # plaintext client.
        closed = "Socket closed" in details or "Connection reset" in details
        if closed and "failed to connect" in details:
            return (
                "etcd closed the connection while it was being set up: if etcd serves TLS, use "
                "https:// endpoints (and etcd.ca_file)"
            )
        return None
    if "Handshake read failed" in details or "WRONG_VERSION_NUMBER" in details:
        return (
            f"TLS handshake failed{why}: etcd does not seem to speak TLS there "
            "(a plaintext etcd needs http:// endpoints)"
        )
    if "Peer name" in details:
        return (
            "TLS handshake failed: etcd's certificate does not name the endpoint's host "
            "(use a host name the certificate has)"
        )
    if "Tls handshake failed" in details:
        if any(m in details for m in ("CERTIFICATE_VERIFY_FAILED", "BAD_SIGNATURE", "issuer")):
            return (
                f"TLS handshake failed{why}: etcd's certificate is not trusted (check etcd.ca_file)"
            )
        return f"TLS handshake failed{why} (check etcd.ca_file, etcd.cert_file and etcd.key_file)"
    if any(m in details for m in ("TSI_DATA_CORRUPTED", "CERTIFICATE_REQUIRED", "BAD_CERTIFICATE")):
        return (
            "etcd closed the TLS connection after the handshake, most likely refusing the client "
            "certificate: etcd requires one signed by a CA it trusts (check etcd.cert_file and "
            "etcd.key_file)"
        )
    return None


class _Watcher(aetcd.watcher.Watcher):  # type: ignore[misc]  # aetcd is untyped
    """aetcd's watcher, failing a watch that etcd refuses instead of leaving it silent.

    etcd answers a refused watch create (no permission, or a stale token) with ``created`` and
    ``canceled`` both set; aetcd 1.0 reads only ``created`` and would register a watch that never
    delivers an event.
    """

    async def _handle_response(self, response: Any) -> None:
        if response.created and response.canceled and not response.compact_revision:
            async with self._lock:
                if self._new_callback is not None:
                    reason = response.cancel_reason or "no reason given"
                    self._new_callback.error = aetcd.ClientError(f"{_WATCH_REFUSED}: {reason}")
                    self._new_callback_ready.notify_all()
            return
        await super()._handle_response(response)


class EtcdConnection:
    """A client of one endpoint at a time; every request has a deadline and mapped errors.

    When a request cannot reach the current endpoint, the next request goes to the next one
    (etcd members all serve the same data). ``on_unavailable`` is told of every such failure (the
    session turns it into an UNREACHABLE event). With ``https://`` endpoints the client speaks TLS,
    and with a username it authenticates (see the module docstring for token renewal).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        request_timeout_s: float,
        on_unavailable: Callable[[], None] | None = None,
        *,
        security: EtcdSecurity | None = None,
    ) -> None:
        self._security = security if security is not None else EtcdSecurity()
        self._tls = uses_tls(endpoints, self._security)
        self._urls = list(endpoints)
        self._endpoints = [parse_endpoint(url) for url in endpoints]
        self._timeout = request_timeout_s
        self.on_unavailable = on_unavailable
        self._index = 0
        self._client = self._make_client()
        self._closed = False

    @classmethod
    def from_options(cls, options: EtcdOptions) -> EtcdConnection:
        """A connection to ``options.endpoints`` with its request timeout and security."""
        return cls(options.endpoints, options.request_timeout_s, security=options.security)

    @property
    def endpoint(self) -> str:
        """``host:port`` of the endpoint in use."""
        host, port = self._endpoints[self._index]
        return f"{host}:{port}"

    @property
    def url(self) -> str:
        """The URL of the endpoint in use, as configured."""
        return self._urls[self._index]

    @property
    def request_timeout_s(self) -> float:
        """The deadline of one request."""
        return self._timeout

    def _make_client(self) -> aetcd.Client:
        host, port = self._endpoints[self._index]
        credentials = None
        if self._tls:
            try:
                credentials = self._security.channel_credentials()
            except OSError as e:
                # The files were there at load; a broken renewal must not crash the sidecar.
                log.error("etcd: cannot read the TLS files (%s); using the defaults", e)
                credentials = grpc.ssl_channel_credentials()
        return _Client(
            host,
            port,
            credentials=credentials,
            username=self._security.username,
            password=self._security.password,
            timeout=self._timeout,
            options=dict(_CHANNEL_OPTIONS),
        )

    async def call(self, op: Callable[[aetcd.Client], Awaitable[T]], what: str) -> T:
        """Run one request within the request timeout; errors become lbd errors.

        A request refused for its auth token is sent once more on a new client (a new token).
        """
        if self._closed:
            raise UnavailableError(f"etcd {what}: the connection is closed")
        client = self._client
        try:
            async with asyncio.timeout(self._timeout):
                try:
                    return await op(client)
                except asyncio.CancelledError:
                    if not self._closed_under(client):
                        raise
                except Exception as e:
                    if not self._token_refused(e):
                        raise
                    await self._renew_client(client)
                if self._closed:
                    raise UnavailableError(f"etcd {what}: the connection is closed")
                client = self._client
                return await op(client)
        except asyncio.CancelledError:
            raise
        except UnavailableError:
            raise
        except Exception as e:
            raise await self.translate(e, client, what) from e

    def _closed_under(self, client: aetcd.Client) -> bool:
        """Whether a CancelledError of a request on ``client`` came from closing it (a fail-over
        or a new token, while the request was in flight) rather than from cancelling the task:
        gRPC cancels the calls of a channel it closes."""
        task = asyncio.current_task()
        replaced = client is not self._client or self._closed
        return replaced and task is not None and not task.cancelling()

    def _token_refused(self, error: Exception) -> bool:
        if self._security.username is None:
            return False
        _, details = _rpc_status(error)
        return any(reason in details for reason in (*_TOKEN_REFUSED, _WATCH_REFUSED))

    async def _renew_client(self, failed: aetcd.Client) -> aetcd.Client:
        """A new client of the same endpoint in place of ``failed`` (once, however many ask)."""
        if failed is self._client and not self._closed:
            log.info("etcd at %s refused the auth token: authenticating again", self.url)
            self._client = self._make_client()
            await _close_quietly(failed, self._timeout)
        return self._client

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
        """The lbd error for a client error of a request on ``client`` (and fail over if due).

        Refused credentials and permissions become InvalidInputError (the configuration must
        change); a failed TLS handshake is an UnavailableError that says which file to check, and
        makes a new client, which reads the files again.
        """
        if isinstance(error, aetcd.RevisionCompactedError):
            return RevisionCompactedError(str(error))
        if (
            isinstance(error, aetcd.rpc.AioRpcError)
            and error.code() == aetcd.rpc.StatusCode.OUT_OF_RANGE
        ) or (isinstance(error, aetcd.ClientError) and "compacted" in str(error)):
            return RevisionCompactedError(str(error))
        code, details = _rpc_status(error)
        refusal = self._explain_refusal(code, details, what)
        if refusal is not None:
            return InvalidInputError(f"etcd at {self.url} refused {refusal}")
        if isinstance(error, _REFUSALS):
            return LbdError(f"etcd at {self.url} refused {what}: {error}")
        detail = str(error) or type(error).__name__
        if isinstance(error, TimeoutError):
            detail = f"no answer within {self._timeout:g}s"
        hint = _tls_hint(details, self._tls)
        failed = UnavailableError(f"etcd at {self.url} unavailable ({what}): {hint or detail}")
        if self.on_unavailable is not None:
            self.on_unavailable()
        await self._fail_over(client, renew=self._tls and hint is not None)
        return failed

    def _explain_refusal(self, code: grpc.StatusCode | None, details: str, what: str) -> str | None:
        """What etcd refused and what to check, if it refused the credentials or a permission."""
        reason = details.removeprefix(_WATCH_REFUSED + ": ").removeprefix("etcdserver: ")
        user = self._security.username
        if _AUTH_FAILED in details:
            return f"the credentials of user {user!r}: {reason} (check etcd.username/etcd.password)"
        denied = code == grpc.StatusCode.PERMISSION_DENIED or any(
            d in details for d in _PERMISSION_DENIED
        )
        if denied and user is None:
            return (
                f"{what}: {reason} (etcd has authentication on: set etcd.username and "
                "etcd.password)"
            )
        if denied:
            return (
                f"{what}: {reason} (user {user!r} needs a role granting read and write on the "
                "prefix; check etcd.username)"
            )
        if user is not None and any(r in details for r in _TOKEN_REFUSED):
            return f"{what}: {reason}, even with a new token (check etcd.username/etcd.password)"
        return None

    async def _fail_over(self, failed: aetcd.Client, *, renew: bool = False) -> None:
        """Move to the next endpoint; with one endpoint, ``renew`` makes a new client of it."""
        # Only the first failure of a client moves on; requests in flight on it are sent again.
        if failed is not self._client or self._closed:
            return
        if len(self._endpoints) > 1:
            self._index = (self._index + 1) % len(self._endpoints)
            log.warning("etcd: switching to endpoint %s", self.endpoint)
        elif renew:
            log.warning(
                "etcd: connecting to %s again, with the TLS files as they are now", self.url
            )
        else:
            return
        self._client = self._make_client()
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
