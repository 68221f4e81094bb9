"""The Pulsar client shared by a sidecar's channel and load stores, and Pulsar error mapping.

Together with :mod:`lbd.adapters.pulsar_channel` and :mod:`lbd.adapters.pulsar_load`, this is the
only place that imports the ``pulsar`` client. Client failures become
:class:`~lbd.ports.errors.UnavailableError` here, so no Pulsar exception reaches the services.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

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
_TLS_SCHEMES: Final = ("pulsar+ssl", "https")

log = logging.getLogger(__name__)


def native_logger() -> pulsar.ConsoleLogger:
    """The client's own logger, at the level the ``pulsar`` Python logger is set to.

    The client is never given a Python logger: its C++ threads would call into Python to log, and
    that intermittently aborts the process when clients are made and closed
    (apache/pulsar-client-python#256). The native logger writes to the process's output itself.
    """
    level = logging.getLogger("pulsar").getEffectiveLevel()
    if level <= logging.DEBUG:
        native = pulsar.LoggerLevel.Debug
    elif level <= logging.INFO:
        native = pulsar.LoggerLevel.Info
    elif level <= logging.WARNING:
        native = pulsar.LoggerLevel.Warn
    else:
        native = pulsar.LoggerLevel.Error
    return pulsar.ConsoleLogger(native)


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


def start_id(after: ChannelPosition | None) -> tuple[Any, bool]:
    """The ``MessageId`` a reader starts from to read what comes after ``after``, and whether
    it reads that message itself again (``start_message_id_inclusive``).

    A position inside one of lbd's batches (``batch_index`` 0 or more) names an entry of a
    message that also holds later entries: that message is read again, and the reader's caller
    drops what it already delivered.
    """
    if after is None:
        return pulsar.MessageId.earliest, False
    inclusive = after.batch_index >= 0
    batch_index = -1 if inclusive else after.batch_index
    message_id = pulsar.MessageId(_PARTITION_NONE, after.ledger_id, after.entry_id, batch_index)
    return message_id, inclusive


@dataclass(frozen=True, slots=True)
class PulsarSecurity:
    """How the client protects and authenticates its connections (``[pulsar]`` tls_*, auth_*).

    The default is plaintext without authentication, as against a local pulsar-lite. At most one
    authentication: a TLS client certificate (cert and key), a token, or a token file.
    """

    tls_trust_certs_file: str | None = None
    """CA bundle the brokers' certificates must chain to; None: the system's bundle."""
    tls_cert_file: str | None = None
    """Client certificate for Pulsar's TLS authentication (with ``tls_key_file``)."""
    tls_key_file: str | None = None
    tls_validate_hostname: bool = True
    tls_allow_insecure_connection: bool = False
    auth_token: str | None = field(default=None, repr=False)
    auth_token_file: str | None = None
    """Read on every new connection (:class:`TokenFile`)."""

    def __post_init__(self) -> None:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise InvalidInputError("Pulsar TLS client certificate and key go together")
        methods = [self.tls_cert_file, self.auth_token, self.auth_token_file]
        if sum(m is not None for m in methods) > 1:
            raise InvalidInputError(
                "Pulsar takes one authentication: a TLS client certificate, a token or a token file"
            )

    @classmethod
    def from_settings(cls, settings: PulsarSettings) -> PulsarSecurity:
        """The security of the ``[pulsar]`` settings."""
        token = settings.auth_token
        return cls(
            tls_trust_certs_file=settings.tls_trust_certs_file,
            tls_cert_file=settings.tls_cert_file,
            tls_key_file=settings.tls_key_file,
            tls_validate_hostname=settings.tls_validate_hostname,
            tls_allow_insecure_connection=settings.tls_allow_insecure_connection,
            auth_token=token.get_secret_value() if token is not None else None,
            auth_token_file=settings.auth_token_file,
        )

    @property
    def has_tls_options(self) -> bool:
        """Whether anything here needs a TLS connection."""
        return (
            self.tls_trust_certs_file is not None
            or self.tls_cert_file is not None
            or not self.tls_validate_hostname
            or self.tls_allow_insecure_connection
        )

    def describe(self, service_url: str) -> str:
        """One line for the log: TLS and authentication, never the token."""
        if not is_tls_url(service_url):
            transport = "plaintext"
        elif self.tls_allow_insecure_connection:
            transport = "TLS accepting any broker certificate (insecure)"
        else:
            trust = self.tls_trust_certs_file or "the system CA bundle"
            check = "checked" if self.tls_validate_hostname else "not checked"
            transport = f"TLS trusting {trust}, broker host name {check}"
        if self.tls_cert_file is not None:
            auth = f"TLS client certificate {self.tls_cert_file}"
        elif self.auth_token_file is not None:
            auth = f"token read from {self.auth_token_file}"
        elif self.auth_token is not None:
            auth = "token from the settings"
        else:
            auth = "no authentication"
        return f"{transport}; {auth}"


class TokenFile:
    """A token supplier for ``pulsar.AuthenticationToken``: the file's content, stripped.

    The client calls it each time it opens a connection, so a rotated token is picked up on the
    next reconnection. It runs on a client thread where an exception would not reach lbd, so a
    file that cannot be read then yields the last token read (and a warning); only the first
    read, when the client is made, fails.
    """

    def __init__(self, path: str) -> None:
        self._path = Path(path)
        self._token = self._read()

    def _read(self) -> str:
        try:
            token = self._path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeError) as e:
            raise InvalidInputError(f"Pulsar token file {self._path}: cannot read: {e}") from e
        if not token:
            raise InvalidInputError(f"Pulsar token file {self._path}: empty")
        return token

    def __call__(self) -> str:
        try:
            self._token = self._read()
        except InvalidInputError as e:
            log.warning("%s; presenting the token read before", e)
        return self._token


