"""The settings schema: one frozen pydantic model per TOML section, and :class:`Settings`.

Every field's docstring is its documentation (``lbd config defaults`` prints it as a comment), so
it says what the key does and why its default is what it is. Knobs of the pure core take their
defaults from the core dataclasses (:mod:`lbd.core.settings`), and ``to_core()`` builds those
dataclasses back, so a default is written in one place only.

Cross-field rules (timing invariants and the like) live in :mod:`lbd.config.invariants`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from lbd.config.invariants import check_invariants
from lbd.core.errors import InvalidInputError
from lbd.core.names import TopicName
from lbd.core.settings import (
    AssignmentConfig,
    Budget,
    GovernorConfig,
    MonitorConfig,
    OperationsConfig,
    SheddingConfig,
    SidecarConfig,
    SidecarTimings,
    SplitConfig,
)
from lbd.ports.channel import MAX_BATCH_ENTRIES

_SHEDDING = SheddingConfig()
_SPLIT = SplitConfig()
_ASSIGNMENT = AssignmentConfig()
_GOVERNOR = GovernorConfig()
_OPERATIONS = OperationsConfig()

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_BROKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")

AUTO_SPLIT_ALGORITHMS = (
    "range_equally_divide",
    "topic_count_equally_divide",
    "flow_or_qps_equally_divide",
)
"""Split algorithms a scheduler can apply on its own (DESIGN §2 minus the one needing input)."""


def _blank_to_none(value: object) -> object:
    """TOML has no null: an empty string stands for "unset" in optional keys."""
    return None if value == "" else value


def _unless_none(check: Callable[[str], str]) -> AfterValidator:
    """Apply ``check`` to an optional key's value when it is set."""

    def wrapped(value: str | None) -> str | None:
        return None if value is None else check(value)

    return AfterValidator(wrapped)


