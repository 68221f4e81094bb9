"""``lbd dev up --secure``: a throwaway CA, certificates and passwords for a dev cluster.

:func:`make_security` fills ``<state dir>/pki`` with a fresh CA (:mod:`lbd.devcluster.pki`) and:

- ``etcd.pem``: etcd's server certificate (etcd then requires client certificates too), and
  ``etcd-client.pem``, the sidecars' client certificate; ``etcd-root-password``: the password of
  etcd's ``root`` user (auth is enabled);
- ``sidecar-<id>.pem``: each sidecar's server certificate, also its client certificate when it
  forwards a call (organization ``admin``);
- ``broker-<id>.pem``: each broker's client certificate towards its sidecar (common name its
  broker id, organization ``broker``): it may hold that broker's session only;
- ``front-<id>.pem``: each broker front's server certificate (its TLS port for Pulsar clients),
  and ``client.pem``, the certificate a Pulsar client presents to the fronts (mutual TLS);
- ``admin.pem`` and ``reader.pem``: for ``lbd ctl`` (``lbd dev env`` prints the admin's).

Keys are mode 0600; nothing leaves the state directory.
"""

from __future__ import annotations

import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from lbd.broker.credentials import ClientCredentials
from lbd.devcluster.pki import CertFiles, DevPki

PKI_DIR = "pki"
ETCD_USER = "root"
_PASSWORD_FILE = "etcd-root-password"


@dataclass(frozen=True, slots=True)
class DevSecurity:
    """The certificates and secrets of one secure dev cluster (see the module docstring)."""

    directory: Path
    ca_file: Path
    etcd_server: CertFiles
    etcd_client: CertFiles
    etcd_password: str
    admin: CertFiles
    reader: CertFiles
    client: CertFiles
    """The Pulsar clients' certificate (``lbd load``, the tests' clients)."""

    def sidecar_files(self, broker_id: str) -> CertFiles:
        return _files(self.directory, f"sidecar-{broker_id}")

    def broker_files(self, broker_id: str) -> CertFiles:
        return _files(self.directory, f"broker-{broker_id}")

    def front_files(self, broker_id: str) -> CertFiles:
        return _files(self.directory, f"front-{broker_id}")

    def sidecar_settings(self, broker_id: str) -> dict[str, str]:
        """The settings (dotted keys) that make a sidecar speak TLS everywhere with auth."""
        own = self.sidecar_files(broker_id)
        return {
            "etcd.ca_file": str(self.ca_file),
            "etcd.cert_file": str(self.etcd_client.cert),
            "etcd.key_file": str(self.etcd_client.key),
            "etcd.username": ETCD_USER,
            "etcd.password": self.etcd_password,
            "grpc.tls_cert_file": str(own.cert),
            "grpc.tls_key_file": str(own.key),
            "grpc.tls_ca_file": str(self.ca_file),
        }

    def broker_credentials(self, broker_id: str) -> ClientCredentials:
        files = self.broker_files(broker_id)
        return ClientCredentials(ca_file=self.ca_file, cert_file=files.cert, key_file=files.key)

    def admin_credentials(self) -> ClientCredentials:
        return ClientCredentials(
            ca_file=self.ca_file, cert_file=self.admin.cert, key_file=self.admin.key
        )


def make_security(state_dir: Path, broker_ids: list[str]) -> DevSecurity:
    """A fresh CA and every certificate a secure dev cluster of ``broker_ids`` needs."""
    directory = state_dir / PKI_DIR
    shutil.rmtree(directory, ignore_errors=True)
    pki = DevPki(directory, name="lbd dev cluster CA")
    for broker_id in broker_ids:
        pki.issue(f"sidecar-{broker_id}", broker_id, role="admin", server=True)
        pki.issue(f"broker-{broker_id}", broker_id, role="broker")
        pki.issue(f"front-{broker_id}", broker_id, server=True)
    password = secrets.token_urlsafe(18)
    secret = directory / _PASSWORD_FILE
    secret.touch(mode=0o600)
    secret.write_text(password + "\n")
    return DevSecurity(
        directory=directory,
        ca_file=pki.ca_file,
        etcd_server=pki.issue("etcd", "etcd", server=True),
        etcd_client=pki.issue("etcd-client", "lbd-sidecar"),
        etcd_password=password,
        admin=pki.issue("admin", "dev-admin", role="admin"),
        reader=pki.issue("reader", "dev-reader", role="reader"),
        client=pki.issue("client", "dev-client"),
    )


def _files(directory: Path, stem: str) -> CertFiles:
    return CertFiles(directory / f"{stem}.pem", directory / f"{stem}.key")
