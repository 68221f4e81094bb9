"""Who is calling, and may they: identities, roles and the audit log of the gRPC API.

A caller proves who it is with a client certificate (mutual TLS: the common name is the
identity, the organization names the role through ``auth.cert_roles``), a static token
(``auth.tokens_file``, or ``grpc.admin_token`` as the identity ``admin``) or a signed token
(:mod:`lbd.api.tokens`). A bearer token, when present, wins over the certificate: a sidecar
forwarding a call connects with its own certificate and passes its caller's token along; a
broker's REST API passes its caller's token, or :data:`ANONYMOUS_CALLER` when there is none.

Roles (docs/security.md):

- ``reader``: Lookup, WatchOwnership, ListBrokers, ListBundles, GetNamespace, GetLoad, GetLeader,
  ListDecisions, Audit, ListOperations, GetOperation, WatchOperation;
- ``broker``: what a reader may, and a BrokerSession for its own broker id only;
- ``admin``: everything.

A call without credentials is UNAUTHENTICATED, one whose role falls short PERMISSION_DENIED; the
message names the role the call needs. Health and reflection are open to all. Every Admin call
that changes something, and every refusal, leaves one JSON line on the ``lbd.audit`` logger:
who, what, and the outcome.
"""

from __future__ import annotations

import contextlib
import enum
import hmac
import json
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import text_format
from google.protobuf.message import Message

from lbd.api import tokens
from lbd.api.handlers import Call, CallWrapper, StreamCall, WrappingInterceptor
from lbd.core.errors import InvalidInputError

_log = logging.getLogger(__name__)
audit_log = logging.getLogger("lbd.audit")

AUTHORIZATION = "authorization"
BEARER = "bearer "
ANONYMOUS_CALLER = "lbd-anonymous-caller"
"""Metadata a gateway sends for a caller of its own who presented no token (the broker's REST
API): the call then stands for an anonymous caller, whatever certificate the gateway's own
connection carries. It can only take rights away, so nobody needs to be trusted to send it."""
_SERVICE = "/lbd.v1."


class Role(enum.IntEnum):
    """A caller's role; each includes the rights of the ones below it."""

    READER = 1
    BROKER = 2
    ADMIN = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str, where: str) -> Role:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            names = ", ".join(r.label for r in cls)
            raise InvalidInputError(f"{where}: unknown role {text!r} (one of {names})") from None


READER_METHODS = frozenset(
    f"{_SERVICE}{m}"
    for m in (
        "LoadBalancer/Lookup",
        "LoadBalancer/LookupMany",
        "LoadBalancer/WatchOwnership",
        "Admin/ListBrokers",
        "Admin/ListBundles",
        "Admin/GetNamespace",
        "Admin/GetLoad",
        "Admin/GetLeader",
        "Admin/ListDecisions",
        "Admin/Audit",
        "Admin/ListOperations",
        "Admin/GetOperation",
        "Admin/WatchOperation",
    )
)
BROKER_SESSION = f"{_SERVICE}LoadBalancer/BrokerSession"


def required_role(method: str) -> Role:
    """The least role that may call ``method`` (``/lbd.v1.Service/Method``)."""
    if method in READER_METHODS:
        return Role.READER
    if method == BROKER_SESSION:
        return Role.BROKER
    return Role.ADMIN


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller: its identity, its role and how it proved them."""

    name: str
    role: Role
    via: str  # "certificate", "token", "signed token" or "anonymous"

    def describe(self) -> str:
        return f"{self.name} (role {self.role.label}, by {self.via})"

    def may_open_session_for(self, broker_id: str) -> bool:
        """Whether this caller may hold ``broker_id``'s BrokerSession."""
        return self.role is Role.ADMIN or (self.role is Role.BROKER and self.name == broker_id)


