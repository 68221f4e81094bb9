"""A throwaway certificate authority for secure dev clusters and tests (``lbd dev up --secure``).

:class:`DevPki` makes a CA in a directory and issues certificates signed by it: for servers
(sidecars, etcd: names ``localhost`` and ``127.0.0.1``) and for clients. A certificate's subject
carries its identity the way lbd reads it (docs/security.md): the common name is the identity
(a broker id, an operator's name) and the organization is the role (``broker``, ``reader``,
``admin``). Keys are ECDSA P-256, written with mode 0600. Nothing here is meant for production:
a real cluster's certificates come from its own CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_VALIDITY = datetime.timedelta(days=30)
_LOOPBACK_NAMES = ("localhost",)
_LOOPBACK_IPS = ("127.0.0.1", "::1")


@dataclass(frozen=True, slots=True)
class CertFiles:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


class DevPki:
    """A CA kept in ``directory`` (``ca.pem``, ``ca.key``); made on first use, reused after."""

    def __init__(self, directory: Path, *, name: str = "lbd dev CA") -> None:
        self.directory = directory
        self.ca_file = directory / "ca.pem"
        self._ca_key_file = directory / "ca.key"
        if self.ca_file.exists() and self._ca_key_file.exists():
            self._ca_cert = x509.load_pem_x509_certificate(self.ca_file.read_bytes())
            loaded = serialization.load_pem_private_key(
                self._ca_key_file.read_bytes(), password=None
            )
            if not isinstance(loaded, ec.EllipticCurvePrivateKey):
                raise ValueError(f"{self._ca_key_file}: not an EC private key")
            self._ca_key = loaded
            return
        directory.mkdir(parents=True, exist_ok=True)
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = _now()
        self._ca_cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + DEFAULT_VALIDITY * 12)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._ca_key, hashes.SHA256())
        )
        _write_key(self._ca_key_file, self._ca_key)
        self.ca_file.write_bytes(self._ca_cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        file_stem: str,
        common_name: str,
        *,
        role: str | None = None,
        server: bool = False,
        not_before: datetime.datetime | None = None,
        not_after: datetime.datetime | None = None,
    ) -> CertFiles:
        """A certificate for ``common_name`` (role in the organization) as ``<file_stem>.pem``.

        Every certificate is good for client authentication; ``server`` adds server
        authentication and the loopback names. ``not_before``/``not_after`` default to now
        (less five minutes) and 30 days later: an expired certificate is made by passing both
        in the past.
        """
        key = ec.generate_private_key(ec.SECP256R1())
        attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
        if role is not None:
            attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, role))
        now = _now()
        start = not_before or now - datetime.timedelta(minutes=5)
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attributes))
            .issuer_name(self._ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(not_after or start + DEFAULT_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if server:
            names: list[x509.GeneralName] = [x509.DNSName(n) for n in _LOOPBACK_NAMES]
            names += [x509.IPAddress(ipaddress.ip_address(a)) for a in _LOOPBACK_IPS]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._ca_key, hashes.SHA256())
        files = CertFiles(self.directory / f"{file_stem}.pem", self.directory / f"{file_stem}.key")
        _write_key(files.key, key)
        files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return files


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)
