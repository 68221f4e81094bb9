"""A local cluster on loopback ports: ``lbd dev up``, ``lbd dev add`` and ``lbd dev down``.

``up`` starts a detached *supervisor* (:mod:`lbd.devcluster.supervisor`) in a session of its own
and waits until it reports the cluster ready; the supervisor starts etcd, pulsar-lite (the state
channel and load topics), a second pulsar-lite (the storage every broker keeps its topics in), N
sidecars (``lbd serve``) and N broker fronts (``lbd broker``; simulated brokers, ``lbd sim
broker``, with ``--sim-brokers``), each a child that dies with it, with ``--traffic`` real
clients (``lbd load``), writes ``cluster.json`` (every endpoint, pid and log) and then waits for
SIGTERM. ``down`` sends the supervisor SIGTERM, which stops the load, the brokers, the sidecars,
the storage, pulsar-lite and etcd in that order; after a bound it uses SIGKILL, and kills
whatever recorded process is still alive. ``add_brokers`` asks the running supervisor (through a
request file it polls) to start more sidecars and brokers, as a cluster scales out.

The state directory holds everything: ``cluster.json``, ``supervisor.pid``, ``supervisor.log``,
and one directory per process with its data and log. Each ``up`` starts a fresh cluster: the
supervisor removes the previous run's data, keeping nothing but the marker file that tells a
dev-cluster directory from any other.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lbd.broker.credentials import ClientCredentials
from lbd.config import Settings, load_settings
from lbd.core.errors import InvalidInputError, LbdError, NotFoundError, PreconditionError
from lbd.devcluster.processes import settings_env

CLUSTER_NAME = "dev"
DEFAULT_NAMESPACE = "public/default"
"""Created by every sidecar at start (4 bundles)."""
TRAFFIC_NAMESPACE = "public/demo"
"""With ``--traffic``: created with ``namespace_bundles`` bundles, every one of them assigned."""
TRAFFIC_NAMESPACE_BUNDLES = 16
TRAFFIC_MSG_RATE = 120.0
"""Mean messages/s per topic of the simulated brokers with ``--traffic --sim-brokers``: with a
third of ``public/demo`` each, about 40% load on average, unevenly (a few topics are hot)."""
TRAFFIC_TOPICS = 32
"""Topics the real clients of ``--traffic`` produce to and consume, spread over public/demo."""
TRAFFIC_RATE = 20.0
"""Messages/s each of those topics gets (a few topics get more: see ``lbd load``)."""

MARKER = "lbd-dev-cluster"
CLUSTER_FILE = "cluster.json"
PID_FILE = "supervisor.pid"
ADD_REQUEST_FILE = "add-brokers.json"
"""A request to the supervisor to add brokers: ``{"id": ..., "count": N}``."""
ADD_RESULT_FILE = "add-brokers.result.json"
"""The supervisor's answer to the latest request: ``{"id": ..., "error": ""}``."""
MAX_BROKERS = 32
SUPERVISOR_LOG = "supervisor.log"

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 60.0
_POLL_S = 0.1
_LOG_TAIL_LINES = 30

DEV_SETTINGS: Mapping[str, str] = {
    # Failover takes lbd's default timings (a 3 s lease, a 1.5 s grace, docs/safety.md); the
    # monitor's full sweep (stuck in-flight values) comes every second rather than every minute.
    "monitor.interval_s": "1",
    "monitor.inflight_timeout_s": "8",
    # Reports every second and a shedder every five: the live view moves while you watch.
    "load_report.interval_s": "1",
    "shedding.interval_s": "5",
    # Three brokers with a few dozen bundles rarely spread past Pulsar's 0.25: aim tighter.
    "shedding.target_std": "0.1",
    "shedding.load_data_ttl_s": "10",
    "shedding.cooldown_s": "10",
    "shedding.bundle_grace_period_s": "30",
    "split.interval_s": "5",
    "checkpoint.interval_s": "30",
    "grpc.shutdown_grace_s": "1",
}
"""Settings of every sidecar of a dev cluster (dotted keys), before ``--set`` overrides."""


