"""Real etcd and pulsar-lite servers run as child processes, for tests and local clusters.

Each server listens on free loopback ports and keeps its data, config and log in one working
directory (a fresh temporary one unless given). Besides start and stop, a server can be frozen
(SIGSTOP: the process stays, sockets accept but nothing answers — a hung or partitioned server),
thawed, killed with SIGKILL (a crash) and restarted on the same ports and data, so tests can inject
outages the way an operator meets them.

Children are put in their own session, so a Ctrl-C in the terminal reaches only the parent, which
stops them at exit. On Linux they also get ``PR_SET_PDEATHSIG`` (through ``setpriv``), so even a
SIGKILL of the parent leaves no server behind. The objects are synchronous and are meant to be
driven from one thread.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import http.client
import importlib.util
import json
import os
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self

from lbd.core.errors import LbdError
from lbd.devcluster.pki import CertFiles
from lbd.devcluster.ports import LOOPBACK, free_port, free_ports

DEFAULT_START_TIMEOUT_S = 15.0
DEFAULT_STOP_TIMEOUT_S = 5.0
_PROBE_INTERVAL_S = 0.05
_PROBE_TIMEOUT_S = 0.5
_LOG_TAIL_LINES = 30


class ServerError(LbdError):
    """A managed server could not be found, started, made healthy or controlled."""


class ManagedServer(abc.ABC):
    """A server process owned by this process: started, probed, disturbed and stopped on demand.

    Subclasses say how to run the server (:meth:`_command`) and how to tell that it serves
    (:meth:`_probe`). Stopping keeps the working directory, so :meth:`start` after :meth:`stop` or
    :meth:`kill` brings back the same server with its data; :meth:`close` stops it for good and
    removes a temporary working directory.
    """

    name: ClassVar[str]

    def __init__(
        self,
        binary: Path,
        workdir: Path | None,
        *,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
    ) -> None:
        self._binary = binary
        self._owns_workdir = workdir is None
        if workdir is None:
            workdir = Path(tempfile.mkdtemp(prefix=f"lbd-{self.name}-"))
        else:
            workdir.mkdir(parents=True, exist_ok=True)
        self._workdir = workdir.resolve()
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._frozen = False
        self._closed = False
        _open_servers.add(self)

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """Where clients reach the server, as a URL."""

    @abc.abstractmethod
    def _command(self) -> list[str]:
        """The command line that runs the server in the foreground."""

    @abc.abstractmethod
    def _probe(self, timeout_s: float) -> bool:
        """One health check, answering within about ``timeout_s``; never raises."""

    def _environment(self) -> Mapping[str, str]:
        """The child's environment."""
        return os.environ

    @property
    def host(self) -> str:
        """The host clients connect to: servers listen on loopback only."""
        return LOOPBACK

    @property
    def workdir(self) -> Path:
        """The directory holding the server's data, config and log."""
        return self._workdir

    @property
    def log_path(self) -> Path:
        """The server's combined stdout and stderr; each start appends to it."""
        return self._workdir / f"{self.name}.log"

    @property
    def pid(self) -> int | None:
        """The process id while the server runs, else None."""
        return self._process.pid if self.is_running and self._process is not None else None

    @property
    def is_running(self) -> bool:
        """Whether the process exists (frozen counts as running)."""
        return self._process is not None and self._process.poll() is None

    @property
    def is_frozen(self) -> bool:
        """Whether the process is stopped by :meth:`freeze`."""
        return self.is_running and self._frozen

    def is_healthy(self, timeout_s: float = _PROBE_TIMEOUT_S) -> bool:
        """One health check of a running server; False when it is down or does not answer."""
        return self.is_running and self._probe(timeout_s)

    def start(self, timeout_s: float | None = None) -> None:
        """Start the server and wait until it is healthy; no-op if it already runs.

        On failure the process is stopped and :class:`ServerError` carries the tail of the log.
        """
        if self._closed:
            raise ServerError(f"{self.name} at {self.endpoint} is closed and cannot start again")
        if self.is_running:
            return
        command = [*die_with_parent_prefix(), *self._command()]
        with self.log_path.open("ab") as log:
            log.write(f"--- lbd: starting {' '.join(command)}\n".encode())
            log.flush()
            try:
                self._process = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self._workdir,
                    env=dict(self._environment()),
                    start_new_session=True,
                )
            except OSError as e:
                raise ServerError(f"cannot run {self.name} ({self._binary}): {e}") from e
        self._frozen = False
        try:
            self.wait_healthy(self._start_timeout_s if timeout_s is None else timeout_s)
        except BaseException:
            self.kill()
            raise

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until a health check passes; raise :class:`ServerError` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            process = self._process
            if process is None:
                raise ServerError(f"{self.name} at {self.endpoint} is not running")
            code = process.poll()
            if code is not None:
                self._forget_process()
                raise ServerError(
                    f"{self.name} exited with code {code} before it became healthy at "
                    f"{self.endpoint}{self._log_excerpt()}"
                )
            remaining = deadline - time.monotonic()
            if self._probe(max(min(_PROBE_TIMEOUT_S, remaining), _PROBE_INTERVAL_S)):
                return
            if time.monotonic() >= deadline:
                raise ServerError(
                    f"{self.name} did not become healthy at {self.endpoint} within "
                    f"{timeout_s:g}s{self._log_excerpt()}"
                )
            time.sleep(_PROBE_INTERVAL_S)

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop gracefully (SIGTERM, then SIGKILL after ``timeout_s``); idempotent."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            self._signal(signal.SIGTERM)
            if self._frozen:
                # A stopped process acts on SIGTERM only once it runs again.
                self._signal(signal.SIGCONT)
            try:
                process.wait(self._stop_timeout_s if timeout_s is None else timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                process.wait()
        self._forget_process()

    def kill(self) -> None:
        """Kill with SIGKILL, as a crash would; the data stays for :meth:`restart`. Idempotent."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            self._signal(signal.SIGKILL)
            process.wait()
        self._forget_process()

    def freeze(self) -> None:
        """Suspend the process (SIGSTOP): it holds its ports and data but answers nothing.

        Returns once every thread is stopped: SIGSTOP lands asynchronously, and a request sent
        right after the signal could otherwise still be answered.
        """
        self._require_running("freeze")
        self._signal(signal.SIGSTOP)
        self._frozen = True
        self._wait_all_threads_stopped()

    def _wait_all_threads_stopped(self, timeout_s: float = 2.0) -> None:
        assert self.pid is not None
        if not wait_stopped(self.pid, timeout_s):
            raise ServerError(f"{self} did not stop after SIGSTOP")

    def thaw(self) -> None:
        """Resume a frozen process (SIGCONT); harmless if it runs already."""
        self._require_running("thaw")
        self._signal(signal.SIGCONT)
        self._frozen = False

    def restart(self, timeout_s: float | None = None) -> None:
        """Stop if running, then start again on the same ports with the same data."""
        self.stop()
        self.start(timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop for good and remove the working directory if it is a temporary one; idempotent."""
        self.stop(timeout_s)
        if self._owns_workdir and not self._closed:
            shutil.rmtree(self._workdir, ignore_errors=True)
        self._closed = True
        _open_servers.discard(self)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the server's log ('' if there is none yet)."""
        try:
            with self.log_path.open("rb") as log:
                text = log.read().decode(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "frozen" if self.is_frozen else "running" if self.is_running else "stopped"
        return f"<{type(self).__name__} {self.endpoint} {state} pid={self.pid}>"

    def _signal(self, sig: signal.Signals) -> None:
        # Only called while the child is unreaped, so its pid (= its process group) is not reused.
        assert self._process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, sig)

    def _require_running(self, action: str) -> None:
        if not self.is_running:
            raise ServerError(f"cannot {action} {self.name} at {self.endpoint}: it is not running")

    def _forget_process(self) -> None:
        self._process = None
        self._frozen = False

    def _log_excerpt(self) -> str:
        tail = self.log_tail()
        if not tail:
            return f" (log {self.log_path} is empty)"
        return f"; last lines of {self.log_path}:\n{tail}"


class EtcdServer(ManagedServer):
    """A single-member etcd cluster on loopback ports.

    Raft timing defaults to 5x faster than etcd's own (100 ms heartbeat, 1000 ms election): the
    member elects itself in about a tenth of a second instead of a second, and the shortest lease
    etcd grants (1.5 election timeouts, rounded up) is 1 s instead of 2 s.

    Optionally secure: ``tls`` (the server's certificate and key) makes the client port speak
    TLS only (``client_url`` is then ``https://``); ``client_ca_file`` with it requires client
    certificates signed by that CA (``--client-cert-auth``). ``root_password`` turns etcd's
    authentication on after the first start: user ``root`` with that password and the root role,
    then ``auth enable`` (through ``etcdctl``); a restart finds it on already.
    ``auth_token_ttl_s`` is how long etcd keeps an unused token (etcd's default, 300 s, if None);
    a short one makes clients meet expired tokens.

    The health probe and :meth:`etcdctl` present the server's own certificate as their client
    certificate, so ``tls.cert`` must be good for client authentication too (:meth:`DevPki.issue`
    makes every certificate so) and signed by ``client_ca_file``. The raft peer port stays
    plaintext: it is loopback-only and has a single member.
    """

    name = "etcd"

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        client_port: int | None = None,
        peer_port: int | None = None,
        heartbeat_interval_ms: int = 50,
        election_timeout_ms: int = 250,
        tls: CertFiles | None = None,
        client_ca_file: Path | None = None,
        root_password: str | None = None,
        auth_token_ttl_s: int | None = None,
        binary: Path | None = None,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
    ) -> None:
        if client_ca_file is not None and tls is None:
            raise ServerError("etcd: client_ca_file needs tls (a server certificate)")
        if root_password == "":
            raise ServerError("etcd: root_password must not be empty")
        resolved = _check_binary(binary) if binary is not None else find_etcd()
        self._tls = tls
        self._client_ca_file = client_ca_file
        self._root_password = root_password
        self._auth_token_ttl_s = auth_token_ttl_s
        if client_port is None or peer_port is None:
            spare = iter(free_ports(2))
            client_port = client_port if client_port is not None else next(spare)
            peer_port = peer_port if peer_port is not None else next(spare)
        self._client_port = client_port
        self._peer_port = peer_port
        self._heartbeat_interval_ms = heartbeat_interval_ms
        self._election_timeout_ms = election_timeout_ms
        super().__init__(
            resolved, workdir, start_timeout_s=start_timeout_s, stop_timeout_s=stop_timeout_s
        )

    @property
    def port(self) -> int:
        """The client port."""
        return self._client_port

    @property
    def client_url(self) -> str:
        """The client URL, as given to ``--etcd-endpoints``: ``https://`` with ``tls``."""
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://{LOOPBACK}:{self._client_port}"

    @property
    def tls(self) -> CertFiles | None:
        """The server's certificate and key, if the client port speaks TLS."""
        return self._tls

    @property
    def client_ca_file(self) -> Path | None:
        """The CA that client certificates must chain to, if etcd requires them."""
        return self._client_ca_file

    @property
    def root_password(self) -> str | None:
        """The password of etcd user ``root``, if authentication is on."""
        return self._root_password

    @property
    def peer_url(self) -> str:
        """The raft peer URL."""
        return f"http://{LOOPBACK}:{self._peer_port}"

    @property
    def endpoint(self) -> str:
        return self.client_url

    @property
    def data_dir(self) -> Path:
        """etcd's data directory."""
        return self.workdir / "data"

    def _command(self) -> list[str]:
        # The --initial-* flags matter only for a new data dir; etcd ignores them on a restart.
        return [
            str(self._binary),
            "--name=default",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster=default={self.peer_url}",
            "--initial-cluster-state=new",
            f"--heartbeat-interval={self._heartbeat_interval_ms}",
            f"--election-timeout={self._election_timeout_ms}",
            "--logger=zap",
            "--log-outputs=stderr",
            *self._security_flags(),
        ]

    def _security_flags(self) -> list[str]:
        flags = []
        if self._tls is not None:
            flags += [f"--cert-file={self._tls.cert}", f"--key-file={self._tls.key}"]
        if self._client_ca_file is not None:
            flags += [f"--trusted-ca-file={self._client_ca_file}", "--client-cert-auth"]
        if self._auth_token_ttl_s is not None:
            flags.append(f"--auth-token-ttl={self._auth_token_ttl_s}")
        return flags

    def _environment(self) -> Mapping[str, str]:
        # etcd reads every flag from ETCD_* too (etcdctl from ETCDCTL_*); a developer's own
        # settings must not leak in.
        return {k: v for k, v in os.environ.items() if not k.startswith(("ETCD_", "ETCDCTL_"))}

    def start(self, timeout_s: float | None = None) -> None:
        """Start as :meth:`ManagedServer.start` does, then turn authentication on if asked."""
        if self.is_running:
            return
        super().start(timeout_s)
        if self._root_password is None:
            return
        try:
            self._enable_auth(self._root_password)
        except BaseException:
            self.kill()
            raise

    def _enable_auth(self, password: str) -> None:
        # As root first: that succeeds when auth is on already (a restart) and when root exists
        # with auth off (a start that stopped half-way); only a new etcd needs the user made.
        try:
            self.etcdctl("auth", "enable")
            return
        except ServerError:
            pass
        new_user = ("user", "add", "root", "--interactive=false", f"--new-user-password={password}")
        self.etcdctl(*new_user, as_root=False)
        # etcdctl's auth enable also makes the root role and grants it to root.
        self.etcdctl("auth", "enable")

    def etcdctl(self, *args: str, as_root: bool = True) -> str:
        """Run ``etcdctl`` (v3 API) against this server and return its output.

        It presents the server's certificate when etcd requires client certificates, and logs in
        as ``root`` when ``as_root`` and authentication is configured. :class:`ServerError` with
        the output if it fails.
        """
        command = [str(find_etcdctl()), f"--endpoints={self.client_url}", "--dial-timeout=2s"]
        if self._tls is not None:
            command.append(
                f"--cacert={self._client_ca_file}"
                if self._client_ca_file is not None
                else "--insecure-skip-tls-verify"
            )
            if self._client_ca_file is not None:
                command += [f"--cert={self._tls.cert}", f"--key={self._tls.key}"]
        if as_root and self._root_password is not None:
            command.append(f"--user=root:{self._root_password}")
        try:
            done = subprocess.run(
                [*command, *args],
                env={**self._environment(), "ETCDCTL_API": "3"},
                capture_output=True,
                timeout=self._start_timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            # Not str(e): it quotes the command line, password included.
            raise ServerError(
                f"etcdctl {' '.join(args[:2])} against {self.client_url}: no answer within "
                f"{self._start_timeout_s:g}s"
            ) from e
        except OSError as e:
            raise ServerError(f"cannot run etcdctl: {e}") from e
        if done.returncode != 0:
            raise ServerError(
                f"etcdctl {' '.join(args[:2])} against {self.client_url} failed with code "
                f"{done.returncode}: {done.stderr.decode(errors='replace').strip()}"
            )
        return done.stdout.decode(errors="replace")

    def _probe(self, timeout_s: float) -> bool:
        # http.client, not urllib: urllib would honour an http_proxy meant for the outside world.
        # /health answers without credentials even when authentication is on.
        conn: http.client.HTTPConnection
        if self._tls is None:
            conn = http.client.HTTPConnection(LOOPBACK, self._client_port, timeout=timeout_s)
        else:
            try:
                context = self._probe_tls()
            except OSError:  # the certificate files are gone or broken (ssl.SSLError included)
                return False
            conn = http.client.HTTPSConnection(
                LOOPBACK, self._client_port, timeout=timeout_s, context=context
            )
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            body = json.loads(response.read())
        except (OSError, http.client.HTTPException, ValueError):
            return False
        finally:
            conn.close()
        return response.status == 200 and isinstance(body, dict) and body.get("health") == "true"

    def _probe_tls(self) -> ssl.SSLContext:
        # A liveness probe of our own child on loopback: it need not verify the server, only
        # present the certificate etcd requires (the server's own, made again for each probe so a
        # renewed one is used).
        assert self._tls is not None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        if self._client_ca_file is not None:
            context.load_cert_chain(self._tls.cert, self._tls.key)
        return context


class PulsarLiteServer(ManagedServer):
    """A pulsar-lite broker (the Pulsar binary protocol over RocksDB) on a loopback port."""

    name = "pulsar-lite"

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        port: int | None = None,
        binary: Path | None = None,
        log_level: str = "info",
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
    ) -> None:
        resolved = _check_binary(binary) if binary is not None else find_pulsar_lite()
        self._port = port if port is not None else free_port()
        self._log_level = log_level
        super().__init__(
            resolved, workdir, start_timeout_s=start_timeout_s, stop_timeout_s=stop_timeout_s
        )
        # Without a config file pulsar-lite serves metrics on 0.0.0.0:8080, which would clash
        # between servers and open a port to the outside.
        self.config_path.write_text(
            "# Written by lbd devcluster: no metrics endpoint, only the broker port is opened.\n"
            "[metrics]\n"
            "enabled = false\n"
        )

    @property
    def port(self) -> int:
        """The broker's port."""
        return self._port

    @property
    def service_url(self) -> str:
        """The ``pulsar://`` URL clients connect to."""
        return f"pulsar://{LOOPBACK}:{self._port}"

    @property
    def endpoint(self) -> str:
        return self.service_url

    @property
    def config_path(self) -> Path:
        """The broker config file, written when the server object is made."""
        return self.workdir / "pulsar-lite.toml"

    @property
    def db_path(self) -> Path:
        """The ``--db-path`` given to the broker (it stores its RocksDB beside it, ``.rocksdb``)."""
        return self.workdir / "data"

    def _command(self) -> list[str]:
        return [
            str(self._binary),
            f"--addr={LOOPBACK}:{self._port}",
            f"--db-path={self.db_path}",
            f"--config={self.config_path}",
            f"--log-level={self._log_level}",
        ]

    def _probe(self, timeout_s: float) -> bool:
        return pulsar_handshake(self._port, timeout_s)