def _check_host_port(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("must be HOST:PORT with a port in 0..65535, e.g. 127.0.0.1:7000")
    if host.startswith("[") != host.endswith("]"):
        raise ValueError("an IPv6 host must be in brackets, e.g. [::1]:7000")
    return value


def _url_check(*schemes: str) -> Callable[[str], str]:
    """A check accepting only URLs with one of ``schemes`` and a host."""
    expected = " or ".join(f"{s}://" for s in schemes)

    def check(value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in schemes or not parts.netloc:
            raise ValueError(f"must be a URL starting with {expected} and naming a host")
        return value

    return check


def _check_topic(value: str) -> str:
    try:
        TopicName.parse(value)
    except InvalidInputError as e:
        raise ValueError(str(e)) from None
    return value


def _check_name(value: str) -> str:
    if not _NAME.fullmatch(value):
        raise ValueError(
            "must be letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return value


def _check_broker_id(value: str) -> str:
    if not _BROKER_ID.fullmatch(value):
        raise ValueError(
            "must be letters, digits, '.', '_', ':' or '-', starting with a letter or digit "
            "(it is an etcd key segment)"
        )
    return value


def _check_prefix(value: str) -> str:
    # Still empty only when cluster.name is invalid, which is reported on its own.
    if value and (not value.startswith("/") or value.endswith("/") or "//" in value):
        raise ValueError("must start with '/', not end with '/' and have no empty segment")
    return value


def _check_channel_topic(value: str) -> str:
    if not TopicName.parse(value).is_persistent:
        raise ValueError("must be a persistent:// topic: the channel is the ownership record")
    return value


def _check_auto_split_algorithm(value: str) -> str:
    if value not in AUTO_SPLIT_ALGORITHMS:
        raise ValueError(
            "must be one of "
            + ", ".join(repr(a) for a in AUTO_SPLIT_ALGORITHMS)
            + " (specified_positions_divide needs explicit boundaries: Admin Split only)"
        )
    return value


def _check_file(value: str) -> str:
    """A path to a readable file (certificates, keys, tokens)."""
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"{value}: no such file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{value}: not readable by this user")
    return value


def _key_with(value: str | None, info: ValidationInfo, cert: str) -> str | None:
    """A key file's check: set exactly when the certificate ``cert`` is. The validator runs for
    the default too (validate_default), so a certificate without a key is caught."""
    if cert not in info.data:
        return value  # an invalid certificate key is reported on its own
    if value is None and info.data[cert] is not None:
        raise ValueError(f"must be set too: {cert} is set, and the two go together")
    if value is not None and info.data[cert] is None:
        raise ValueError(f"needs {cert}: set both or neither")
    return value


def _upper(value: object) -> object:
    return value.upper() if isinstance(value, str) else value


OptStr = Annotated[str | None, BeforeValidator(_blank_to_none)]
"""An optional string key; ``""`` in the file or the environment means unset."""

HostPort = Annotated[str, AfterValidator(_check_host_port)]
TopicStr = Annotated[str, AfterValidator(_check_topic)]
UrlList = Annotated[
    list[Annotated[str, AfterValidator(_url_check("http", "https"))]], Field(min_length=1)
]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""A positive, finite duration in seconds."""


class Section(BaseModel):
    """Base of every section: frozen, typo-proof (unknown keys are errors), documented fields.

    A section's docstring reads "``[name]``: what it is"; ``config defaults`` prints the part
    after the colon above the section.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class ClusterSettings(Section):
    """``[cluster]``: which cluster this sidecar belongs to."""

    name: Annotated[str, AfterValidator(_check_name)] = "standalone"
    """Cluster name. Sidecars of one cluster must agree on it; it is part of the default etcd
    prefix, so several clusters can share one etcd without seeing each other."""
    etcd_prefix: Annotated[str, AfterValidator(_check_prefix)] = ""
    """Root of every etcd key lbd writes (registry, leader, namespaces). Empty means
    "/lbd/<cluster.name>", which keeps clusters apart without extra configuration."""
    startup_timeout_s: Seconds = 6.0
    """How long `lbd serve` waits at start for etcd and Pulsar (the newest checkpoint, the state
    channel caught up, the session granted) before it exits with one line naming the step that
    did not finish. While the state channel is read, only a stretch without a new message counts,
    so a long channel without a recent checkpoint takes as long as its replay; the steps after it
    get the whole timeout again."""

    @model_validator(mode="before")
    @classmethod
    def _default_prefix(cls, data: Any) -> Any:
        # Derived here rather than in a property so that `config show` and every reader see the
        # prefix actually used; only from a valid name, which is reported on its own otherwise.
        if isinstance(data, dict) and not data.get("etcd_prefix"):
            name = data.get("name", cls.model_fields["name"].default)
            if isinstance(name, str) and _NAME.fullmatch(name):
                return {**data, "etcd_prefix": f"/lbd/{name}"}
        return data


class EtcdSettings(Section):
    """``[etcd]``: the metadata store and this sidecar's lease (DESIGN §8)."""

    endpoints: UrlList = Field(default_factory=lambda: ["http://127.0.0.1:2379"])
    """etcd client URLs; the client fails over between them. The default is a local etcd."""
    lease_ttl_s: int = Field(default=3, ge=2)
    """TTL of the lease that holds this broker's registration, in whole seconds (etcd leases
    are). Longer rides out etcd hiccups; shorter notices dead brokers sooner. etcd raises TTLs
    below its own minimum (about 2 s), hence the lower bound."""
    keepalive_interval_s: Seconds = 0.8
    """How often the lease is renewed. Must be below lease_ttl_s / 3 so that two renewals in a
    row can fail before the lease is lost."""
    request_timeout_s: Seconds = 1.0
    """Deadline of one etcd request. keepalive_interval_s + 2 x request_timeout_s must fit in
    lease_ttl_s: a renewal that hangs to its deadline still leaves time for one more try."""
    session_expired_policy: Literal["reconnect", "shutdown"] = "reconnect"
    """What to do when the lease is lost (PIP-57): "reconnect" grants a new lease and
    re-registers under the same broker id, keeping the broker's bundles; "shutdown" exits after
    reconnect_retries failed attempts, for deployments that prefer a restart."""
    reconnect_retries: int = Field(default=3, ge=0)
    """With session_expired_policy = "shutdown": attempts to re-register before exiting.
    "reconnect" retries for as long as it takes."""
    fence_after_s: Seconds = 3.0
    """Self-fencing, the lease ground: the sidecar vouches for its broker (grants its serving
    lease) on its etcd lease until this long after the send time of the last renewal that
    succeeded. Must be >= lease_ttl_s (fencing while the lease may still live buys no safety
    and turns every etcd blip into an outage) and fit, with broker.serving_lease_s and
    fence_margin_s, in monitor.orphan_cleanup_grace_s plus the hand-over wait (docs/safety.md)."""
    channel_fence_after_s: Seconds = 1.5
    """Self-fencing, the channel ground: the sidecar vouches on the channel until this long
    after the start of its last completed read barrier. The leader's hand-over wait is this
    plus broker.serving_lease_s plus fence_margin_s, so shorter hands a dead broker's bundles
    over sooner; longer rides out slower channel reads during an etcd outage. Above twice
    fence_check_interval_s, so a barrier can be missed."""
    fence_margin_s: float = Field(default=1.0, ge=1.0)
    """Added to every wait for a lease granted to the broker to run out: the time the grant
    takes to reach it and clock-rate differences between hosts."""
    fence_check_interval_s: Seconds = 0.25
    """How often the sidecar runs a channel read barrier while its etcd lease could lapse within
    one and a half channel_fence_after_s (while the lease is sound, every half
    channel_fence_after_s), and how often a fenced sidecar looks whether it may unfence (a
    vouching sidecar checks its grounds the moment the first of them would lapse). At most
    keepalive_interval_s, so that a barrier comes at least as often as a renewal."""
    retry_s: Seconds = 1.0
    """Pause before a sidecar retries what met an etcd or channel outage (a registration, a
    proposal of its reconciliation, a campaign). Below lease_ttl_s, so a retry comes within one
    lease lifetime."""
    ca_file: Annotated[OptStr, _unless_none(_check_file)] = None
    """PEM CA bundle etcd's server certificate must chain to; needs https:// endpoints. Empty
    with https:// endpoints: the system trust roots (OpenSSL's default CA file, which env
    SSL_CERT_FILE overrides; gRPC's bundled roots where there is none). Read again whenever the
    client is made anew (a fail-over, a failed TLS handshake), so a renewed bundle needs no
    restart."""
    cert_file: Annotated[OptStr, _unless_none(_check_file)] = None
    """PEM client certificate lbd presents to etcd (for etcd's --client-cert-auth); needs
    key_file and https:// endpoints. Read again whenever the client is made anew (a fail-over, a
    failed TLS handshake), so a renewed certificate is picked up without a restart. Empty: no
    client certificate."""
    key_file: Annotated[OptStr, _unless_none(_check_file)] = Field(
        default=None, validate_default=True
    )
    """PEM private key of cert_file."""
    username: OptStr = None
    """etcd user lbd authenticates as (etcd's `auth enable`); needs password. Its roles must
    grant read and write on cluster.etcd_prefix. Empty: no etcd authentication."""
    password: Annotated[SecretStr | None, BeforeValidator(_blank_to_none)] = Field(
        default=None, validate_default=True
    )
    """Password of username. Prefer env LBD_ETCD__PASSWORD to keep it out of files. Over
    http:// endpoints it travels in clear text: use https:// outside a trusted network."""

    @field_validator("endpoints", mode="after")
    @classmethod
    def _one_scheme(cls, value: list[str]) -> list[str]:
        if len({urlsplit(url).scheme for url in value}) > 1:
            raise ValueError(
                "must not mix http:// and https://: every member is reached the same way"
            )
        return value

    @field_validator("ca_file", "cert_file", mode="after")
    @classmethod
    def _file_needs_https(cls, value: str | None, info: ValidationInfo) -> str | None:
        endpoints = info.data.get("endpoints")  # absent when invalid: reported on its own
        if value is not None and endpoints and urlsplit(endpoints[0]).scheme != "https":
            raise ValueError(
                f"needs https:// endpoints, not {endpoints[0]!r}: TLS settings have no effect "
                "on a plaintext connection"
            )
        return value

    @field_validator("key_file", mode="after")
    @classmethod
    def _key_with_cert(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _key_with(value, info, "cert_file")

    @field_validator("password", mode="after")
    @classmethod
    def _password_with_username(
        cls, value: SecretStr | None, info: ValidationInfo
    ) -> SecretStr | None:
        # Runs for the default too (validate_default), so a username without a password is caught.
        if "username" not in info.data:
            return value
        if value is None and info.data["username"] is not None:
            raise ValueError("must be set too: username is set, and the two go together")
        if value is not None and info.data["username"] is None:
            raise ValueError("needs username: set both or neither")
        return value


_TLS_SCHEMES = ("pulsar+ssl", "https")
_ONE_AUTHENTICATION = (
    "{key} and tls_cert_file exclude each other: Pulsar takes one authentication, "
    "a token or a TLS client certificate"
)


def _require_tls_url(info: ValidationInfo) -> None:
    """Fail unless the service_url validated before the key being checked is a TLS one."""
    url = info.data.get("service_url")  # absent when invalid: reported on its own
    if url is not None and urlsplit(url).scheme not in _TLS_SCHEMES:
        raise ValueError(
            f"needs a pulsar+ssl:// or https:// service_url, not {url!r}: "
            "TLS settings have no effect on a plaintext connection"
        )


class PulsarSettings(Section):
    """``[pulsar]``: the Pulsar cluster carrying the state channel and the load-data topics."""

    service_url: Annotated[
        str, AfterValidator(_url_check("pulsar", "pulsar+ssl", "http", "https"))
    ] = "pulsar://127.0.0.1:6650"
    """Pulsar service URL (env LBD_PULSAR_URL). The default is a local pulsar-lite."""
    publish_timeout_s: Seconds = 2.0
    """A state-channel write the channel has not taken within this fails at once as UNAVAILABLE
    (a lookup that needs an assignment, an admin call), instead of waiting out
    operation_timeout_s while Pulsar is down; lookups of owned bundles keep answering from the
    table. The Pulsar client gives the write up then too, so it does not land once Pulsar
    returns. Below assignment.settle_timeout_s."""
    operation_timeout_s: Seconds = 30.0
    """Deadline of one Pulsar client operation (the Pulsar client's own default)."""
    channel_batch_max_values: Annotated[int, Field(ge=1, le=MAX_BATCH_ENTRIES)] = 256
    """Most values a sidecar writes to the state channel as one message. Values handed over
    while a write is on its way go out together as the next message, which every sidecar
    applies one value at a time in order (docs/performance.md). 1 writes every value as a
    message of its own: needed only while sidecars of a version before channel batches still
    read the channel (those skip batches and would diverge; newer ones stop at a message they
    cannot read)."""
    state_channel_topic: Annotated[TopicStr, AfterValidator(_check_channel_topic)] = (
        "persistent://pulsar/system/loadbalancer-service-unit-state"
    )
    """The state channel (DESIGN §4). Must be persistent: it is the ownership record. Same name
    as Pulsar's, so Pulsar tooling finds it."""
    broker_load_topic: TopicStr = "non-persistent://pulsar/system/loadbalancer-broker-load-data"
    """BrokerLoadData, keyed by broker id (DESIGN §3). Non-persistent: only the latest matters."""
    top_bundles_topic: TopicStr = (
        "non-persistent://pulsar/system/loadbalancer-top-bundles-load-data"
    )
    """TopBundlesLoadData, keyed by broker id: every sidecar reads it, the leader's shedder
    uses it (DESIGN §3)."""
    tls_trust_certs_file: Annotated[OptStr, _unless_none(_check_file)] = None
    """PEM CA bundle the brokers' certificates must chain to; needs a pulsar+ssl:// or https://
    service_url. Empty with such a URL: the system's CA bundle (OpenSSL's default file, which
    env SSL_CERT_FILE overrides), or the certifi bundle of the Pulsar client if there is none."""
    tls_cert_file: Annotated[OptStr, _unless_none(_check_file)] = None
    """PEM client certificate: lbd authenticates to Pulsar with it (Pulsar's TLS
    authentication; the certificate's CN is the role). Needs tls_key_file and a pulsar+ssl:// or
    https:// service_url; excludes auth_token and auth_token_file (Pulsar takes one
    authentication). Empty: no client certificate."""
    tls_key_file: Annotated[OptStr, _unless_none(_check_file)] = Field(
        default=None, validate_default=True
    )
    """PEM private key of tls_cert_file."""
    tls_validate_hostname: bool = True
    """Refuse a broker whose certificate does not name the host lbd connects to (the Pulsar
    client's own default is off). Only meaningful with a pulsar+ssl:// or https:// service_url."""
    tls_allow_insecure_connection: bool = False
    """Accept any broker certificate, trusted or not. For testing only: whoever sits on the path
    can then pose as the cluster, read the channel and forge ownership claims."""
    auth_token_file: Annotated[OptStr, _unless_none(_check_file)] = None
    """File holding the token lbd presents to Pulsar (surrounding whitespace ignored). Re-read
    each time the client opens a connection to a broker, so a rotated token is used from the
    next reconnection on, without a restart. Excludes auth_token and tls_cert_file."""
    auth_token: Annotated[SecretStr | None, BeforeValidator(_blank_to_none)] = None
    """Token (a JWT, as `pulsar tokens create` makes) lbd presents to Pulsar. Prefer env
    LBD_PULSAR__AUTH_TOKEN or auth_token_file to keep it out of files. Over pulsar:// it
    travels in clear text: use pulsar+ssl:// outside a trusted network. Empty: no token."""

    @field_validator("tls_trust_certs_file", "tls_cert_file", mode="after")
    @classmethod
    def _file_needs_tls(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            _require_tls_url(info)
        return value

    @field_validator("tls_validate_hostname", mode="after")
    @classmethod
    def _unchecked_host_needs_tls(cls, value: bool, info: ValidationInfo) -> bool:
        if not value:
            _require_tls_url(info)
        return value

    @field_validator("tls_allow_insecure_connection", mode="after")
    @classmethod
    def _insecure_needs_tls(cls, value: bool, info: ValidationInfo) -> bool:
        if value:
            _require_tls_url(info)
        return value

    @field_validator("tls_key_file", mode="after")
    @classmethod
    def _key_with_cert(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _key_with(value, info, "tls_cert_file")

    @field_validator("auth_token_file", mode="after")
    @classmethod
    def _one_authentication_by_file(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("tls_cert_file") is not None:
            raise ValueError(_ONE_AUTHENTICATION.format(key="auth_token_file"))
        return value

    @field_validator("auth_token", mode="after")
    @classmethod
    def _one_authentication(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if value is None:
            return value
        if info.data.get("auth_token_file") is not None:
            raise ValueError("auth_token and auth_token_file exclude each other: set one")
        if info.data.get("tls_cert_file") is not None:
            raise ValueError(_ONE_AUTHENTICATION.format(key="auth_token"))
        return value


class BrokerSettings(Section):
    """``[broker]``: the broker this sidecar serves (DESIGN §5)."""

    broker_id: Annotated[OptStr, _unless_none(_check_broker_id)] = None
    """Unique id of this broker in the registry (etcd key brokers/<broker_id>); letters,
    digits, '.', '_', ':' and '-'. Empty: not set here, `lbd serve --broker-id` gives it."""
    auto_ack: bool = False
    """Acknowledge Own/Release/Close on the broker's behalf when no broker is attached. Only for
    demos and benchmarks: with it, ownership no longer proves that a broker serves the bundle."""
    own_ack_timeout_s: Seconds = 3.0
    """How long an Assigning bundle waits for the broker's acknowledgement of Own before the
    sidecar leaves it Assigning and tries again later. Below monitor.inflight_timeout_s, so the
    sidecar gets an answer before the leader treats the assignment as stuck."""
    serving_lease_s: Seconds = 2.0
    """The broker's serving lease (docs/broker-contract.md): the broker serves only while it
    holds one, counted from when it asked, and asks again every quarter of it. The sidecar grants
    it only while it can vouch for the broker's ownership (etcd.fence_after_s,
    etcd.channel_fence_after_s), so a paused or cut-off sidecar's broker stops by itself. Part
    of the leader's hand-over wait for a gone broker's bundles (docs/safety.md): shorter stops
    a cut-off broker and hands its bundles over sooner; longer rides out longer pauses of the
    sidecar."""
    silence_timeout_s: Seconds = 6.0
    """An attached broker that sends nothing (no load report, no lease request, no ack) for this
    long is deregistered, so that its bundles follow the orphan path, and its last load report is
    no longer published as fresh. Above serving_lease_s: a live broker asks for its lease every
    quarter of it."""
    release_ack_timeout_s: Seconds = 3.0
    """How long a Releasing bundle waits for the broker's acknowledgement before moving on
    anyway (counted in a metric). Below monitor.inflight_timeout_s, so the sidecar settles its
    own transfers before the leader treats them as stuck."""
    advertised_service_url: Annotated[OptStr, _unless_none(_url_check("pulsar", "pulsar+ssl"))] = (
        None
    )
    """The broker's binary-protocol URL (pulsar:// or pulsar+ssl://) handed to clients in lookups.
    Empty: taken from the broker's Hello. Needed with auto_ack, where no broker says Hello."""
    advertised_web_url: Annotated[OptStr, _unless_none(_url_check("http", "https"))] = None
    """The broker's HTTP URL (http:// or https://) handed out in lookups. Empty: from Hello."""


class GrpcSettings(Section):
    """``[grpc]``: the sidecar's gRPC server (LoadBalancer and Admin services, DESIGN §6)."""

    addr: HostPort = "127.0.0.1:7000"
    """Listen address. Loopback by default: the broker runs beside the sidecar. A non-loopback
    address needs TLS (tls_cert_file) and authentication ([auth], admin_token or client
    certificates) unless allow_insecure is set."""
    advertised_addr: Annotated[OptStr, _unless_none(_check_host_port)] = None
    """Address other sidecars and `lbd ctl` use to reach this one, stored in the registry.
    Empty: addr (set it when addr binds 0.0.0.0 or [::])."""
    admin_token: Annotated[SecretStr | None, BeforeValidator(_blank_to_none)] = None
    """A static bearer token with the admin role (the identity "admin"). Setting it turns
    authentication on: callers without credentials are then refused, brokers included. Prefer
    env LBD_GRPC__ADMIN_TOKEN to keep it out of files; [auth] has per-identity tokens."""
    tls_cert_file: Annotated[OptStr, _unless_none(_check_file)] = None
    """PEM certificate chain of this sidecar. Set: the port speaks TLS only, and this sidecar
    presents the certificate as its client certificate when it forwards calls to other sidecars.
    Reloaded when the file changes (new connections get the new one). Empty: plaintext."""
    tls_key_file: Annotated[OptStr, _unless_none(_check_file)] = None
    """PEM private key of tls_cert_file."""
    tls_ca_file: Annotated[OptStr, _unless_none(_check_file)] = None
    """PEM CA bundle: other sidecars' certificates must chain to it (forwarding), and so must
    client certificates when tls_client_auth is "require". Reloaded when the file changes."""
    tls_client_auth: Literal["require", "none"] = "require"
    """With tls_ca_file set: "require" is mutual TLS, every client must present a certificate
    signed by tls_ca_file (its subject names the caller, see auth.cert_roles); "none" asks for
    no certificate, callers authenticate with tokens."""
    allow_insecure: bool = False
    """Allow a non-loopback addr without TLS or without authentication. Anyone who reaches the
    port could then claim to be any broker or act as an admin: for isolated test networks only."""
    shutdown_grace_s: Seconds = 5.0
    """On shutdown, in-flight RPCs get this long to finish before they are cancelled."""

    @model_validator(mode="after")
    def _check_tls(self) -> Self:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")
        if self.tls_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_ca_file needs tls_cert_file and tls_key_file (TLS)")
        return self

    @property
    def mutual_tls(self) -> bool:
        """Whether every client must present a certificate."""
        return self.tls_ca_file is not None and self.tls_client_auth == "require"


ROLES = ("reader", "broker", "admin")


def _check_cert_role(value: str) -> str:
    organization, sep, role = value.rpartition("=")
    if not sep or not organization or role not in ROLES:
        raise ValueError(
            f"{value!r} must read ORGANIZATION=ROLE with ROLE one of {', '.join(ROLES)}"
        )
    return value


class AuthSettings(Section):
    """``[auth]``: who may call the gRPC API (docs/security.md). Roles: reader (Lookup,
    WatchOwnership, List*, GetLoad, GetLeader), broker (a reader that may hold the BrokerSession
    of its own broker id), admin (everything)."""

    tokens_file: Annotated[OptStr, _unless_none(_check_file)] = None
    """Static bearer tokens, one per line: "<role> <name> <token>" (a broker's name is its
    broker id); '#' starts a comment. Re-read when it changes. Keep it readable by lbd only."""
    token_key_file: Annotated[OptStr, _unless_none(_check_file)] = None
    """Secret key (at least 32 bytes) of signed tokens: JWTs with HS256 whose "sub" is the
    name and "role" the role, as `lbd auth token` mints them. Empty: no signed tokens."""
    cert_roles: list[Annotated[str, AfterValidator(_check_cert_role)]] = Field(
        default_factory=lambda: [f"{r}={r}" for r in ROLES]
    )
    """With mutual TLS: a client certificate's organization (O) -> role, as ORGANIZATION=ROLE.
    Its common name (CN) is the caller's name (a broker's is its broker id). A certificate
    whose organization is not listed is refused."""
    anonymous_role: Literal["auto", "none", "reader", "admin"] = "auto"
    """The role of a caller presenting no credential. "auto": admin while no credential is
    configured at all (a loopback sidecar, as in `lbd dev up`), none as soon as one is."""

    def role_map(self) -> dict[str, str]:
        """Certificate organization -> role name."""
        return dict(entry.rpartition("=")[::2] for entry in self.cert_roles)


class MetricsSettings(Section):
    """``[metrics]``: the Prometheus endpoint (DESIGN §10)."""

    addr: Annotated[HostPort | None, BeforeValidator(_blank_to_none)] = "127.0.0.1:9464"
    """Listen address of /metrics (9464 is the OpenTelemetry Prometheus exporter's port).
    Empty: no metrics endpoint."""


class SheddingSettings(Section):
    """``[shedding]``: the leader's unload scheduler (DESIGN §7); keys as in scenario files."""

    strategy: Literal[
        "cluster_planner",
        "transfer_shedder",
        "threshold_shedder",
        "avg_shedder",
    ] = "cluster_planner"
    """cluster_planner, lbd's own, plans each cycle's moves over the whole cluster from each
    broker's estimated current load (not the lagging average), its own size and the moves not yet
    reported. It is the default because on every scenario of `lbd bench balance` it reaches the
    target sooner than transfer_shedder, with fewer moves, a final std no worse and no ping-pong
    (docs/balancing.md has the table). transfer_shedder is Pulsar's TransferShedder (the
    extensible load manager's default); threshold_shedder, Pulsar's old default, is kept for
    comparison; avg_shedder is Pulsar's AvgShedder (PIP-364), which evens out pairs of brokers
    whose loads stay far apart."""
    interval_s: Seconds = 60.0
    """How often the leader runs the shedder (Pulsar loadBalancerSheddingIntervalMinutes = 1)."""
    target_std: float = Field(default=_SHEDDING.target_std, gt=0)
    """Target standard deviation of broker loads (1.0 = 100%). Smaller balances harder at the
    cost of more bundle moves."""
    hit_count_threshold: int = Field(default=_SHEDDING.hit_count_threshold, ge=0)
    """Consecutive cycles the shedding condition must hold before bundles move, so that a short
    spike moves nothing. cluster_planner waits for it only on a change of traffic: it acts at
    once on what a spike cannot cause (an imbalance the load EMAs show, or one made by bundles
    changing owner)."""
    max_brokers_per_cycle: int = Field(default=_SHEDDING.max_brokers_per_cycle, ge=1)
    """Broker pairs (or overloaded brokers) handled per cycle; bounds the disruption of a cycle.
    cluster_planner takes moves from up to a quarter of the brokers, or this many when more."""
    cooldown_s: int = Field(default=_SHEDDING.cooldown_s, ge=0)
    """A broker unloaded less than this before its latest load report is left alone, giving its
    load time to reflect the move (Pulsar loadBalanceSheddingDelayInSeconds)."""
    bundle_grace_period_s: int = Field(default=_SHEDDING.bundle_grace_period_s, ge=0)
    """A bundle unloaded less than this ago is not moved again, preventing ping-pong."""
    load_data_ttl_s: int = Field(default=_SHEDDING.load_data_ttl_s, gt=0)
    """Load data older than this is stale: such brokers are left out of load computations
    (Pulsar loadBalancerBrokerLoadDataTTLInSeconds). At least 2 x load_report.interval_s."""
    transfer_enabled: bool = _SHEDDING.transfer_enabled
    """Unload with a pre-assigned destination, so clients go straight to the new owner."""
    min_throughput_threshold: float = Field(default=_SHEDDING.min_throughput_threshold, ge=0)
    """threshold_shedder only, in MB/s: a planned offload below this is too small to be worth
    shedding (Pulsar's TransferShedder does not read it either)."""
    overloaded_threshold: float = Field(default=_SHEDDING.overloaded_threshold, gt=0)
    """A broker whose load (0..1) is over this (and over avg + target_std) is overloaded and shed
    from even when the std meets the target."""
    threshold_shedder_percentage: float = Field(
        default=_SHEDDING.threshold_shedder_percentage, ge=0
    )
    """threshold_shedder only: shed from brokers this many percentage points above average."""
    lower_boundary_shedding_enabled: bool = _SHEDDING.lower_boundary_shedding_enabled
    """threshold_shedder only: also shed to raise brokers far below the average."""
    max_moves_per_broker: int = Field(default=_SHEDDING.max_moves_per_broker, ge=1)
    """cluster_planner only: moves in or out of any one broker per cycle, so that no broker (a
    freshly started one above all) takes a burst of transfers at once."""
    avg_shedder_low_threshold: float = Field(default=_SHEDDING.avg_shedder_low_threshold, ge=0)
    """avg_shedder only: brokers paired (most with least loaded) whose loads (0..1) differ by at
    least this count a low hit each cycle (Pulsar's 15 percentage points)."""
    avg_shedder_high_threshold: float = Field(default=_SHEDDING.avg_shedder_high_threshold, ge=0)
    """avg_shedder only: a pair whose loads differ by at least this also counts a high hit, so
    that a wide gap (a restarted or new broker) is evened out sooner."""
    avg_shedder_hit_count_low_threshold: int = Field(
        default=_SHEDDING.avg_shedder_hit_count_low_threshold, ge=1
    )
    """avg_shedder only: a pair sheds once one of its brokers has this many low hits in a row;
    a load spike shorter than this moves nothing."""
    avg_shedder_hit_count_high_threshold: int = Field(
        default=_SHEDDING.avg_shedder_hit_count_high_threshold, ge=1
    )
    """avg_shedder only: a pair sheds once one of its brokers has this many high hits in a row."""
    avg_shedder_unload_share: float = Field(default=_SHEDDING.avg_shedder_unload_share, gt=0, le=1)
    """avg_shedder only: share of a pair's difference in message rate (else throughput) moved
    from its more to its less loaded broker; 0.5 evens the pair out (Pulsar recommends it)."""
    avg_shedder_min_unload_msg_rate: float = Field(
        default=_SHEDDING.avg_shedder_min_unload_msg_rate, ge=0
    )
    """avg_shedder only: in messages/s; a pair whose share of message-rate difference is not
    above this is balanced by throughput instead."""
    avg_shedder_min_unload_throughput: float = Field(
        default=_SHEDDING.avg_shedder_min_unload_throughput, ge=0
    )
    """avg_shedder only: in MB/s; a pair whose share of throughput difference is not above this
    (and whose message rate does not decide) is left alone."""

    def to_core(self) -> SheddingConfig:
        """The core's shedding knobs."""
        return SheddingConfig(**_core_kwargs(self, SheddingConfig))


class SplitSettings(Section):
    """``[split]``: each sidecar's split scheduler for its own bundles (DESIGN §7)."""

    interval_s: Seconds = 60.0
    """How often to look for hot bundles (Pulsar loadBalancerSplitIntervalMinutes = 1)."""
    max_topics: int = Field(default=_SPLIT.max_topics, gt=0)
    """Split a bundle serving more topics than this."""
    max_sessions: int = _SPLIT.max_sessions
    """Split a bundle with more producers plus consumers than this; 0 or below (Pulsar's -1)
    turns this limit off."""
    max_msg_rate: float = Field(default=_SPLIT.max_msg_rate, gt=0)
    """Split a bundle with more messages/s (in plus out) than this."""
    max_bandwidth_mb: float = Field(default=_SPLIT.max_bandwidth_mb, gt=0)
    """Split a bundle with more MB/s (in plus out) than this."""
    hit_count_threshold: int = Field(default=_SPLIT.hit_count_threshold, ge=0)
    """A bundle splits once it was over a limit more than this many checks in a row (3: on the
    4th, so a spike splits nothing; 0: on the first)."""
    max_bundles_per_namespace: int = Field(default=_SPLIT.max_bundles_per_namespace, gt=0)
    """No split while a namespace has this many bundles (bounds the channel's size)."""
    max_splits_per_cycle: int = Field(default=_SPLIT.max_splits_per_cycle, gt=0)
    """A check stops at this many splits, bounding the churn of one cycle."""
    algorithm: Annotated[str, AfterValidator(_check_auto_split_algorithm)] = _SPLIT.algorithm
    """How a hot bundle is divided (DESIGN §2). specified_positions_divide needs explicit
    boundaries, so it is only available to the Admin Split call."""

    def to_core(self) -> SplitConfig:
        """The core's split knobs."""
        return SplitConfig(**_core_kwargs(self, SplitConfig))


class AssignmentSettings(Section):
    """``[assignment]``: how a lookup picks a broker for an unowned bundle (DESIGN §7)."""

    strategy: Literal["least_resource_usage_with_weight"] = "least_resource_usage_with_weight"
    """The assignment strategy; Pulsar's extensible load manager default is the only one."""
    max_topics_per_broker: int = Field(default=_ASSIGNMENT.max_topics_per_broker, gt=0)
    """Brokers serving this many topics or more take no new bundle."""
    load_margin: float = Field(default=_ASSIGNMENT.load_margin, ge=0)
    """A broker whose load EMA plus this margin is at most the average counts as "best"."""
    required_broker_version: OptStr = _ASSIGNMENT.required_broker_version
    """When set, only brokers reporting this version take new bundles (rolling upgrades).
    Empty: any version."""
    settle_timeout_s: Seconds = 30.0
    """How long a lookup or an admin operation (Assign, Transfer, Unload, Split) waits for its
    bundle to settle before answering DEADLINE_EXCEEDED. Above broker.own_ack_timeout_s, so one
    slow acknowledgement does not fail the call."""

    def to_core(self) -> AssignmentConfig:
        """The core's assignment knobs."""
        return AssignmentConfig(**_core_kwargs(self, AssignmentConfig))


class MonitorSettings(Section):
    """``[monitor]``: the leader's ownership monitor (DESIGN §8)."""

    interval_s: Seconds = 60.0
    """How often the leader sweeps the channel for orphans, stuck and stale states (Pulsar
    loadBalancerServiceUnitStateMonitorIntervalInSeconds). A gone broker's bundles do not wait
    for it: the leader also sweeps when a gone broker's orphan grace ends, and when it is
    elected."""
    inflight_timeout_s: Seconds = 30.0
    """An Assigning, Releasing or Splitting state older than this is stuck and gets fixed
    (Pulsar loadBalancerInFlightServiceUnitStateWaitingTimeInMillis)."""
    tombstone_after_s: float = Field(default=3600.0, ge=30)
    """Free and Deleted states older than this are tombstoned. Kept that long so a bundle just
    deleted by a split does not look free to reassign (Pulsar's minimum is 30 s). Must exceed
    inflight_timeout_s."""
    orphan_cleanup_grace_s: Seconds = 1.5
    """A broker whose registration vanished has its bundles reassigned only after staying away
    this long; re-registering cancels the cleanup. With the hand-over wait it must cover the
    lease ground of self-fencing: etcd.fence_after_s + broker.serving_lease_s +
    etcd.fence_margin_s <= this + the hand-over wait (docs/safety.md)."""
    unseen_broker_grace_s: Seconds = 30.0
    """The grace of a broker the leader's sidecar never saw registered, instead of
    orphan_cleanup_grace_s when longer: a cluster starting (every sidecar and broker at once),
    whose brokers attach one by one, keeps its bundles where the table has them rather than
    moving them to the first broker up. A broker seen to leave gets orphan_cleanup_grace_s."""

    def to_core(self) -> MonitorConfig:
        """The monitor's knobs."""
        return MonitorConfig(**_core_kwargs(self, MonitorConfig))


class GovernorSettings(Section):
    """``[governor]``: the execution governor. Every bundle move passes it: the leader's shedding,
    plans, drains, admin transfers and unloads (the balancing budget) and the repair of orphans
    (the recovery budget). 0 turns a limit off (docs/operating.md)."""

    balancing_per_broker: int = Field(default=_GOVERNOR.balancing.per_broker, ge=0)
    """Balancing moves in flight at once into or out of one broker: a drained broker hands over
    this many bundles at a time, a new broker takes this many at a time."""
    balancing_cluster: int = Field(default=_GOVERNOR.balancing.cluster, ge=0)
    """Balancing moves in flight at once in the whole cluster."""
    balancing_per_minute: int = Field(default=_GOVERNOR.balancing.per_minute, ge=0)
    """Balancing moves started in any 60 s."""
    recovery_per_broker: int = Field(default=_GOVERNOR.recovery.per_broker, ge=0)
    """Orphans being assigned at once to one broker (nobody serves an orphan meanwhile, so this
    is high: it only keeps a failover from landing everything on one broker at once)."""
    recovery_cluster: int = Field(default=_GOVERNOR.recovery.cluster, ge=0)
    """Orphans being assigned at once in the whole cluster."""
    recovery_per_minute: int = Field(default=_GOVERNOR.recovery.per_minute, ge=0)
    """Orphan assignments started in any 60 s."""

    def to_core(self) -> GovernorConfig:
        """The governor's budgets."""
        return GovernorConfig(
            balancing=Budget(
                per_broker=self.balancing_per_broker,
                cluster=self.balancing_cluster,
                per_minute=self.balancing_per_minute,
            ),
            recovery=Budget(
                per_broker=self.recovery_per_broker,
                cluster=self.recovery_cluster,
                per_minute=self.recovery_per_minute,
            ),
        )


class OperationsSettings(Section):
    """``[operations]``: plans, tracked operations, the safety auditor and the decision log,
    all kept by the leader (docs/operating.md)."""

    auto_shedding: bool = _OPERATIONS.auto_shedding
    """The leader executes its own shedding decisions every shedding.interval_s. False: it only
    plans when asked (Rebalance) and moves what an operator executes."""
    plan_ttl_s: Seconds = _OPERATIONS.plan_ttl_s
    """How long a plan from Rebalance may be executed: an older one rests on stale load."""
    keep_finished: int = Field(default=_OPERATIONS.keep_finished, gt=0)
    """Finished operations the leader keeps for `lbd ctl ops list` and get."""
    keep_decisions: int = Field(default=_OPERATIONS.keep_decisions, gt=0)
    """Recent decisions the leader keeps for `lbd ctl decisions`."""
    audit_interval_s: Seconds = _OPERATIONS.audit_interval_s
    """How often the leader's safety auditor runs its checks."""

    def to_core(self) -> OperationsConfig:
        """The leader's operation knobs."""
        return OperationsConfig(**_core_kwargs(self, OperationsConfig))


class CheckpointSettings(Section):
    """``[checkpoint]``: the leader's snapshots of the channel table (DESIGN §4)."""

    interval_s: Seconds = 300.0
    """How often the leader writes a checkpoint. A starting sidecar replays at most this much of
    the channel; more often costs a table write each time."""


class LoadReportSettings(Section):
    """``[load_report]``: what each sidecar publishes about its broker (DESIGN §3)."""

    interval_s: Seconds = 10.0
    """How often BrokerLoadData and TopBundlesLoadData are published. Reports are read with
    TTL shedding.load_data_ttl_s, which must be at least twice this."""
    top_bundles: int = Field(default=10, gt=0)
    """Bundles per TopBundlesLoadData report, the busiest first (Pulsar
    loadBalancerMaxNumberOfBundlesInBundleLoadReport)."""


class HistorySettings(Section):
    """``[history]``: load samples and decisions appended as Parquet for analytics."""

    enabled: bool = False
    """Off by default: history costs disk and is only needed for `lbd analytics`."""
    uri: str = "lbd-history"
    """Where the Parquet files go: a directory (relative to the working directory) or a
    filesystem URI such as s3://bucket/path."""
    flush_interval_s: Seconds = 60.0
    """Buffered rows are written at least this often, bounding what a crash loses."""
    buffer_max_rows: int = Field(default=10000, gt=0)
    """The most rows held in memory: a flush starts early at half of it, and past it the oldest
    rows are dropped and counted (a history target that stays down never grows memory)."""


class FrontSettings(Section):
    """``[front]``: the broker front, ``lbd broker`` (docs/broker-contract.md): a Pulsar
    binary-protocol broker beside the sidecar, serving clients the bundles its sidecar gives it
    and keeping their messages in the cluster's shared storage server."""

    addr: Annotated[HostPort | None, BeforeValidator(_blank_to_none)] = "127.0.0.1:6650"
    """Listen address of the protocol in plaintext (pulsar://). Empty: no plaintext port (then
    tls_addr must be set)."""
    tls_addr: Annotated[HostPort | None, BeforeValidator(_blank_to_none)] = None
    """Listen address of the protocol over TLS (pulsar+ssl://); needs tls_cert_file and
    tls_key_file. Empty: no TLS port."""
    advertised_url: Annotated[OptStr, _unless_none(_url_check("pulsar"))] = None
    """The pulsar:// URL clients are sent to (lookups, redirects, transfers). Empty:
    pulsar://<addr> (set it when addr binds 0.0.0.0 or [::])."""
    advertised_url_tls: Annotated[OptStr, _unless_none(_url_check("pulsar+ssl"))] = None
    """The pulsar+ssl:// URL clients are sent to. Empty: pulsar+ssl://<tls_addr>."""
    web_addr: Annotated[HostPort | None, BeforeValidator(_blank_to_none)] = "127.0.0.1:8080"
    """Listen address of the broker's web service in plaintext (http://): Pulsar's REST API of
    lookups, brokers, namespaces, bundles and load (docs/operating.md). Empty: none."""
    web_tls_addr: Annotated[HostPort | None, BeforeValidator(_blank_to_none)] = None
    """Listen address of the web service over TLS (https://), with tls_cert_file and
    tls_ca_file as the TLS port. Empty: none."""
    advertised_web_url: Annotated[OptStr, _unless_none(_url_check("http"))] = None
    """The http:// URL of the web service handed out in lookups. Empty: http://<web_addr>."""
    advertised_web_url_tls: Annotated[OptStr, _unless_none(_url_check("https"))] = None
    """The https:// URL of the web service handed out in lookups. Empty:
    https://<web_tls_addr>."""
    tls_cert_file: Annotated[OptStr, _unless_none(_check_file)] = None
    """PEM certificate chain the TLS port presents. Reloaded when the file changes."""
    tls_key_file: Annotated[OptStr, _unless_none(_check_file)] = Field(
        default=None, validate_default=True
    )
    """PEM private key of tls_cert_file."""
    tls_ca_file: Annotated[OptStr, _unless_none(_check_file)] = None
    """PEM CA bundle: set, every client of the TLS port must present a certificate that chains
    to it (mutual TLS). Empty: clients are not asked for one."""
    sidecar_addr: Annotated[OptStr, _unless_none(_check_host_port)] = None
    """The sidecar's gRPC address. Empty: grpc.advertised_addr, else grpc.addr, of this file
    (the broker and its sidecar usually share one)."""
    sidecar_ca_file: Annotated[OptStr, _unless_none(_check_file)] = None
    """PEM CA the sidecar's certificate must chain to (TLS to the sidecar). Empty: plaintext."""
    sidecar_cert_file: Annotated[OptStr, _unless_none(_check_file)] = None
    """PEM client certificate of this broker for mutual TLS with the sidecar (its common name is
    the broker id, docs/security.md). Read again at each reconnect."""
    sidecar_key_file: Annotated[OptStr, _unless_none(_check_file)] = Field(
        default=None, validate_default=True
    )
    """PEM private key of sidecar_cert_file."""
    sidecar_token_file: Annotated[OptStr, _unless_none(_check_file)] = None
    """File holding this broker's bearer token for the sidecar (its name is the broker id).
    Read again at each reconnect."""
    storage_url: Annotated[str, AfterValidator(_url_check("pulsar", "pulsar+ssl"))] = (
        "pulsar://127.0.0.1:6652"
    )
    """The storage server every broker of the cluster keeps its topics in (a pulsar-lite, the
    role BookKeeper plays in Apache Pulsar); not the one carrying the state channel."""
    storage_ca_file: Annotated[OptStr, _unless_none(_check_file)] = None
    """PEM CA of a pulsar+ssl:// storage_url."""
    max_message_size: int = Field(default=5 * 1024 * 1024, ge=1024, le=128 * 1024 * 1024)
    """Largest message in bytes (Pulsar's default, announced to clients); a larger frame ends
    its connection."""
    max_connections: int = Field(default=10_000, ge=1)
    """Client connections at most; more are closed as they arrive (counted, logged)."""
    max_connections_per_peer: int = Field(default=1_000, ge=1)
    """Client connections from one IP address at most."""
    handshake_timeout_s: Seconds = 10.0
    """A connection that has not sent CONNECT within this is closed."""
    keepalive_interval_s: Seconds = 30.0
    """A connection silent this long is pinged; one silent twice as long is closed (the
    Pulsar client pings every 30 s)."""
    drain_timeout_s: Seconds = 2.0
    """At a release, how long storage gets to receipt the sends already written and to confirm
    consumers' closes, before the clients are sent on anyway. Below
    broker.release_ack_timeout_s: the sidecar waits for the release's acknowledgement."""
    handover_timeout_s: Seconds = 10.0
    """After a transfer, how long the clients of the bundle wait for the new owner to take it
    before they are told to look the topic up instead."""
    lookup_hold_s: Seconds = 25.0
    """A LOOKUP of a topic whose owner cannot serve it (gone and not replaced yet, or this
    broker without a valid lease) is answered once it can, waiting at most this long: a client
    answered at once would retry with a growing backoff and resume seconds after the failover.
    Below the client's operation timeout (30 s by default)."""
    leave_timeout_s: Seconds = 30.0
    """On SIGTERM, how long the broker waits for its sidecar to hand every bundle to another
    broker before it stops anyway."""
    report_interval_s: Seconds = 1.0
    """How often the broker sends its sidecar a load report."""
    usage_source: Literal["host", "process"] = "host"
    """Whose CPU and memory the load reports carry: "host" (one broker per host, as in
    production) or "process" (this broker's own; several brokers share the host, as in the dev
    cluster)."""
    bandwidth_limit_mbit: float = Field(default=1000.0, gt=0)
    """The broker's link capacity in Mbit/s: the clients' traffic is reported against it."""
    events_file: OptStr = None
    """Append one JSON line per own, release, close, session, lease and write event to this
    file (the serving checker reads it). Empty: no event log."""
    metrics_addr: Annotated[HostPort | None, BeforeValidator(_blank_to_none)] = "127.0.0.1:9465"
    """Listen address of the broker's /metrics. Empty: none."""

    @field_validator("tls_key_file", mode="after")
    @classmethod
    def _key_with_cert(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _key_with(value, info, "tls_cert_file")

    @field_validator("sidecar_key_file", mode="after")
    @classmethod
    def _sidecar_key_with_cert(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _key_with(value, info, "sidecar_cert_file")

    @model_validator(mode="after")
    def _check_ports(self) -> Self:
        if self.addr is None and self.tls_addr is None:
            raise ValueError("addr and tls_addr are both empty: the broker needs a port")
        if self.tls_addr is not None and self.tls_cert_file is None:
            raise ValueError("tls_addr needs tls_cert_file and tls_key_file")
        if self.web_tls_addr is not None and self.tls_cert_file is None:
            raise ValueError("web_tls_addr needs tls_cert_file and tls_key_file")
        if self.tls_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_ca_file needs tls_cert_file and tls_key_file (TLS)")
        if self.storage_url.startswith("pulsar+ssl") and self.storage_ca_file is None:
            raise ValueError("a pulsar+ssl:// storage_url needs storage_ca_file")
        return self


class LoggingSettings(Section):
    """``[logging]``: how lbd logs."""

    level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], BeforeValidator(_upper)] = "INFO"
    """Log level; INFO logs every decision once, with its reason."""
    json_lines: bool = Field(default=False, alias="json")
    """One JSON object per line instead of text, for log collectors."""


class Settings(BaseModel):
    """All of lbd's settings, one attribute per TOML section."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    cluster: ClusterSettings = Field(default_factory=ClusterSettings)
    etcd: EtcdSettings = Field(default_factory=EtcdSettings)
    pulsar: PulsarSettings = Field(default_factory=PulsarSettings)
    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    grpc: GrpcSettings = Field(default_factory=GrpcSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    shedding: SheddingSettings = Field(default_factory=SheddingSettings)
    split: SplitSettings = Field(default_factory=SplitSettings)
    assignment: AssignmentSettings = Field(default_factory=AssignmentSettings)
    monitor: MonitorSettings = Field(default_factory=MonitorSettings)
    governor: GovernorSettings = Field(default_factory=GovernorSettings)
    operations: OperationsSettings = Field(default_factory=OperationsSettings)
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    load_report: LoadReportSettings = Field(default_factory=LoadReportSettings)
    history: HistorySettings = Field(default_factory=HistorySettings)
    front: FrontSettings = Field(default_factory=FrontSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)

    @model_validator(mode="after")
    def _check_invariants(self) -> Self:
        # The loader checks these first and reports each at its key; this catches settings
        # built in code.
        problems = check_invariants(self)
        if problems:
            raise ValueError("; ".join(f"{p.key}: {p.message}" for p in problems))
        return self

    def sidecar_config(self) -> SidecarConfig:
        """The plain configuration of a sidecar's services (they never see these settings)."""
        return SidecarConfig(
            auto_ack=self.broker.auto_ack,
            channel_batch_max_values=self.pulsar.channel_batch_max_values,
            timings=SidecarTimings(
                own_ack_timeout_s=self.broker.own_ack_timeout_s,
                release_ack_timeout_s=self.broker.release_ack_timeout_s,
                settle_timeout_s=self.assignment.settle_timeout_s,
                fence_after_s=self.etcd.fence_after_s,
                channel_fence_after_s=self.etcd.channel_fence_after_s,
                fence_check_interval_s=self.etcd.fence_check_interval_s,
                retry_s=self.etcd.retry_s,
                serving_lease_s=self.broker.serving_lease_s,
                lease_margin_s=self.etcd.fence_margin_s,
                silence_timeout_s=self.broker.silence_timeout_s,
                publish_timeout_s=self.pulsar.publish_timeout_s,
                startup_timeout_s=self.cluster.startup_timeout_s,
            ),
            assignment=self.assignment.to_core(),
            shedding=self.shedding.to_core(),
            shedding_strategy=self.shedding.strategy,
            shedding_interval_s=self.shedding.interval_s,
            split=self.split.to_core(),
            split_interval_s=self.split.interval_s,
            monitor=self.monitor.to_core(),
            checkpoint_interval_s=self.checkpoint.interval_s,
            load_report_interval_s=self.load_report.interval_s,
            top_bundles_per_report=self.load_report.top_bundles,
            governor=self.governor.to_core(),
            operations=self.operations.to_core(),
        )


def section_models() -> dict[str, type[Section]]:
    """Section name -> its model, in file order."""
    out: dict[str, type[Section]] = {}
    for name, info in Settings.model_fields.items():
        model = info.annotation
        assert isinstance(model, type) and issubclass(model, Section)
        out[name] = model
    return out


def toml_keys(model: type[Section]) -> dict[str, str]:
    """A section's TOML keys -> attribute names (they differ only where a key has an alias)."""
    return {info.alias or name: name for name, info in model.model_fields.items()}


def _core_kwargs(section: Section, core: type) -> dict[str, Any]:
    return {f.name: getattr(section, f.name) for f in fields(core)}