def dev_settings() -> Settings:
    """The settings a dev cluster's sidecars run with (before ``--set`` overrides)."""
    return load_settings(None, env={}, overrides=dict(DEV_SETTINGS))


@dataclass(frozen=True, slots=True)
class DevClusterSpec:
    """What ``lbd dev up`` starts."""

    brokers: int = 3
    traffic: bool = False
    """Simulated brokers produce load, and every bundle of ``public/demo`` is assigned."""
    settings: Mapping[str, str] = field(default_factory=lambda: dict(DEV_SETTINGS))
    namespace_bundles: int = TRAFFIC_NAMESPACE_BUNDLES
    secure: bool = False
    """TLS and authentication everywhere: etcd, the sidecars' API, brokers, ``lbd ctl``
    (:mod:`lbd.devcluster.secure`)."""
    sim_brokers: bool = False
    """Simulated brokers (synthetic load, no clients) instead of broker fronts: for the
    benchmarks of thousands of bundles."""
    links: bool = False
    """Every link between the cluster's processes behind a proxy that can cut it
    (:mod:`lbd.devcluster.links`)."""

    def __post_init__(self) -> None:
        if not 1 <= self.brokers <= MAX_BROKERS:
            raise InvalidInputError(
                f"--brokers must be between 1 and {MAX_BROKERS}, got {self.brokers}"
            )
        if self.namespace_bundles < 1:
            raise InvalidInputError(f"namespace bundles must be >= 1, got {self.namespace_bundles}")

    def with_overrides(self, pairs: list[str]) -> DevClusterSpec:
        """The spec with ``section.key=value`` pairs (``--set``) added to its settings."""
        settings = dict(self.settings)
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or key.count(".") != 1 or not all(key.split(".")):
                raise InvalidInputError(f"--set expects section.key=value, got {pair!r}")
            settings[key.strip()] = value.strip()
        return DevClusterSpec(
            self.brokers,
            self.traffic,
            settings,
            self.namespace_bundles,
            self.secure,
            self.sim_brokers,
            self.links,
        )

    def to_args(self) -> list[str]:
        """The spec as supervisor command-line arguments."""
        args = [f"--brokers={self.brokers}", f"--namespace-bundles={self.namespace_bundles}"]
        if self.traffic:
            args.append("--traffic")
        if self.secure:
            args.append("--secure")
        if self.sim_brokers:
            args.append("--sim-brokers")
        if self.links:
            args.append("--links")
        args.extend(f"--set={k}={v}" for k, v in self.settings.items())
        return args


@dataclass(frozen=True, slots=True)
class ProcessRecord:
    """One process of the cluster: its pid, its start time (to tell it from a reused pid) and
    its log file."""

    pid: int
    start_ticks: int | None
    log: str


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """One broker of the cluster: its sidecar, its broker (a front, or a simulated one) and
    their addresses."""

    broker_id: str
    grpc_addr: str
    metrics_addr: str
    sidecar: ProcessRecord
    broker: ProcessRecord
    events_file: str
    service_url: str = ""
    """What a Pulsar client connects to (empty for a simulated broker, which serves nothing)."""
    broker_metrics_addr: str = ""
    """The broker front's /metrics (empty for a simulated broker)."""
    web_url: str = ""
    """The broker front's web service, Pulsar's REST API (empty for a simulated broker)."""