class Refused(Exception):
    """An authentication or authorization failure: the status code and the message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """Where credentials come from (built from the settings by the app)."""

    admin_token: str | None = None
    tokens_file: Path | None = None
    token_key_file: Path | None = None
    cert_roles: Mapping[str, Role] | None = None
    """Certificate organization -> role; None: client certificates carry no identity."""
    anonymous_role: Role | None = None

    @property
    def open(self) -> bool:
        """Whether every caller is an admin (no credential is configured): no checks at all."""
        return (
            self.anonymous_role is Role.ADMIN
            and self.admin_token is None
            and self.tokens_file is None
            and self.token_key_file is None
            and self.cert_roles is None
        )


class Authenticator:
    """Tells who a call's caller is, from its metadata and its TLS peer."""

    def __init__(self, config: AuthConfig, *, clock: Callable[[], float] = time.time) -> None:
        self._config = config
        self._clock = clock
        self._static = _StaticTokens(config.tokens_file, config.admin_token)
        self._key = None if config.token_key_file is None else _read_key(config.token_key_file)

    def authenticate(
        self, metadata: Sequence[tuple[str, Any]] | None, auth_context: Mapping[str, Any]
    ) -> Principal | None:
        """The caller, or None when it presented nothing; :class:`Refused` for bad credentials."""
        token = _bearer(metadata)
        if token is not None:
            return self._by_token(token)
        if not _anonymous(metadata):
            from_cert = self._by_certificate(auth_context)
            if from_cert is not None:
                return from_cert
        if self._config.anonymous_role is not None:
            return Principal("anonymous", self._config.anonymous_role, "anonymous")
        return None

    def _by_token(self, token: str) -> Principal:
        known = self._static.lookup(token)
        if known is not None:
            return known
        if self._key is not None and token.count(".") == 2:
            try:
                claims = tokens.verify(self._key, token, self._clock())
            except tokens.TokenError as e:
                raise Refused(grpc.StatusCode.UNAUTHENTICATED, str(e)) from None
            try:
                role = Role.parse(claims.role, "the token's role")
            except InvalidInputError as e:
                raise Refused(grpc.StatusCode.UNAUTHENTICATED, str(e)) from None
            return Principal(claims.subject, role, "signed token")
        raise Refused(grpc.StatusCode.UNAUTHENTICATED, "the bearer token is not valid")

    def _by_certificate(self, auth_context: Mapping[str, Any]) -> Principal | None:
        roles = self._config.cert_roles
        names = auth_context.get("x509_common_name")
        if roles is None or not names:
            return None
        name = bytes(names[0]).decode(errors="replace")
        subject = b",".join(auth_context.get("x509_subject") or ()).decode(errors="replace")
        organizations = [o for o in _subject_values(subject, "O")]
        granted = [roles[o] for o in organizations if o in roles]
        if not granted:
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the client certificate of {name} names no role: its organization "
                f"{organizations or '(none)'} is none of auth.cert_roles "
                f"({', '.join(sorted(roles)) or 'empty'})",
            )
        return Principal(name, max(granted), "certificate")


class _StaticTokens:
    """``auth.tokens_file`` (lines ``<role> <name> <token>``), re-read when it changes."""

    def __init__(self, path: Path | None, admin_token: str | None) -> None:
        self._path = path
        self._admin = admin_token
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._checked_at = 0.0
        self._tokens: dict[str, Principal] = {}
        if path is not None:
            self._tokens = parse_tokens_file(path)
            self._stamp = _stamp(path)

    def lookup(self, token: str) -> Principal | None:
        if self._admin is not None and hmac.compare_digest(token.encode(), self._admin.encode()):
            return Principal("admin", Role.ADMIN, "token")
        self._maybe_reload()
        for known, principal in self._tokens.items():
            if hmac.compare_digest(token.encode(), known.encode()):
                return principal
        return None

    def _maybe_reload(self) -> None:
        if self._path is None:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._checked_at < 1.0:
                return
            self._checked_at = now
            try:
                stamp = _stamp(self._path)
                if stamp == self._stamp:
                    return
                self._tokens = parse_tokens_file(self._path)
                self._stamp = stamp
                _log.info("auth.tokens_file changed: %d tokens", len(self._tokens))
            except (OSError, InvalidInputError) as e:
                _log.warning("auth.tokens_file does not load (keeping the old tokens): %s", e)


def parse_tokens_file(path: Path) -> dict[str, Principal]:
    """Token -> principal from a tokens file; InvalidInputError naming the bad line."""
    try:
        text = path.read_text()
    except OSError as e:
        raise InvalidInputError(f"auth.tokens_file {path}: {e.strerror}") from e
    out: dict[str, Principal] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        where = f"auth.tokens_file {path} line {number}"
        if len(parts) != 3:
            raise InvalidInputError(f"{where}: expected '<role> <name> <token>'")
        role, name, token = parts
        if token in out:
            raise InvalidInputError(f"{where}: this token is already given to another name")
        out[token] = Principal(name, Role.parse(role, where), "token")
    return out


def _read_key(path: Path) -> bytes:
    try:
        key = path.read_bytes().strip()
    except OSError as e:
        raise InvalidInputError(f"auth.token_key_file {path}: {e.strerror}") from e
    tokens.check_key(key)
    return key


def _stamp(path: Path) -> tuple[int, int]:
    s = os.stat(path)
    return s.st_mtime_ns, s.st_size