def pulsar_handshake(port: int, timeout_s: float, tls: ssl.SSLContext | None = None) -> bool:
    """Whether a Pulsar server on the loopback ``port`` answers CONNECT with CONNECTED.

    A TCP connect alone would pass on a frozen server (the kernel accepts into the backlog), so
    the probe completes the handshake. Never raises."""
    try:
        with contextlib.ExitStack() as stack:
            sock = stack.enter_context(
                socket.create_connection((LOOPBACK, port), timeout=timeout_s)
            )
            if tls is not None:
                sock = stack.enter_context(tls.wrap_socket(sock, server_hostname=LOOPBACK))
            sock.sendall(_PULSAR_CONNECT_FRAME)
            _total_size, command_size = struct.unpack(">II", _recv_exactly(sock, 8))
            if command_size > _MAX_PROBE_COMMAND_SIZE:
                return False
            command = _recv_exactly(sock, command_size)
    except (OSError, ssl.SSLError):
        return False
    return command.startswith(_PULSAR_CONNECTED_PREFIX)


def find_etcd() -> Path:
    """The ``etcd`` executable on PATH, or :class:`ServerError` saying how to install it."""
    found = shutil.which("etcd")
    if found is None:
        raise ServerError(
            "etcd not found on PATH: install etcd-server (`make setup` runs scripts/ensure-etcd.sh)"
        )
    return Path(found)


