"""The detached supervisor of a dev cluster: ``python -m lbd.devcluster.supervisor``.

Started by :func:`lbd.devcluster.cluster.up` in a session of its own. It forks once so that the
launcher returns at once (after writing the supervisor's pid), then starts etcd, pulsar-lite, the
storage pulsar-lite, the sidecars and the broker fronts (or simulated brokers) as its children
(they die with it), waits until every sidecar is SERVING and sees every broker registered, with
``--traffic`` creates and assigns the traffic namespace and starts the clients (``lbd load``),
and writes ``cluster.json``. It then waits for SIGTERM or SIGINT, stops its children in
reverse order and removes ``cluster.json`` and its pid file. Its own log is ``supervisor.log``.

While it waits it serves requests to add brokers (:func:`lbd.devcluster.cluster.add_brokers`,
``lbd dev add``): the request file names how many; the supervisor starts their sidecars and
broker fronts (or simulated brokers) as children of its own, as at start-up, waits until every
sidecar lists them, rewrites ``cluster.json`` with the new nodes and answers in the result file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from lbd.broker.credentials import INSECURE, ClientCredentials
from lbd.core.bundles import NamespaceBundles
from lbd.core.errors import LbdError
from lbd.core.names import NamespaceName
from lbd.ctl.client import RpcFailure, SidecarClient
from lbd.devcluster.cluster import (
    ADD_REQUEST_FILE,
    ADD_RESULT_FILE,
    CLUSTER_FILE,
    CLUSTER_NAME,
    PID_FILE,
    SUPERVISOR_LOG,
    TRAFFIC_MSG_RATE,
    TRAFFIC_NAMESPACE,
    TRAFFIC_RATE,
    TRAFFIC_TOPICS,
    DevCluster,
    DevClusterSpec,
    NodeRecord,
    ProcessRecord,
    process_start_ticks,
    write_whole,
)
from lbd.devcluster.links import LinkSpec
from lbd.devcluster.ports import LOOPBACK, free_ports
from lbd.devcluster.processes import (
    FrontProcess,
    FrontTls,
    LinksProcess,
    LoadProcess,
    SidecarProcess,
    SimBrokerProcess,
    settings_env,
)
from lbd.devcluster.secure import DevSecurity, make_security
from lbd.devcluster.servers import EtcdServer, ManagedServer, PulsarLiteServer
from lbd.workload.traffic import Workload, WorkloadSpec

_log = logging.getLogger("lbd.devcluster")

SIDECAR_START_TIMEOUT_S = 60.0
REGISTRATION_TIMEOUT_S = 30.0
CHILD_STOP_TIMEOUT_S = 5.0
_POLL_S = 0.2
_REQUEST_POLL_S = 0.5
"""How often the waiting supervisor looks for a request to add brokers."""


class _Stop(BaseException):
    """Raised by the signal handler to unwind whatever the supervisor is doing."""


def main(argv: list[str] | None = None) -> int:
    """Parse the spec, detach, run the cluster until signalled."""
    parser = argparse.ArgumentParser(prog="python -m lbd.devcluster.supervisor")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--brokers", type=int, required=True)
    parser.add_argument("--namespace-bundles", type=int, required=True)
    parser.add_argument("--traffic", action="store_true")
    parser.add_argument("--secure", action="store_true")
    parser.add_argument("--sim-brokers", action="store_true")
    parser.add_argument("--links", action="store_true")
    parser.add_argument("--set", action="append", default=[], dest="settings")
    args = parser.parse_args(argv)
    state_dir: Path = args.state_dir.resolve()
    spec = DevClusterSpec(
        args.brokers,
        args.traffic,
        {},
        args.namespace_bundles,
        args.secure,
        args.sim_brokers,
        args.links,
    ).with_overrides(args.settings)
    _detach(state_dir)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return _supervise(state_dir, spec)


def _detach(state_dir: Path) -> None:
    """Fork; the parent records the child's pid and exits, the child logs to the log file."""
    log_fd = os.open(state_dir / SUPERVISOR_LOG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    pid = os.fork()
    if pid > 0:
        (state_dir / PID_FILE).write_text(f"{pid}\n")
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(devnull)
    os.close(log_fd)


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def _supervise(state_dir: Path, spec: DevClusterSpec) -> int:
    children: list[ManagedServer] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_stop)
    code = 0
    try:
        cluster, servers = _start(state_dir, spec, children)
        _write_record(cluster)
        _log.info("dev cluster ready: %s", state_dir / CLUSTER_FILE)
        while True:
            cluster = _serve_add_request(cluster, servers, children)
            time.sleep(_REQUEST_POLL_S)
    except _Stop as e:
        _log.info("%s: stopping the dev cluster", e)
    except Exception:
        _log.exception("the dev cluster failed")
        code = 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        for child in reversed(children):
            _log.info("stopping %s", child)
            child.stop(CHILD_STOP_TIMEOUT_S)
        for name in (CLUSTER_FILE, PID_FILE, ADD_REQUEST_FILE):
            (state_dir / name).unlink(missing_ok=True)
        _log.info("dev cluster stopped")
    return code


