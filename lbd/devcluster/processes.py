"""``lbd serve`` sidecars, ``lbd broker`` fronts (or ``lbd sim broker`` simulated brokers) and
``lbd load`` traffic run as managed child processes.

They reuse :class:`~lbd.devcluster.servers.ManagedServer`: own session, log file in their working
directory, death with the parent, SIGTERM-then-SIGKILL stop. A sidecar is healthy when its
``grpc.health.v1`` overall status is SERVING, a broker front when its port completes a Pulsar
handshake; a simulated broker and the load have no server to probe, so they are healthy while
they run (the cluster checks a broker by its registration instead).
"""

from __future__ import annotations

import os
import ssl
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lbd.broker.credentials import INSECURE, ClientCredentials
from lbd.core.errors import LbdError
from lbd.devcluster.links import LinkSpec, link_status, proxied_url, write_specs
from lbd.devcluster.ports import LOOPBACK
from lbd.devcluster.servers import DEFAULT_START_TIMEOUT_S, ManagedServer, pulsar_handshake

ENV_PREFIX = "LBD_"


def health_serving(addr: str, timeout_s: float, credentials: ClientCredentials = INSECURE) -> bool:
    """Whether the gRPC server at ``addr`` reports SERVING for its overall health; never raises."""
    with credentials.channel(addr) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


def settings_env(settings: Mapping[str, str]) -> dict[str, str]:
    """The process environment for an lbd child: no inherited ``LBD_*`` variables (a dev cluster
    is reproducible whatever the shell exports), plus ``settings`` (dotted ``section.key``) as
    ``LBD_SECTION__KEY`` variables, and unbuffered output so logs are complete at any moment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    for key, value in settings.items():
        section, _, name = key.partition(".")
        env[f"{ENV_PREFIX}{section.upper()}__{name.upper()}"] = value
    env["PYTHONUNBUFFERED"] = "1"
    return env


class _LbdProcess(ManagedServer):
    """An ``lbd`` verb run by this Python interpreter."""

    def __init__(
        self,
        workdir: Path,
        args: Sequence[str],
        env: Mapping[str, str],
        *,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        self._args = list(args)
        self._env = dict(env)
        super().__init__(Path(sys.executable), workdir, start_timeout_s=start_timeout_s)

    def _command(self) -> list[str]:
        return [str(self._binary), "-m", "lbd.cli.main", *self._args]

    def _environment(self) -> Mapping[str, str]:
        return self._env


class SidecarProcess(_LbdProcess):
    """``lbd serve`` for one broker id, listening on loopback ports."""

    name = "lbd-serve"

    def __init__(
        self,
        workdir: Path,
        *,
        broker_id: str,
        grpc_port: int,
        metrics_port: int,
        cluster: str,
        etcd_endpoint: str,
        pulsar_url: str,
        env: Mapping[str, str],
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        credentials: ClientCredentials = INSECURE,
    ) -> None:
        """``credentials``: how the health probe reaches the sidecar (TLS)."""
        self.broker_id = broker_id
        self._credentials = credentials
        self.grpc_addr = f"{LOOPBACK}:{grpc_port}"
        self.metrics_addr = f"{LOOPBACK}:{metrics_port}"
        args = [
            "serve",
            f"--cluster={cluster}",
            f"--etcd-endpoints={etcd_endpoint}",
            f"--pulsar-url={pulsar_url}",
            f"--broker-id={broker_id}",
            f"--grpc-addr={self.grpc_addr}",
            f"--metrics-addr={self.metrics_addr}",
        ]
        super().__init__(workdir, args, env, start_timeout_s=start_timeout_s)

    @property
    def endpoint(self) -> str:
        return self.grpc_addr

    def _probe(self, timeout_s: float) -> bool:
        return health_serving(self.grpc_addr, timeout_s, self._credentials)


class SimBrokerProcess(_LbdProcess):
    """``lbd sim broker`` attached to one sidecar, logging its events to ``events.jsonl``."""

    name = "sim-broker"

    def __init__(
        self,
        workdir: Path,
        *,
        broker_id: str,
        sidecar_addr: str,
        msg_rate: float,
        seed: int,
        env: Mapping[str, str],
        credentials: ClientCredentials = INSECURE,
    ) -> None:
        """``credentials``: the broker's TLS files (a token goes in ``env``, never in argv)."""
        self.broker_id = broker_id
        self.sidecar_addr = sidecar_addr
        tls = [
            f"{flag}={path}"
            for flag, path in (
                ("--tls-ca", credentials.ca_file),
                ("--tls-cert", credentials.cert_file),
                ("--tls-key", credentials.key_file),
            )
            if path is not None
        ]
        args = [
            "sim",
            "broker",
            f"--sidecar={sidecar_addr}",
            f"--broker-id={broker_id}",
            f"--msg-rate={msg_rate:g}",
            f"--seed={seed}",
            f"--events-file={workdir.resolve() / 'events.jsonl'}",
            *tls,
        ]
        super().__init__(workdir, args, env)

    @property
    def events_path(self) -> Path:
        """Where the broker appends its own/release/close/session events."""
        return self.workdir / "events.jsonl"

    @property
    def endpoint(self) -> str:
        return f"sim broker {self.broker_id} -> {self.sidecar_addr}"

    def _probe(self, timeout_s: float) -> bool:
        return True


