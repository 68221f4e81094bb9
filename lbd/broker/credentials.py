"""How a client of a sidecar proves who it is: TLS (a CA, a client certificate) and a token.

One :class:`ClientCredentials` serves every client of the sidecar's gRPC API: the broker-side
library, ``lbd ctl``, the sidecars forwarding to each other and the simulated brokers. Files are
read each time a channel is made, so a client that reconnects picks up a renewed certificate or
token without a restart. Without a CA the channel is plaintext, as a loopback sidecar allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from lbd.core.errors import InvalidInputError

AUTHORIZATION = "authorization"


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientCredentials:
    """TLS files and a bearer token; every field optional.

    ``ca_file`` turns TLS on (the sidecar's certificate must be signed by it; ``system_roots``
    turns it on with the system's trusted CAs instead); ``cert_file`` and ``key_file`` add a
    client certificate (mutual TLS); ``token`` or ``token_file`` adds
    ``authorization: Bearer <token>`` to every call.
    """

    ca_file: Path | None = None
    system_roots: bool = False
    cert_file: Path | None = None
    key_file: Path | None = None
    token: str | None = None
    token_file: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise InvalidInputError("a client certificate needs both its cert and key files")
        if self.cert_file is not None and not self.tls:
            raise InvalidInputError("a client certificate needs TLS: give the CA file too")
        if self.token is not None and self.token_file is not None:
            raise InvalidInputError("give a token or a token file, not both")

    @property
    def tls(self) -> bool:
        """Whether channels are TLS."""
        return self.ca_file is not None or self.system_roots

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """The TLS credentials, read from the files now."""
        if not self.tls:
            raise InvalidInputError("no CA file: the channel is not TLS")
        return grpc.ssl_channel_credentials(
            root_certificates=None if self.ca_file is None else _read(self.ca_file, "CA"),
            private_key=None if self.key_file is None else _read(self.key_file, "key"),
            certificate_chain=None if self.cert_file is None else _read(self.cert_file, "cert"),
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata carrying the token (none without one)."""
        token = self.token
        if self.token_file is not None:
            token = _read(self.token_file, "token").decode().strip()
        return ((AUTHORIZATION, f"Bearer {token}"),) if token else ()

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel to ``target``."""
        if self.tls:
            return grpc.secure_channel(target, self.channel_credentials(), options=options)
        return grpc.insecure_channel(target, options=options)

    def aio_channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """An asyncio channel to ``target``."""
        if self.tls:
            return grpc.aio.secure_channel(target, self.channel_credentials(), options=options)
        return grpc.aio.insecure_channel(target, options=options)

    def files(self) -> tuple[Path, ...]:
        """The files these credentials read (to notice when one changes)."""
        named = (self.ca_file, self.cert_file, self.key_file, self.token_file)
        return tuple(p for p in named if p is not None)


INSECURE = ClientCredentials()
"""No TLS, no token: a loopback sidecar that authenticates nobody."""


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise InvalidInputError(f"cannot read the {what} file {path}: {e.strerror}") from e
