"""The gRPC server's TLS: its certificate and the CA of its clients, reloaded when they change.

gRPC asks :class:`ReloadingServerTls` for a configuration before every TLS handshake; it answers
with the files' new contents when one of them changed since the last answer (checked by
modification time and size, at most once per ``check_interval_s``), and with None otherwise.
Connections open at the change keep the certificate they shook hands with; new ones get the new
one. A file caught half-written is not taken: the last good configuration stays until a complete
pair loads (a certificate that does not match its key would fail every handshake).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from lbd.core.errors import InvalidInputError

_log = logging.getLogger(__name__)

_PEM_END = b"-----END "


@dataclass(frozen=True, slots=True)
class ServerTlsFiles:
    """The server's certificate chain and key, and the CA its clients' certificates must chain
    to (None: clients are not asked for one)."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None


class ReloadingServerTls:
    """Server credentials that follow their files; see the module docstring."""

    def __init__(
        self,
        files: ServerTlsFiles,
        *,
        check_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._files = files
        self._check_interval_s = check_interval_s
        self._clock = clock
        self._stamp = self._stamps()
        self._checked_at = clock()
        self.reloads = 0
        """How many times a changed configuration was handed to gRPC."""
        try:
            self._initial = self._configuration()
        except ValueError as e:
            raise InvalidInputError(str(e)) from e

    def credentials(self) -> grpc.ServerCredentials:
        """Credentials for ``add_secure_port``; they consult this object at every handshake."""
        return grpc.dynamic_ssl_server_credentials(
            self._initial,
            self._fetch,
            require_client_authentication=self._files.client_ca_file is not None,
        )

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        now = self._clock()
        if now - self._checked_at < self._check_interval_s:
            return None
        self._checked_at = now
        try:
            stamp = self._stamps()
            if stamp == self._stamp:
                return None
            configuration = self._configuration()
        except (OSError, ValueError) as e:
            _log.warning("TLS files changed but do not load yet (keeping the old ones): %s", e)
            return None
        self._stamp = stamp
        self.reloads += 1
        _log.info("TLS certificate files changed: new connections use them")
        return configuration

    def _paths(self) -> tuple[Path, ...]:
        f = self._files
        return (f.cert_file, f.key_file) + (() if f.client_ca_file is None else (f.client_ca_file,))

    def _stamps(self) -> tuple[tuple[int, int], ...]:
        stats = [os.stat(p) for p in self._paths()]
        return tuple((s.st_mtime_ns, s.st_size) for s in stats)

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        f = self._files
        chain = _pem(f.cert_file, "grpc.tls_cert_file")
        key = _pem(f.key_file, "grpc.tls_key_file")
        roots = None if f.client_ca_file is None else _pem(f.client_ca_file, "grpc.tls_ca_file")
        return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=roots)


def _pem(path: Path, key: str) -> bytes:
    """A PEM file's bytes; ValueError naming ``key`` when unreadable or not complete PEM."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{key} {path}: {e.strerror}") from e
    if b"-----BEGIN " not in data or _PEM_END not in data:
        raise ValueError(f"{key} {path}: not a PEM file")
    return data