class FrontProcess(_LbdProcess):
    """``lbd broker``: the broker front of one sidecar, logging its events to ``events.jsonl``.

    Healthy once its client port completes a Pulsar handshake (over TLS when it has a
    certificate)."""

    name = "lbd-broker"

    def __init__(
        self,
        workdir: Path,
        *,
        broker_id: str,
        port: int,
        metrics_port: int,
        web_port: int,
        cluster: str,
        sidecar_addr: str,
        storage_url: str,
        env: Mapping[str, str],
        tls: FrontTls | None = None,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        self.broker_id = broker_id
        self.sidecar_addr = sidecar_addr
        self.port = port
        self.metrics_addr = f"{LOOPBACK}:{metrics_port}"
        self.web_port = web_port
        self._tls = tls
        settings = {
            "front.metrics_addr": self.metrics_addr,
            "front.events_file": str(workdir.resolve() / "events.jsonl"),
            # Every broker of a dev cluster shares the host: each reports its own process.
            "front.usage_source": "process",
        }
        if tls is None:
            settings["front.addr"] = f"{LOOPBACK}:{port}"
            settings["front.web_addr"] = f"{LOOPBACK}:{web_port}"
        else:
            settings.update(tls.settings(f"{LOOPBACK}:{port}", f"{LOOPBACK}:{web_port}"))
        args = [
            "broker",
            f"--cluster={cluster}",
            f"--broker-id={broker_id}",
            f"--sidecar={sidecar_addr}",
            f"--storage-url={storage_url}",
            *(f"--set={k}={v}" for k, v in settings.items()),
        ]
        super().__init__(workdir, args, env, start_timeout_s=start_timeout_s)

    @property
    def web_url(self) -> str:
        """The broker's web service: Pulsar's REST API."""
        scheme = "http" if self._tls is None else "https"
        return f"{scheme}://{LOOPBACK}:{self.web_port}"

    @property
    def service_url(self) -> str:
        """What a client connects to."""
        scheme = "pulsar" if self._tls is None else "pulsar+ssl"
        return f"{scheme}://{LOOPBACK}:{self.port}"

    @property
    def events_path(self) -> Path:
        """Where the broker appends its own/release/close/session/lease/write events."""
        return self.workdir / "events.jsonl"

    @property
    def endpoint(self) -> str:
        return self.service_url

    def _probe(self, timeout_s: float) -> bool:
        context = self._tls.probe_context() if self._tls is not None else None
        return pulsar_handshake(self.port, timeout_s, context)


@dataclass(frozen=True, slots=True)
class FrontTls:
    """A secure dev cluster's broker front: TLS only, clients with certificates of the cluster's
    CA, and the broker's own certificate towards its sidecar."""

    ca_file: Path
    cert_file: Path
    key_file: Path
    sidecar: ClientCredentials

    def settings(self, addr: str, web_addr: str) -> dict[str, str]:
        """The front's settings (dotted keys): TLS ports only."""
        creds = self.sidecar
        out = {
            "front.addr": "",
            "front.tls_addr": addr,
            "front.web_addr": "",
            "front.web_tls_addr": web_addr,
            "front.tls_cert_file": str(self.cert_file),
            "front.tls_key_file": str(self.key_file),
            "front.tls_ca_file": str(self.ca_file),
        }
        for key, path in (
            ("front.sidecar_ca_file", creds.ca_file),
            ("front.sidecar_cert_file", creds.cert_file),
            ("front.sidecar_key_file", creds.key_file),
        ):
            if path is not None:
                out[key] = str(path)
        return out

    def probe_context(self) -> ssl.SSLContext:
        """A client context the front accepts (its own certificate serves as the client's)."""
        return client_tls_context(
            {
                "ca_file": str(self.ca_file),
                "cert_file": str(self.cert_file),
                "key_file": str(self.key_file),
            }
        )


def client_tls_context(files: Mapping[str, str]) -> ssl.SSLContext:
    """A TLS client context from a secure cluster's ``ca_file``, ``cert_file`` and ``key_file``
    (the names :attr:`DevCluster.pulsar_client` records)."""
    context = ssl.create_default_context(cafile=files["ca_file"])
    context.check_hostname = False
    if files.get("cert_file") and files.get("key_file"):
        context.load_cert_chain(files["cert_file"], files["key_file"])
    return context


class LinksProcess(ManagedServer):
    """The proxies of a dev cluster's links (:mod:`lbd.devcluster.links`); healthy once its
    control port answers."""

    name = "links"

    def __init__(self, workdir: Path, specs: Sequence[LinkSpec], control_port: int) -> None:
        super().__init__(Path(sys.executable), workdir)
        self.specs = {s.name: s for s in specs}
        self.control_addr = f"{LOOPBACK}:{control_port}"
        write_specs(self.workdir / "links.json", specs)

    @property
    def endpoint(self) -> str:
        return self.control_addr

    def url(self, name: str, url: str) -> str:
        """``url`` as the client end of link ``name`` reaches it: through the link's proxy."""
        return proxied_url(url, self.specs[name])

    def _command(self) -> list[str]:
        return [
            str(self._binary),
            "-m",
            "lbd.devcluster.links",
            f"--specs={self.workdir / 'links.json'}",
            f"--control-port={self.control_addr.rpartition(':')[2]}",
        ]

    def _probe(self, timeout_s: float) -> bool:
        try:
            link_status(self.control_addr)
        except LbdError:
            return False
        return True


class LoadProcess(_LbdProcess):
    """``lbd load``: real clients producing and consuming through the brokers until stopped."""

    name = "lbd-load"

    def __init__(self, workdir: Path, args: Sequence[str], env: Mapping[str, str]) -> None:
        super().__init__(workdir, ["load", *args], env)

    @property
    def endpoint(self) -> str:
        return "lbd load"

    def _probe(self, timeout_s: float) -> bool:
        return True
