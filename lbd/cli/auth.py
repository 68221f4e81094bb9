"""``lbd auth``: the secret key of signed tokens, and tokens minted with it.

``lbd auth key FILE`` writes a fresh random key (mode 0600) for ``auth.token_key_file``;
``lbd auth token --key-file FILE --name broker-1 --role broker`` prints a token for that name and
role (JWT, HS256), optionally expiring. Tokens are minted offline: the sidecars only need the key.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import time
from pathlib import Path

from lbd.api import tokens
from lbd.api.auth import Role
from lbd.core.errors import InvalidInputError

_DURATION = re.compile(r"(\d+)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
KEY_BYTES = 32


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lbd auth key`` and ``lbd auth token``."""
    group = sub.add_parser("auth", help="keys and tokens for the gRPC API", description=__doc__)
    verbs = group.add_subparsers(dest="auth_command", metavar="VERB", required=True)

    p = verbs.add_parser("key", help="write a new random key for signed tokens (mode 0600)")
    p.add_argument("file", type=Path, help="where to write it (must not exist)")
    p.set_defaults(func=run_key)

    p = verbs.add_parser("token", help="print a signed token for a name and a role")
    p.add_argument("--key-file", type=Path, required=True, metavar="FILE")
    p.add_argument("--name", required=True, help="who holds it; a broker's name is its broker id")
    p.add_argument("--role", required=True, choices=[r.label for r in Role])
    p.add_argument(
        "--expires-in", metavar="DURATION", help="e.g. 90d, 12h, 30m (default: never expires)"
    )
    p.set_defaults(func=run_token)


def run_key(args: argparse.Namespace) -> int:
    """Write a new key."""
    path: Path = args.file
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise InvalidInputError(f"{path} exists: a new key would invalidate its tokens") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(KEY_BYTES) + "\n")
    print(f"wrote a {KEY_BYTES}-byte random key to {path}: set auth.token_key_file to it")
    return 0


def run_token(args: argparse.Namespace) -> int:
    """Print one token."""
    try:
        key = args.key_file.read_bytes().strip()
    except OSError as e:
        raise InvalidInputError(f"--key-file {args.key_file}: {e.strerror}") from None
    expires_at = None
    if args.expires_in is not None:
        expires_at = time.time() + parse_duration(args.expires_in)
    print(tokens.sign(key, args.name, args.role, expires_at=expires_at))
    return 0


def parse_duration(text: str) -> int:
    """Seconds in ``90d``, ``12h``, ``30m`` or ``45s``."""
    match = _DURATION.fullmatch(text.strip())
    if match is None or int(match.group(1)) == 0:
        raise InvalidInputError(
            f"--expires-in {text!r}: expected a positive N followed by s, m, h or d"
        )
    return int(match.group(1)) * _UNIT_S[match.group(2)]