def find_etcdctl() -> Path:
    """The ``etcdctl`` executable on PATH, or :class:`ServerError` saying how to install it."""
    found = shutil.which("etcdctl")
    if found is None:
        raise ServerError("etcdctl not found on PATH: install etcd-client")
    return Path(found)


def find_pulsar_lite() -> Path:
    """The broker executable shipped inside the installed ``pulsar_lite`` package."""
    # find_spec locates the package without importing it (its __init__ imports the Pulsar client).
    spec = importlib.util.find_spec("pulsar_lite")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("pulsar-lite not installed: install the pulsar-lite package (make setup)")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    return _check_binary(package_dir / "bin" / "pulsar-lite")


def _check_binary(path: Path) -> Path:
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ServerError(f"server executable missing or not executable: {path}")
    return path


def wait_stopped(pid: int, timeout_s: float = 2.0) -> bool:
    """Whether every thread of ``pid`` is stopped (SIGSTOP lands asynchronously) within
    ``timeout_s``; True at once where /proc is not there to look at."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        return True
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for stat in tasks.glob("*/stat"):
            with contextlib.suppress(OSError):
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        if states and all(state in ("T", "t") for state in states):
            return True
        time.sleep(0.005)
    return False


def die_with_parent_prefix() -> list[str]:
    """A command prefix that makes the child get SIGKILL when its parent dies (Linux only).

    util-linux's ``setpriv`` sets PR_SET_PDEATHSIG and then execs the server, which keeps it (and
    the pid). Not a ``preexec_fn``: running Python in a child forked from a process with many
    threads (gRPC, the Pulsar client, a Spark gateway) can deadlock before the exec. The kernel
    ties PDEATHSIG to the forking *thread*, so it is set only for children started from the main
    thread; other children, and machines without ``setpriv``, still stop at interpreter exit.
    """
    if not sys.platform.startswith("linux"):
        return []
    if threading.current_thread() is not threading.main_thread():
        return []
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _pulsar_connect_frame() -> bytes:
    """A Pulsar ``BaseCommand{type: CONNECT, connect: {client_version, protocol_version}}`` frame.

    Hand-encoded protobuf (tag = field << 3 | wire type) so the probe needs no Pulsar bindings.
    """
    client_version = b"lbd-devcluster-probe"
    connect = (
        b"\x0a" + _varint(len(client_version)) + client_version  # 1: client_version
        + b"\x20" + _varint(15)  # 4: protocol_version
    )  # fmt: skip
    command = b"\x08" + _varint(2) + b"\x12" + _varint(len(connect)) + connect  # 1: CONNECT, 2: ...
    return struct.pack(">II", len(command) + 4, len(command)) + command


_PULSAR_CONNECT_FRAME = _pulsar_connect_frame()
_PULSAR_CONNECTED_PREFIX = b"\x08\x03"  # BaseCommand.type (field 1) = CONNECTED (3)
_MAX_PROBE_COMMAND_SIZE = 64 * 1024


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("connection closed during the handshake")
        data += chunk
    return bytes(data)


# Servers not yet closed: their process may run and their temporary directory may exist.
_open_servers: set[ManagedServer] = set()


@atexit.register
def _close_all_at_exit() -> None:
    for server in list(_open_servers):
        server.close(timeout_s=2.0)
