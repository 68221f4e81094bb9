"""Signed tokens: what verifies, what is refused and why; ``lbd auth`` mints what verifies."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from lbd.api import tokens
from lbd.cli.main import main
from lbd.core.errors import InvalidInputError

KEY = b"0123456789abcdef0123456789abcdef"


def test_a_signed_token_verifies_with_its_claims() -> None:
    token = tokens.sign(KEY, "broker-1", "broker", expires_at=2000)
    assert tokens.verify(KEY, token, now=1999) == tokens.Claims("broker-1", "broker", 2000.0)


@pytest.mark.parametrize(
    ("mangle", "why"),
    [
        (lambda t: t + "x", "signature"),
        (lambda t: t.rsplit(".", 1)[0], "three dot-separated parts"),
        (lambda t: tokens.sign(b"k" * 32, "broker-1", "broker"), "signature"),
        (lambda t: tokens.sign(KEY, "broker-1", "broker", expires_at=1000), "expired"),
    ],
)
def test_bad_tokens_are_refused_saying_why(mangle: object, why: str) -> None:
    token = mangle(tokens.sign(KEY, "broker-1", "broker"))  # type: ignore[operator]
    with pytest.raises(tokens.TokenError, match=why):
        tokens.verify(KEY, token, now=1500)


def _unsigned(claims: dict[str, object], alg: str) -> str:
    def b64(obj: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    return f"{b64({'alg': alg, 'typ': 'JWT'})}.{b64(claims)}."


def test_the_none_algorithm_is_refused() -> None:
    with pytest.raises(tokens.TokenError, match="must be signed with HS256"):
        tokens.verify(KEY, _unsigned({"sub": "x", "role": "admin"}, "none"), now=0)


def test_short_keys_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="HS256 needs at least 32"):
        tokens.sign(b"short", "x", "admin")


def test_lbd_auth_mints_tokens_the_key_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_file = tmp_path / "key"
    assert main(["auth", "key", str(key_file)]) == 0
    assert key_file.stat().st_mode & 0o777 == 0o600
    capsys.readouterr()
    args = ["auth", "token", "--key-file", str(key_file), "--name", "broker-2", "--role", "broker"]
    assert main([*args, "--expires-in", "2h"]) == 0
    token = capsys.readouterr().out.strip()
    claims = tokens.verify(key_file.read_bytes().strip(), token, now=0)
    assert (claims.subject, claims.role) == ("broker-2", "broker")
    assert claims.expires_at is not None and claims.expires_at > 7000
    assert main(["auth", "key", str(key_file)]) == 2  # never overwrites a key
