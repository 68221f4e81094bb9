"""``lbd serve`` sidecars and ``lbd sim broker`` brokers run as managed child processes.

They reuse :class:`~lbd.devcluster.servers.ManagedServer`: own session, log file in their working
directory, death with the parent, SIGTERM-then-SIGKILL stop. A sidecar is healthy when its
``grpc.health.v1`` overall status is SERVING; a simulated broker has no server to probe, so it is
healthy while it runs (the cluster checks it by its registration instead).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lbd.broker.credentials import INSECURE, ClientCredentials
from lbd.devcluster.ports import LOOPBACK
from lbd.devcluster.servers import DEFAULT_START_TIMEOUT_S, ManagedServer

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