@dataclass(frozen=True, slots=True)
class DevCluster:
    """What ``cluster.json`` records about a running dev cluster."""

    cluster: str
    state_dir: str
    etcd_endpoint: str
    pulsar_url: str
    supervisor: ProcessRecord
    etcd: ProcessRecord
    pulsar: ProcessRecord
    nodes: tuple[NodeRecord, ...]
    settings: dict[str, str]
    client: dict[str, str] = field(default_factory=dict)
    """How an operator reaches the sidecars: ``ca_file``, ``cert_file``, ``key_file`` of the
    admin's certificate (a secure cluster), ``token`` (``grpc.admin_token`` set); empty when
    the sidecars authenticate nobody."""
    storage_url: str = ""
    """The storage server the broker fronts keep topics in (empty with simulated brokers)."""
    storage: ProcessRecord | None = None
    load: ProcessRecord | None = None
    """``lbd load``, with ``--traffic`` and broker fronts."""
    pulsar_client: dict[str, str] = field(default_factory=dict)
    """How a Pulsar client reaches the brokers of a secure cluster: ``ca_file``, ``cert_file``,
    ``key_file``; empty for plaintext."""
    links_control: str = ""
    """With ``--links``: the control address of the links' proxies (``lbd dev link``)."""
    links: dict[str, str] = field(default_factory=dict)
    """With ``--links``: each link's name and the server it leads to."""
    links_process: ProcessRecord | None = None

    @property
    def service_url(self) -> str:
        """One Pulsar service URL naming every broker front (clients look up through any)."""
        urls = [n.service_url for n in self.nodes if n.service_url]
        if not urls:
            return ""
        scheme = urls[0].partition("://")[0]
        return f"{scheme}://" + ",".join(u.partition("://")[2] for u in urls)

    def credentials(self) -> ClientCredentials:
        """The admin's client credentials (see :attr:`client`)."""
        c = self.client

        def path(key: str) -> Path | None:
            return Path(c[key]) if c.get(key) else None

        return ClientCredentials(
            ca_file=path("ca_file"),
            cert_file=path("cert_file"),
            key_file=path("key_file"),
            token=c.get("token") or None,
        )

    def node(self, broker_id: str | None = None) -> NodeRecord:
        """The node of ``broker_id`` (None: the first); NotFoundError when there is none."""
        for node in self.nodes:
            if broker_id is None or node.broker_id == broker_id:
                return node
        known = ", ".join(n.broker_id for n in self.nodes)
        raise NotFoundError(f"no broker {broker_id!r} in the dev cluster (brokers: {known})")

    def processes(self) -> list[ProcessRecord]:
        """Every process, in stopping order: load, brokers, sidecars, links, storage,
        pulsar-lite, etcd."""
        return [
            *([self.load] if self.load is not None else []),
            *(n.broker for n in self.nodes),
            *(n.sidecar for n in self.nodes),
            *([self.links_process] if self.links_process is not None else []),
            *([self.storage] if self.storage is not None else []),
            self.pulsar,
            self.etcd,
        ]

    def to_json(self) -> str:
        """The ``cluster.json`` text."""
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> DevCluster:
        """Parse ``cluster.json``; InvalidInputError when it is not one."""
        try:
            data = json.loads(text)
            return cls(
                cluster=data["cluster"],
                state_dir=data["state_dir"],
                etcd_endpoint=data["etcd_endpoint"],
                pulsar_url=data["pulsar_url"],
                supervisor=ProcessRecord(**data["supervisor"]),
                etcd=ProcessRecord(**data["etcd"]),
                pulsar=ProcessRecord(**data["pulsar"]),
                nodes=tuple(
                    NodeRecord(
                        **{
                            **n,
                            "sidecar": ProcessRecord(**n["sidecar"]),
                            "broker": ProcessRecord(**n["broker"]),
                        }
                    )
                    for n in data["nodes"]
                ),
                settings=dict(data["settings"]),
                client=dict(data.get("client", {})),
                storage_url=data.get("storage_url", ""),
                storage=_optional_record(data.get("storage")),
                load=_optional_record(data.get("load")),
                pulsar_client=dict(data.get("pulsar_client", {})),
                links_control=data.get("links_control", ""),
                links=dict(data.get("links", {})),
                links_process=_optional_record(data.get("links_process")),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidInputError(f"not a dev cluster record: {e}") from None


def _optional_record(data: dict[str, object] | None) -> ProcessRecord | None:
    return None if data is None else ProcessRecord(**data)  # type: ignore[arg-type]


def _stat_fields(stat: Path) -> list[str] | None:
    """The fields of a ``/proc/.../stat`` file after the command name (the state first); None
    when it cannot be read."""
    try:
        text = stat.read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return text.rpartition(")")[2].split()


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), None if unknown."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def is_alive(record: ProcessRecord) -> bool:
    """Whether the recorded process still runs (and is not a reused pid or a zombie)."""
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # a pid reused by another user's process
    if _zombie(Path(f"/proc/{record.pid}")):
        return False
    ticks = process_start_ticks(record.pid)
    return record.start_ticks is None or ticks is None or ticks == record.start_ticks