def is_tls_url(service_url: str) -> bool:
    """Whether ``service_url`` connects with TLS (``pulsar+ssl://`` or ``https://``)."""
    return urlsplit(service_url).scheme in _TLS_SCHEMES


def system_trust_file() -> str | None:
    """The system's CA bundle as OpenSSL finds it (env ``SSL_CERT_FILE`` first), if any."""
    return ssl.get_default_verify_paths().cafile


def client_kwargs(
    service_url: str, security: PulsarSecurity, *, system_trust: str | None
) -> dict[str, Any]:
    """The TLS and authentication keyword arguments of ``pulsar.Client`` for ``service_url``.

    None for a plaintext URL without security, so that a plain ``pulsar://`` client is made
    exactly as before. Without a trust file of its own, a TLS client trusts ``system_trust``
    (the Pulsar client alone would use its certifi bundle, not the system's). Reads no file but
    a token file (:class:`TokenFile`).
    """
    kwargs: dict[str, Any] = {}
    if is_tls_url(service_url):
        trust = security.tls_trust_certs_file or system_trust
        if trust is not None:
            kwargs["tls_trust_certs_file_path"] = trust
        kwargs["tls_validate_hostname"] = security.tls_validate_hostname
        kwargs["tls_allow_insecure_connection"] = security.tls_allow_insecure_connection
    elif security.has_tls_options:
        raise InvalidInputError(
            f"Pulsar TLS options need a pulsar+ssl:// or https:// service URL, not {service_url!r}"
        )
    if security.tls_cert_file is not None and security.tls_key_file is not None:
        kwargs["authentication"] = pulsar.AuthenticationTLS(
            security.tls_cert_file, security.tls_key_file
        )
    elif security.auth_token_file is not None:
        kwargs["authentication"] = pulsar.AuthenticationToken(TokenFile(security.auth_token_file))
    elif security.auth_token is not None:
        kwargs["authentication"] = pulsar.AuthenticationToken(security.auth_token)
    return kwargs


class PulsarConnection:
    """One Pulsar client; build the channel and the load stores on it, close it last.

    The client connects lazily and reconnects by itself, so making one never fails for an
    unreachable cluster; operations on it fail with :class:`UnavailableError` after
    ``operation_timeout_s``.
    """

    def __init__(
        self,
        service_url: str,
        *,
        operation_timeout_s: float = 30.0,
        security: PulsarSecurity | None = None,
    ) -> None:
        if operation_timeout_s <= 0:
            raise InvalidInputError(
                f"Pulsar operation timeout must be > 0 seconds, got {operation_timeout_s}"
            )
        self._operation_timeout_s = operation_timeout_s
        security = security or PulsarSecurity()
        secured = client_kwargs(service_url, security, system_trust=system_trust_file())
        timeout_ms = max(1, round(operation_timeout_s * 1000))
        try:
            self._client = pulsar.asyncio.Client(
                service_url,
                # The client takes whole seconds; rounding up keeps sub-second settings meaningful.
                operation_timeout_seconds=max(1, -(-timeout_ms // 1000)),
                connection_timeout_ms=timeout_ms,
                logger=native_logger(),
                **secured,
            )
        except (*PULSAR_ERRORS, ValueError) as e:
            raise InvalidInputError(f"cannot make a Pulsar client for {service_url!r}: {e}") from e
        self._service_url = service_url
        self._closed = False
        if secured:
            log.info("Pulsar client for %s: %s", service_url, security.describe(service_url))

    @classmethod
    def from_settings(cls, settings: PulsarSettings) -> PulsarConnection:
        """A connection as the ``[pulsar]`` settings say."""
        return cls(
            settings.service_url,
            operation_timeout_s=settings.operation_timeout_s,
            security=PulsarSecurity.from_settings(settings),
        )

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
            log.warning("closing the Pulsar client of %s: %s", self._service_url, e)


async def close_quietly(closeable: Any, what: str) -> None:
    """Close a producer or reader within a bound (closing needs the broker, which may be gone).

    A failure is logged, not raised: whoever closes is done with the object either way.
    """
    try:
        async with asyncio.timeout(_CLOSE_TIMEOUT_S):
            await closeable.close()
    except (*PULSAR_ERRORS, TimeoutError) as e:
        log.debug("closing %s: %s", what, e)
