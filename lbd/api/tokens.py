"""Signed bearer tokens: JWTs with HS256, as Pulsar's token authentication makes them.

A token names its holder in ``sub`` and its role in ``role``; ``exp`` (seconds since the epoch)
is optional. The sidecars hold the key (``auth.token_key_file``) and check the signature, so a
token can be minted offline (``lbd auth token``) and handed to a broker or an operator without
touching the sidecars' configuration. Only HS256 is accepted: a token naming another algorithm,
``none`` included, is refused.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any

from lbd.core.errors import InvalidInputError

ALGORITHM = "HS256"
MIN_KEY_BYTES = 32
"""HS256 keys shorter than the hash are weak (RFC 7518 §3.2)."""


class TokenError(InvalidInputError):
    """A token that is malformed, badly signed or expired; the message says which."""


@dataclass(frozen=True, slots=True)
class Claims:
    """What a valid token says: who, in which role, until when (None: no expiry)."""

    subject: str
    role: str
    expires_at: float | None


def sign(key: bytes, subject: str, role: str, *, expires_at: float | None = None) -> str:
    """A token for ``subject`` in ``role``, signed with ``key``."""
    check_key(key)
    payload: dict[str, Any] = {"sub": subject, "role": role}
    if expires_at is not None:
        payload["exp"] = int(expires_at)
    head = _encode({"alg": ALGORITHM, "typ": "JWT"})
    body = _encode(payload)
    signature = hmac.new(key, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(signature)}"


def verify(key: bytes, token: str, now: float) -> Claims:
    """The claims of ``token`` if ``key`` signed it and it has not expired at ``now``."""
    parts = token.split(".")
    if len(parts) != 3:
        raise TokenError("the token is not a JWT (three dot-separated parts)")
    head, body, signature = parts
    try:
        header = json.loads(_unb64(head))
        given = _unb64(signature)
    except (ValueError, binascii.Error) as e:
        raise TokenError(f"the token does not decode: {e}") from None
    if not isinstance(header, dict) or header.get("alg") != ALGORITHM:
        raise TokenError(f"the token must be signed with {ALGORITHM}")
    expected = hmac.new(key, f"{head}.{body}".encode(), hashlib.sha256).digest()
    if not hmac.compare_digest(given, expected):
        raise TokenError("the token's signature is not valid")
    try:
        payload = json.loads(_unb64(body))
    except (ValueError, binascii.Error) as e:
        raise TokenError(f"the token's claims do not decode: {e}") from None
    if not isinstance(payload, dict):
        raise TokenError("the token's claims are not an object")
    subject, role, exp = payload.get("sub"), payload.get("role"), payload.get("exp")
    if not isinstance(subject, str) or not subject:
        raise TokenError("the token names no subject ('sub')")
    if not isinstance(role, str) or not role:
        raise TokenError("the token names no role ('role')")
    if exp is not None:
        if not isinstance(exp, int | float) or isinstance(exp, bool):
            raise TokenError("the token's 'exp' is not a number")
        if now >= exp:
            raise TokenError("the token has expired")
    return Claims(subject, role, None if exp is None else float(exp))


def check_key(key: bytes) -> None:
    """Refuse a key too short for HS256."""
    if len(key) < MIN_KEY_BYTES:
        raise InvalidInputError(
            f"the token key has {len(key)} bytes; HS256 needs at least {MIN_KEY_BYTES}"
        )


def _encode(obj: dict[str, Any]) -> str:
    return _b64(json.dumps(obj, separators=(",", ":"), sort_keys=True).encode())


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