def _zombie(proc: Path) -> bool:
    """Whether every thread of the process at ``proc`` (``/proc/<pid>``) has exited. The main
    thread of a process that is exiting shows as a zombie while its other threads still run,
    holding its files (a storage server's lock among them) until the last of them is gone."""
    try:
        tasks = list((proc / "task").iterdir())
    except OSError:
        tasks = [proc]
    for task in tasks:
        fields = _stat_fields(task / "stat")
        if fields and fields[0] not in ("Z", "X"):
            return False
    return True


def load_cluster(state_dir: Path) -> DevCluster:
    """The record of the cluster running from ``state_dir``; NotFoundError if none is up."""
    path = state_dir / CLUSTER_FILE
    try:
        return DevCluster.from_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NotFoundError(
            f"no dev cluster is up in {state_dir} (start one with: lbd dev up --state-dir "
            f"{state_dir})"
        ) from None
    except InvalidInputError as e:
        raise InvalidInputError(f"{path}: {e}") from None


def up(state_dir: Path, spec: DevClusterSpec, timeout_s: float = START_TIMEOUT_S) -> DevCluster:
    """Start a dev cluster from ``state_dir`` and return its record once it is ready.

    Raises InvalidInputError for a state dir that is not a dev cluster's or for bad settings,
    PreconditionError when a cluster is already up there, LbdError (with the supervisor's log)
    when it fails to start; a failed start leaves nothing running.
    """
    _check_settings(spec)
    state_dir = _prepare_state_dir(state_dir)
    launcher = subprocess.run(
        [
            sys.executable,
            "-m",
            "lbd.devcluster.supervisor",
            f"--state-dir={state_dir}",
            *spec.to_args(),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        check=False,
    )
    if launcher.returncode != 0:
        raise LbdError(f"cannot start the dev cluster: {launcher.stderr.decode().strip()}")
    supervisor = _read_pid(state_dir)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            with contextlib.suppress(NotFoundError):
                return load_cluster(state_dir)
            if supervisor is None or not _pid_alive(supervisor):
                raise LbdError(f"the dev cluster failed to start{_log_tail(state_dir)}")
            if time.monotonic() >= deadline:
                raise LbdError(
                    f"the dev cluster was not ready within {timeout_s:g}s{_log_tail(state_dir)}"
                )
            time.sleep(_POLL_S)
    except BaseException:
        down(state_dir)  # a half-started cluster (or Ctrl-C while waiting) leaves nothing behind
        raise


def write_whole(path: Path, text: str) -> None:
    """Write ``path`` at once: a reader sees the old file (or none) or the new one, never half."""
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def add_brokers(state_dir: Path, count: int, timeout_s: float = START_TIMEOUT_S) -> DevCluster:
    """Add ``count`` brokers (a sidecar and a broker each, named after the last) to the dev
    cluster running from ``state_dir``; return its record once every sidecar lists them.

    The supervisor starts them as it started the others (they stop with the cluster). Raises
    NotFoundError when no cluster is up there, InvalidInputError for a count past
    :data:`MAX_BROKERS` in all, LbdError (with the supervisor's log) when they fail to start or
    the cluster is ``--secure`` or ``--links`` (whose certificates and proxies are made at
    start-up).
    """
    cluster = load_cluster(state_dir)
    total = len(cluster.nodes) + count
    if count < 1 or total > MAX_BROKERS:
        raise InvalidInputError(
            f"can add 1 to {MAX_BROKERS - len(cluster.nodes)} brokers to this cluster of "
            f"{len(cluster.nodes)}, not {count}"
        )
    supervisor = _read_pid(state_dir)
    request_id = f"{os.getpid()}-{time.monotonic_ns()}"
    request = state_dir / ADD_REQUEST_FILE
    write_whole(request, json.dumps({"id": request_id, "count": count}))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            answer = json.loads((state_dir / ADD_RESULT_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            answer = {}
        if answer.get("id") == request_id:
            if answer.get("error"):
                raise LbdError(f"cannot add brokers: {answer['error']}{_log_tail(state_dir)}")
            return load_cluster(state_dir)
        if supervisor is None or not _pid_alive(supervisor):
            raise LbdError(f"the dev cluster stopped while adding brokers{_log_tail(state_dir)}")
        if time.monotonic() >= deadline:
            request.unlink(missing_ok=True)
            raise LbdError(
                f"{count} brokers were not added within {timeout_s:g}s{_log_tail(state_dir)}"
            )
        time.sleep(_POLL_S)


def down(state_dir: Path, timeout_s: float = STOP_TIMEOUT_S) -> bool:
    """Stop the dev cluster of ``state_dir``; False when nothing was running. Idempotent."""
    if not (state_dir / MARKER).exists():
        return False
    stopped = False
    pid = _read_pid(state_dir)
    if pid is not None and _pid_alive(pid):
        stopped = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if _pid_alive(pid):
            # Its children die with it (PR_SET_PDEATHSIG); the sweep below catches the rest.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(NotFoundError, InvalidInputError):
        for record in load_cluster(state_dir).processes():
            if is_alive(record):
                stopped = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(record.pid, signal.SIGKILL)
    for name in (CLUSTER_FILE, PID_FILE, ADD_REQUEST_FILE, ADD_RESULT_FILE):
        (state_dir / name).unlink(missing_ok=True)
    return stopped


def _check_settings(spec: DevClusterSpec) -> None:
    # The sidecars would each report the same problems in their logs; report them here, once.
    env = settings_env(spec.settings)
    load_settings(None, env=env, overrides={"broker.broker_id": "broker-1"})


def _prepare_state_dir(state_dir: Path) -> Path:
    if state_dir.exists() and not state_dir.is_dir():
        raise InvalidInputError(f"state dir {state_dir} exists and is not a directory")
    if state_dir.is_dir() and any(state_dir.iterdir()) and not (state_dir / MARKER).exists():
        raise InvalidInputError(
            f"state dir {state_dir} is not empty and is not a dev cluster's (no {MARKER} file): "
            "choose a new or empty directory"
        )
    pid = _read_pid(state_dir) if state_dir.is_dir() else None
    if pid is not None and _pid_alive(pid):
        raise PreconditionError(
            f"a dev cluster is already up in {state_dir} (supervisor pid {pid}); stop it with: "
            f"lbd dev down --state-dir {state_dir}"
        )
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / MARKER).write_text("a local lbd cluster's state (lbd dev up)\n")
    down(state_dir)  # leftovers of a supervisor that was killed
    return state_dir.resolve()


def _read_pid(state_dir: Path) -> int | None:
    try:
        return int((state_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    return is_alive(ProcessRecord(pid, None, ""))


def _log_tail(state_dir: Path) -> str:
    path = state_dir / SUPERVISOR_LOG
    try:
        lines = path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
    except OSError:
        return ""
    return f"; last lines of {path}:\n" + "\n".join(lines) if lines else ""