def _bearer(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The bearer token of the call; :class:`Refused` when the header is malformed."""
    for key, value in metadata or ():
        if key.lower() != AUTHORIZATION:
            continue
        text = value if isinstance(value, str) else bytes(value).decode(errors="replace")
        if not text.lower().startswith(BEARER) or not text[len(BEARER) :].strip():
            raise Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                "the authorization metadata must read 'Bearer <token>'",
            )
        return text[len(BEARER) :].strip()
    return None


def _anonymous(metadata: Sequence[tuple[str, Any]] | None) -> bool:
    """Whether the call stands for a caller without credentials (:data:`ANONYMOUS_CALLER`)."""
    return any(key.lower() == ANONYMOUS_CALLER for key, _ in metadata or ())


def _subject_values(subject: str, attribute: str) -> list[str]:
    """The values of ``attribute`` in an RFC 4514 subject (``CN=a,O=b``), escapes undone."""
    values: list[str] = []
    parts: list[str] = []
    current = ""
    escaped = False
    for ch in subject:
        if escaped:
            current += ch
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch in ",+":
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    for part in parts:
        key, sep, value = part.partition("=")
        if sep and key.strip().upper() == attribute:
            values.append(value.strip())
    return values


def authorize(principal: Principal | None, method: str) -> None:
    """Raise :class:`Refused` unless ``principal`` may call ``method``."""
    needed = required_role(method)
    short = method.removeprefix("/")
    if principal is None:
        raise Refused(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{short} needs the {needed.label} role: present a client certificate or "
            "the metadata 'authorization: Bearer <token>'",
        )
    if principal.role < needed:
        raise Refused(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{principal.describe()} may not call {short}: it needs the {needed.label} role",
        )


def principal_of(authenticator: Authenticator, context: grpc.aio.ServicerContext) -> Principal:
    """The caller of a call already past the interceptor (it authenticated there)."""
    principal = authenticator.authenticate(context.invocation_metadata(), context.auth_context())
    if principal is None:  # the interceptor refuses these first
        raise Refused(grpc.StatusCode.UNAUTHENTICATED, "no credentials")
    return principal


def audit(
    principal: Principal | None,
    method: str,
    outcome: str,
    *,
    peer: str,
    request: Any = None,
    details: str = "",
) -> None:
    """One structured line on the ``lbd.audit`` logger."""
    record: dict[str, Any] = {
        "who": None if principal is None else principal.name,
        "role": None if principal is None else principal.role.label,
        "via": None if principal is None else principal.via,
        "peer": peer,
        "what": method.removeprefix("/"),
        "outcome": outcome,
    }
    if isinstance(request, Message):
        record["request"] = text_format.MessageToString(request, as_one_line=True)[:500]
    if details:
        record["details"] = details[:500]
    audit_log.info(json.dumps(record, sort_keys=True))


_AUDITED_READS = READER_METHODS
"""Reads are not audited when they succeed (they change nothing); refusals always are."""


class _Checked(CallWrapper):
    """Authenticates and authorizes one call, and audits it when it is an admin action."""

    def __init__(self, authenticator: Authenticator) -> None:
        self._authenticator = authenticator

    def _admit(self, method: str, context: grpc.aio.ServicerContext) -> Principal:
        try:
            principal = self._authenticator.authenticate(
                context.invocation_metadata(), context.auth_context()
            )
        except Refused as e:
            audit(None, method, e.code.name, peer=context.peer(), details=e.message)
            raise
        try:
            authorize(principal, method)
        except Refused as e:
            audit(principal, method, e.code.name, peer=context.peer(), details=e.message)
            raise
        assert principal is not None
        return principal

    async def unary(self, method: str, context: grpc.aio.ServicerContext, call: Call) -> Any:
        try:
            principal = self._admit(method, context)
        except Refused as e:
            await context.abort(e.code, e.message)
        if method in _AUDITED_READS:
            return await call()
        outcome = "INTERNAL"
        try:
            response = await call()
            outcome = "OK"
            return response
        except grpc.aio.AbortError:
            code = context.code()
            outcome = code.name if isinstance(code, grpc.StatusCode) else str(code)
            raise
        except BaseException as e:
            outcome = type(e).__name__
            raise
        finally:
            audit(
                principal,
                method,
                outcome,
                peer=context.peer(),
                request=getattr(call, "request", None),
                details=_details(context) if outcome != "OK" else "",
            )

    async def stream(
        self, method: str, context: grpc.aio.ServicerContext, call: StreamCall
    ) -> AsyncGenerator[Any, None]:
        try:
            self._admit(method, context)
        except Refused as e:
            await context.abort(e.code, e.message)
        async with contextlib.aclosing(call()) as responses:
            async for response in responses:
                yield response


def _details(context: grpc.aio.ServicerContext) -> str:
    try:
        details = context.details()
    except (AttributeError, RuntimeError):
        return ""
    if isinstance(details, bytes):
        return details.decode(errors="replace")
    return details or ""


class AuthInterceptor(WrappingInterceptor):
    """Authenticates and authorizes every call of lbd's services (health and reflection stay
    open); see the module docstring."""

    def __init__(self, authenticator: Authenticator) -> None:
        super().__init__(_Checked(authenticator))