def _write_record(cluster: DevCluster) -> None:
    """Write ``cluster.json`` at once (a reader sees the old record or the new one)."""
    write_whole(Path(cluster.state_dir) / CLUSTER_FILE, cluster.to_json())


def _serve_add_request(
    cluster: DevCluster, servers: _Servers, children: list[ManagedServer]
) -> DevCluster:
    """Add the brokers a pending request asks for (if any) and answer it in the result file:
    ``{"id": ..., "error": ""}``, or the error that stopped it (the brokers started by then
    stay, recorded). The cluster's record as it now is."""
    state_dir = Path(cluster.state_dir)
    try:
        request = json.loads((state_dir / ADD_REQUEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return cluster
    (state_dir / ADD_REQUEST_FILE).unlink(missing_ok=True)
    error = ""
    try:
        cluster = _add_brokers(cluster, servers, int(request["count"]), children)
    except (LbdError, KeyError, TypeError, ValueError) as e:
        _log.error("adding brokers failed: %s", e)
        error = str(e) or type(e).__name__
    write_whole(
        state_dir / ADD_RESULT_FILE, json.dumps({"id": request.get("id", ""), "error": error})
    )
    return cluster


def _add_brokers(
    cluster: DevCluster, servers: _Servers, count: int, children: list[ManagedServer]
) -> DevCluster:
    """Start ``count`` more sidecars and brokers, wait until every sidecar lists every broker,
    and record them (written to ``cluster.json`` before this returns)."""
    spec = servers.spec
    if spec.secure or spec.links:
        # Their certificates and proxies are made for the brokers of the start only.
        raise LbdError("brokers cannot be added to a --secure or --links dev cluster")
    first = len(cluster.nodes) + 1
    broker_ids = [f"broker-{i}" for i in range(first, first + count)]
    ports = iter(free_ports(2 * count))
    sidecars = [
        _start_sidecar(servers, b, (next(ports), next(ports)), children) for b in broker_ids
    ]
    broker_ports = iter(free_ports(3 * count))
    brokers = [_start_broker(servers, s, broker_ports, children) for s in sidecars]
    nodes = (*cluster.nodes, *(_node(s, b) for s, b in zip(sidecars, brokers, strict=True)))
    addrs = [n.grpc_addr for n in nodes]
    clients = [SidecarClient(a, credentials=servers.operator, timeout_s=10.0) for a in addrs]
    try:
        _wait_registered(clients, len(nodes))
    finally:
        for client in clients:
            client.close()
    cluster = dataclasses.replace(cluster, nodes=nodes)
    _write_record(cluster)
    _log.info("added %s", ", ".join(broker_ids))
    return cluster


def _start(
    state_dir: Path, spec: DevClusterSpec, children: list[ManagedServer]
) -> tuple[DevCluster, _Servers]:
    """Start every process (appended to ``children`` as soon as it exists) and wait until
    ready; the cluster's record, and what starting more brokers later needs."""
    for old in (
        *state_dir.glob("broker-*"),
        state_dir / "etcd",
        state_dir / "pulsar",
        state_dir / "storage",
        state_dir / "load",
        state_dir / "links",
    ):
        shutil.rmtree(old, ignore_errors=True)
    broker_ids = [f"broker-{i}" for i in range(1, spec.brokers + 1)]
    security = make_security(state_dir, broker_ids) if spec.secure else None
    if security is None:
        etcd = EtcdServer(state_dir / "etcd")
    else:
        etcd = EtcdServer(
            state_dir / "etcd",
            tls=security.etcd_server,
            client_ca_file=security.ca_file,
            root_password=security.etcd_password,
        )
    children.append(etcd)
    etcd.start()
    # Errors only: pulsar-lite warns once per message for every reader that was ever closed on a
    # topic ("No dispatcher found for subscription"), and each read barrier closes one. With a
    # few hundred closed readers and thousands of messages that is millions of lines, and
    # pulsar-lite spends its time writing them.
    pulsar = PulsarLiteServer(state_dir / "pulsar", log_level="error")
    children.append(pulsar)
    pulsar.start()
    _log.info("etcd at %s, pulsar-lite at %s", etcd.client_url, pulsar.service_url)
    storage = None
    if not spec.sim_brokers:
        # The brokers' topics, apart from the channel's: the role BookKeeper plays for Pulsar.
        storage = PulsarLiteServer(state_dir / "storage", log_level="error")
        children.append(storage)
        storage.start()
        _log.info("storage pulsar-lite at %s", storage.service_url)

    operator = _operator_credentials(spec, security)
    ports = iter(free_ports(2 * spec.brokers))
    sidecar_ports = {b: (next(ports), next(ports)) for b in broker_ids}
    links = None
    if spec.links:
        links = _links(state_dir / "links", etcd, pulsar, storage, sidecar_ports)
        children.append(links)
        links.start()
        _log.info("%d links behind proxies, control at %s", len(links.specs), links.control_addr)
    servers = _Servers(state_dir, spec, etcd, pulsar, storage, security, links, operator)

    sidecars = [_start_sidecar(servers, b, sidecar_ports[b], children) for b in broker_ids]
    broker_ports = iter(free_ports(3 * spec.brokers))
    brokers = [_start_broker(servers, s, broker_ports, children) for s in sidecars]

    clients = [SidecarClient(s.grpc_addr, credentials=operator, timeout_s=10.0) for s in sidecars]
    try:
        _wait_registered(clients, spec.brokers)
        if spec.traffic:
            clients[0].create_namespace(TRAFFIC_NAMESPACE, spec.namespace_bundles)
            _log.info("namespace %s: %d bundles", TRAFFIC_NAMESPACE, spec.namespace_bundles)
            _assign_every_bundle(clients, spec.namespace_bundles)
    finally:
        for client in clients:
            client.close()

    load = None
    pulsar_client = {} if security is None else _pulsar_client_files(security)
    if spec.traffic and storage is not None:
        load = LoadProcess(state_dir / "load", _load_args(brokers, pulsar_client), settings_env({}))
        children.append(load)
        load.start()

    cluster = DevCluster(
        cluster=CLUSTER_NAME,
        state_dir=str(state_dir),
        etcd_endpoint=etcd.client_url,
        pulsar_url=pulsar.service_url,
        supervisor=_record(os.getpid(), state_dir / SUPERVISOR_LOG),
        etcd=_record(etcd.pid, etcd.log_path),
        pulsar=_record(pulsar.pid, pulsar.log_path),
        nodes=tuple(_node(s, b) for s, b in zip(sidecars, brokers, strict=True)),
        settings=dict(spec.settings),
        client=_client_record(operator),
        storage_url=storage.service_url if storage is not None else "",
        storage=_record(storage.pid, storage.log_path) if storage is not None else None,
        load=_record(load.pid, load.log_path) if load is not None else None,
        pulsar_client=pulsar_client,
        links_control=links.control_addr if links is not None else "",
        links={n: s.target for n, s in links.specs.items()} if links is not None else {},
        links_process=_record(links.pid, links.log_path) if links is not None else None,
    )
    return cluster, servers


@dataclass(frozen=True, slots=True)
class _Servers:
    """What a node of the cluster is started against: the shared servers, the security and
    links of the cluster, and the operator's credentials."""

    state_dir: Path
    spec: DevClusterSpec
    etcd: EtcdServer
    pulsar: PulsarLiteServer
    storage: PulsarLiteServer | None
    security: DevSecurity | None
    links: LinksProcess | None
    operator: ClientCredentials

    def via(self, name: str, url: str) -> str:
        """``url``, or the proxy of the link ``name`` in front of it (``--links``)."""
        return url if self.links is None else self.links.url(name, url)


def _start_sidecar(
    servers: _Servers,
    broker_id: str,
    ports: tuple[int, int],
    children: list[ManagedServer],
) -> SidecarProcess:
    """Start one sidecar (its gRPC and metrics ports given) and wait until it serves."""
    security, spec = servers.security, servers.spec
    own = {} if security is None else security.sidecar_settings(broker_id)
    grpc_port, metrics_port = ports
    sidecar = SidecarProcess(
        servers.state_dir / broker_id,
        broker_id=broker_id,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        cluster=CLUSTER_NAME,
        etcd_endpoint=servers.via(f"{broker_id}/etcd", servers.etcd.client_url),
        pulsar_url=servers.via(f"{broker_id}/channel", servers.pulsar.service_url),
        env=settings_env({**spec.settings, **own}),
        start_timeout_s=SIDECAR_START_TIMEOUT_S,
        credentials=servers.operator,
    )
    children.append(sidecar)
    sidecar.start()
    _log.info("sidecar %s serving at %s", sidecar.broker_id, sidecar.grpc_addr)
    return sidecar


def _start_broker(
    servers: _Servers,
    sidecar: SidecarProcess,
    ports: Iterator[int],
    children: list[ManagedServer],
) -> SimBrokerProcess | FrontProcess:
    """Start the broker beside ``sidecar``: a front (three of ``ports``), or a simulated broker
    when the cluster has no storage."""
    security, spec, storage = servers.security, servers.spec, servers.storage
    env = settings_env(spec.settings)  # with grpc.admin_token set, the broker presents it
    broker_id = sidecar.broker_id
    sidecar_addr = servers.via(f"{broker_id}/sidecar", sidecar.grpc_addr)
    broker: SimBrokerProcess | FrontProcess
    if storage is None:
        broker = SimBrokerProcess(
            sidecar.workdir,
            broker_id=broker_id,
            sidecar_addr=sidecar_addr,
            msg_rate=TRAFFIC_MSG_RATE if spec.traffic else 0.0,
            seed=0,  # one seed for all: a bundle's traffic moves with it
            env=env,
            credentials=INSECURE if security is None else security.broker_credentials(broker_id),
        )
    else:
        broker = FrontProcess(
            sidecar.workdir,
            broker_id=broker_id,
            port=next(ports),
            metrics_port=next(ports),
            web_port=next(ports),
            cluster=CLUSTER_NAME,
            sidecar_addr=sidecar_addr,
            storage_url=servers.via(f"{broker_id}/storage", storage.service_url),
            env=env,
            tls=None if security is None else _front_tls(security, broker_id),
        )
    children.append(broker)
    broker.start()
    return broker


def _node(sidecar: SidecarProcess, broker: SimBrokerProcess | FrontProcess) -> NodeRecord:
    """The record of one started node."""
    front = broker if isinstance(broker, FrontProcess) else None
    return NodeRecord(
        broker_id=sidecar.broker_id,
        grpc_addr=sidecar.grpc_addr,
        metrics_addr=sidecar.metrics_addr,
        sidecar=_record(sidecar.pid, sidecar.log_path),
        broker=_record(broker.pid, broker.log_path),
        events_file=str(broker.events_path),
        service_url=front.service_url if front is not None else "",
        broker_metrics_addr=front.metrics_addr if front is not None else "",
        web_url=front.web_url if front is not None else "",
    )


def _links(
    workdir: Path,
    etcd: EtcdServer,
    pulsar: PulsarLiteServer,
    storage: PulsarLiteServer | None,
    sidecar_ports: dict[str, tuple[int, int]],
) -> LinksProcess:
    """The proxies of every link: each sidecar's to etcd and to the channel, each broker's to
    its sidecar and (a broker front's) to storage."""
    targets = {}
    for broker_id, (grpc_port, _) in sidecar_ports.items():
        targets[f"{broker_id}/etcd"] = _host_port(etcd.client_url)
        targets[f"{broker_id}/channel"] = _host_port(pulsar.service_url)
        targets[f"{broker_id}/sidecar"] = f"{LOOPBACK}:{grpc_port}"
        if storage is not None:
            targets[f"{broker_id}/storage"] = _host_port(storage.service_url)
    ports = iter(free_ports(len(targets) + 1))
    specs = [
        LinkSpec(name, next(ports), target, pulsar=name.endswith(("/channel", "/storage")))
        for name, target in targets.items()
    ]
    return LinksProcess(workdir, specs, next(ports))


def _host_port(url: str) -> str:
    return url.partition("://")[2] or url


def _front_tls(security: DevSecurity, broker_id: str) -> FrontTls:
    files = security.front_files(broker_id)
    return FrontTls(
        ca_file=security.ca_file,
        cert_file=files.cert,
        key_file=files.key,
        sidecar=security.broker_credentials(broker_id),
    )


def _pulsar_client_files(security: DevSecurity) -> dict[str, str]:
    return {
        "ca_file": str(security.ca_file),
        "cert_file": str(security.client.cert),
        "key_file": str(security.client.key),
    }


def _load_args(brokers: list[SimBrokerProcess | FrontProcess], tls: dict[str, str]) -> list[str]:
    """``lbd load`` of the traffic namespace through every broker front."""
    urls = [b.service_url for b in brokers if isinstance(b, FrontProcess)]
    scheme = urls[0].partition("://")[0]
    args = [
        f"--service-url={scheme}://" + ",".join(u.partition("://")[2] for u in urls),
        f"--topics={TRAFFIC_TOPICS}",
        f"--namespace={TRAFFIC_NAMESPACE}",
        f"--rate={TRAFFIC_RATE:g}",
        "--hot-fraction=0.2",
        "--hot-factor=5",
        "--report-every=10",
    ]
    if tls:
        args += [
            f"--tls-ca={tls['ca_file']}",
            f"--tls-cert={tls['cert_file']}",
            f"--tls-key={tls['key_file']}",
        ]
    return args


def _operator_credentials(spec: DevClusterSpec, security: DevSecurity | None) -> ClientCredentials:
    """How the supervisor (and the operator, through ``cluster.json``) calls the sidecars."""
    token = spec.settings.get("grpc.admin_token") or None
    if security is None:
        return ClientCredentials(token=token)
    return dataclasses.replace(security.admin_credentials(), token=token)


def _client_record(credentials: ClientCredentials) -> dict[str, str]:
    named = {
        "ca_file": credentials.ca_file,
        "cert_file": credentials.cert_file,
        "key_file": credentials.key_file,
        "token": credentials.token,
    }
    return {k: str(v) for k, v in named.items() if v is not None}


def _record(pid: int | None, log: Path) -> ProcessRecord:
    if pid is None:
        raise LbdError(f"a process of the dev cluster exited during start-up; see {log}")
    return ProcessRecord(pid=pid, start_ticks=process_start_ticks(pid), log=str(log))


def _wait_registered(clients: list[SidecarClient], brokers: int) -> None:
    """Until every sidecar lists every broker (each simulated broker said Hello)."""
    deadline = time.monotonic() + REGISTRATION_TIMEOUT_S
    pending = list(clients)
    last = "no answer yet"
    while pending:
        client = pending[0]
        try:
            seen = len(client.brokers().brokers)
            last = f"{client.server} lists {seen} of {brokers} brokers"
            if seen == brokers:
                pending.pop(0)
                continue
        except RpcFailure as e:
            last = f"{client.server}: {e}"
        if time.monotonic() >= deadline:
            raise LbdError(f"brokers not all registered within {REGISTRATION_TIMEOUT_S:g}s: {last}")
        time.sleep(_POLL_S)
    _log.info("all %d brokers registered", brokers)


def _assign_every_bundle(clients: list[SidecarClient], bundles: int) -> None:
    """Look up one topic of each bundle of the traffic namespace, spread over the sidecars."""
    namespace = NamespaceName.parse(TRAFFIC_NAMESPACE)
    workload = Workload(WorkloadSpec(topics_per_bundle=1))
    for i, bundle in enumerate(NamespaceBundles.default(namespace, bundles).bundles()):
        (topic,) = workload.topics(bundle.id)
        answer = clients[i % len(clients)].lookup(topic)
        _log.info("%s -> %s on %s", topic, answer.bundle, answer.owner_broker_id)


if __name__ == "__main__":
    sys.exit(main())
