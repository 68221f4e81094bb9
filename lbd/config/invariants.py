"""Cross-field rules of the settings, checked at load and all reported together.

Modelled on patroni's ``_validate_and_adjust_timeouts``, except that lbd rejects rather than
adjusts: a silently changed timeout is a surprise during an incident. Each rule names the keys it
reads; the first is where a violation is reported, because that is the key to change.

The fencing rules carry the safety argument of DESIGN §8 ("at no instant do two brokers serve
the same bundle"), docs/safety.md gives it whole. A sidecar grants its broker's serving lease (L,
``broker.serving_lease_s``) on one of two grounds: its etcd lease, renewed less than
``etcd.fence_after_s`` (F) ago, counted from the send time t0 of the last renewal that succeeded;
or the channel, read through by a barrier begun less than ``etcd.channel_fence_after_s`` (Fc)
ago. The leader announces a move off a gone broker ``monitor.orphan_cleanup_grace_s`` (G) after
it saw the registration vanish, which can be right after t0 (a revoked lease: the TTL is no
credit to count on), and hands the bundle over the hand-over wait D = Fc + L + M later (M,
``etcd.fence_margin_s``, pays for the grant's way to the broker and clock-rate differences). A
lease granted on the channel ground ends by then; one granted on the lease ground ends before
t0 + F + L + M, hence F + L + M <= G + D. Fencing before t0 + lease_ttl_s is never needed for
safety, as nobody may take the bundles while the lease can still be alive, so F >= lease_ttl_s
keeps etcd blips shorter than the TTL from closing every bundle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lbd.config.schema import Settings


@dataclass(frozen=True, slots=True)
class Problem:
    """One violated rule: the dotted key to change, why, and every key the rule reads."""

    key: str
    message: str
    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Invariant:
    """A cross-field rule; ``check`` returns why the settings break it, or None."""

    keys: tuple[str, ...]
    check: Callable[[Settings], str | None]

    @property
    def sections(self) -> frozenset[str]:
        """The sections the rule reads; it is skipped while any of them is invalid."""
        return frozenset(key.partition(".")[0] for key in self.keys)


def _n(value: float) -> str:
    """A number as an operator wrote it: 4 rather than 4.0, at most 3 decimals."""
    return f"{value:.3f}".rstrip("0").rstrip(".")


def _keepalive_vs_ttl(s: Settings) -> str | None:
    k, ttl = s.etcd.keepalive_interval_s, s.etcd.lease_ttl_s
    if k < ttl / 3:
        return None
    return (
        f"must be < etcd.lease_ttl_s / 3 = {_n(ttl / 3)} (got {_n(k)}): the lease must survive "
        "two failed renewals in a row"
    )


def _request_timeout_vs_ttl(s: Settings) -> str | None:
    k, r, ttl = s.etcd.keepalive_interval_s, s.etcd.request_timeout_s, s.etcd.lease_ttl_s
    if k + 2 * r <= ttl:
        return None
    return (
        f"etcd.keepalive_interval_s + 2 x etcd.request_timeout_s must be <= etcd.lease_ttl_s "
        f"({_n(k)} + 2 x {_n(r)} = {_n(k + 2 * r)} > {ttl}): a renewal that hangs to its "
        "deadline must leave time for one more before the lease expires"
    )


def _fence_after_ttl(s: Settings) -> str | None:
    f, ttl = s.etcd.fence_after_s, s.etcd.lease_ttl_s
    if f >= ttl:
        return None
    return (
        f"must be >= etcd.lease_ttl_s = {ttl} (got {_n(f)}): fencing while the lease may still "
        "be alive buys no safety and closes every bundle on each etcd blip"
    )


def _lease_ground_before_handover(s: Settings) -> str | None:
    f, lease, m = s.etcd.fence_after_s, s.broker.serving_lease_s, s.etcd.fence_margin_s
    grace, fc = s.monitor.orphan_cleanup_grace_s, s.etcd.channel_fence_after_s
    wait = fc + lease + m
    if f + lease + m <= grace + wait:
        return None
    return (
        f"etcd.fence_after_s + broker.serving_lease_s + etcd.fence_margin_s must be <= "
        f"monitor.orphan_cleanup_grace_s + the hand-over wait (etcd.channel_fence_after_s + "
        f"broker.serving_lease_s + etcd.fence_margin_s), that is fence_after_s <= "
        f"orphan_cleanup_grace_s + channel_fence_after_s ({_n(f)} > {_n(grace)} + {_n(fc)}): "
        "the last lease a sidecar cut off from etcd granted must have run out before the "
        "leader may hand its broker's bundles to another"
    )


def _channel_window_vs_check(s: Settings) -> str | None:
    fc, check = s.etcd.channel_fence_after_s, s.etcd.fence_check_interval_s
    if fc > 2 * check:
        return None
    return (
        f"must be > 2 x etcd.fence_check_interval_s = {_n(2 * check)} (got {_n(fc)}): a read "
        "barrier runs every check interval, and one late barrier must not fence the broker"
    )


PULSAR_CLIENT_OPERATION_TIMEOUT_S = 30.0
"""The official Pulsar clients' default operation timeout (a lookup, a producer's creation)."""


def _release_and_lease_vs_inflight(s: Settings) -> str | None:
    ack, lease = s.broker.release_ack_timeout_s, s.broker.serving_lease_s
    m, inflight = s.etcd.fence_margin_s, s.monitor.inflight_timeout_s
    if ack + lease + m < inflight:
        return None
    return (
        f"broker.release_ack_timeout_s + broker.serving_lease_s + etcd.fence_margin_s must be < "
        f"monitor.inflight_timeout_s ({_n(ack)} + {_n(lease)} + {_n(m)} = {_n(ack + lease + m)} "
        f">= {_n(inflight)}): an unacknowledged release waits out the broker's lease, and must "
        "be done before the leader declares the transfer stuck"
    )


def _front_drain_vs_release_ack(s: Settings) -> str | None:
    drain, ack = s.front.drain_timeout_s, s.broker.release_ack_timeout_s
    if drain < ack:
        return None
    return (
        f"must be < broker.release_ack_timeout_s = {_n(ack)} (got {_n(drain)}): the broker "
        "front acknowledges a Release once storage settled or this ran out, and the sidecar "
        "must still be waiting for that acknowledgement"
    )


def _front_hold_vs_client_timeout(s: Settings) -> str | None:
    hold = s.front.lookup_hold_s
    if hold < PULSAR_CLIENT_OPERATION_TIMEOUT_S:
        return None
    return (
        f"must be < {_n(PULSAR_CLIENT_OPERATION_TIMEOUT_S)}, the Pulsar client's operation "
        f"timeout in seconds (got {_n(hold)}): a lookup held longer fails at the client "
        "instead of telling it to retry"
    )


def _own_ack_vs_inflight(s: Settings) -> str | None:
    ack, inflight = s.broker.own_ack_timeout_s, s.monitor.inflight_timeout_s
    if ack < inflight:
        return None
    return (
        f"must be < monitor.inflight_timeout_s = {_n(inflight)} (got {_n(ack)}): the sidecar "
        "must hear from its broker before the leader declares the assignment stuck"
    )


def _settle_vs_own_ack(s: Settings) -> str | None:
    settle, ack = s.assignment.settle_timeout_s, s.broker.own_ack_timeout_s
    if settle > ack:
        return None
    return (
        f"must be > broker.own_ack_timeout_s = {_n(ack)} (got {_n(settle)}): a lookup must "
        "outlast one slow acknowledgement of Own"
    )


def _fence_check_vs_keepalive(s: Settings) -> str | None:
    check, k = s.etcd.fence_check_interval_s, s.etcd.keepalive_interval_s
    if check <= k:
        return None
    return (
        f"must be <= etcd.keepalive_interval_s = {_n(k)} (got {_n(check)}): the fencing rule "
        "allows one keepalive interval for noticing the missed deadline"
    )


def _retry_vs_ttl(s: Settings) -> str | None:
    retry, ttl = s.etcd.retry_s, s.etcd.lease_ttl_s
    if retry < ttl:
        return None
    return f"must be < etcd.lease_ttl_s = {ttl} (got {_n(retry)}): a retry must come within a lease"


def _silence_vs_lease(s: Settings) -> str | None:
    silence, lease = s.broker.silence_timeout_s, s.broker.serving_lease_s
    if silence > lease:
        return None
    return (
        f"must be > broker.serving_lease_s = {_n(lease)} (got {_n(silence)}): a live broker "
        "asks for its lease every quarter of it, and must not look silent"
    )


def _publish_vs_settle(s: Settings) -> str | None:
    publish, settle = s.pulsar.publish_timeout_s, s.assignment.settle_timeout_s
    if publish < settle:
        return None
    return (
        f"must be < assignment.settle_timeout_s = {_n(settle)} (got {_n(publish)}): a lookup "
        "must be able to publish within the time it waits"
    )


def _tombstone_vs_inflight(s: Settings) -> str | None:
    tomb, inflight = s.monitor.tombstone_after_s, s.monitor.inflight_timeout_s
    if tomb > inflight:
        return None
    return (
        f"must be > monitor.inflight_timeout_s = {_n(inflight)} (got {_n(tomb)}), as in Pulsar: "
        "a state is never tombstoned before a stuck transition could have been fixed"
    )


def _load_ttl_vs_report(s: Settings) -> str | None:
    ttl, every = s.shedding.load_data_ttl_s, s.load_report.interval_s
    if ttl >= 2 * every:
        return None
    return (
        f"must be >= 2 x load_report.interval_s = {_n(2 * every)} (got {ttl}): one late report "
        "must not make a live broker's load look stale"
    )


def _distinct_topics(s: Settings) -> str | None:
    p = s.pulsar
    topics = (p.state_channel_topic, p.broker_load_topic, p.top_bundles_topic)
    if len(set(topics)) == len(topics):
        return None
    return "state_channel_topic, broker_load_topic and top_bundles_topic must be distinct"


def _distinct_listeners(s: Settings) -> str | None:
    if s.metrics.addr is None or s.metrics.addr != s.grpc.addr:
        return None
    return f"must differ from grpc.addr (both are {s.metrics.addr!r}): both listen there"


def _history_uri(s: Settings) -> str | None:
    if s.history.enabled and not s.history.uri:
        return "must be set when history.enabled = true"
    return None


_LOOPBACK_HOSTS = ("localhost", "[::1]")


def is_loopback(addr: str) -> bool:
    """Whether ``HOST:PORT`` listens on the loopback interface only."""
    host = addr.rpartition(":")[0]
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


def authenticates(s: Settings) -> bool:
    """Whether the gRPC API knows any credential (so that anonymous callers are not admins)."""
    return (
        s.grpc.admin_token is not None
        or s.auth.tokens_file is not None
        or s.auth.token_key_file is not None
        or s.grpc.mutual_tls
    )


def _exposed_without_protection(s: Settings) -> str | None:
    if is_loopback(s.grpc.addr) or s.grpc.allow_insecure:
        return None
    missing = []
    if s.grpc.tls_cert_file is None:
        missing.append("TLS (grpc.tls_cert_file, grpc.tls_key_file)")
    if not authenticates(s):
        missing.append(
            "authentication (grpc.tls_ca_file for client certificates, auth.tokens_file, "
            "auth.token_key_file or grpc.admin_token)"
        )
    elif s.auth.anonymous_role == "admin":
        missing.append('authentication (auth.anonymous_role = "admin" lets anyone in)')
    if not missing:
        return None
    return (
        f"{s.grpc.addr} is reachable from other hosts, but the API has no "
        + " and no ".join(missing)
        + ": anyone reaching the port could claim to be a broker or act as an admin. "
        "Configure them, or set grpc.allow_insecure = true on an isolated network"
    )


def _anonymous_admin_with_credentials(s: Settings) -> str | None:
    if s.auth.anonymous_role != "admin" or not authenticates(s):
        return None
    return (
        'is "admin" while credentials are configured: every caller without them would be '
        'an admin, which makes the credentials pointless; use "none" or "reader"'
    )


INVARIANTS: tuple[Invariant, ...] = (
    Invariant(("etcd.keepalive_interval_s", "etcd.lease_ttl_s"), _keepalive_vs_ttl),
    Invariant(
        ("etcd.request_timeout_s", "etcd.keepalive_interval_s", "etcd.lease_ttl_s"),
        _request_timeout_vs_ttl,
    ),
    Invariant(("etcd.fence_after_s", "etcd.lease_ttl_s"), _fence_after_ttl),
    Invariant(
        (
            "etcd.fence_after_s",
            "broker.serving_lease_s",
            "etcd.fence_margin_s",
            "monitor.orphan_cleanup_grace_s",
            "etcd.channel_fence_after_s",
        ),
        _lease_ground_before_handover,
    ),
    Invariant(
        ("etcd.channel_fence_after_s", "etcd.fence_check_interval_s"), _channel_window_vs_check
    ),
    Invariant(
        (
            "broker.release_ack_timeout_s",
            "broker.serving_lease_s",
            "etcd.fence_margin_s",
            "monitor.inflight_timeout_s",
        ),
        _release_and_lease_vs_inflight,
    ),
    Invariant(("broker.own_ack_timeout_s", "monitor.inflight_timeout_s"), _own_ack_vs_inflight),
    Invariant(
        ("front.drain_timeout_s", "broker.release_ack_timeout_s"), _front_drain_vs_release_ack
    ),
    Invariant(("front.lookup_hold_s",), _front_hold_vs_client_timeout),
    Invariant(("assignment.settle_timeout_s", "broker.own_ack_timeout_s"), _settle_vs_own_ack),
    Invariant(
        ("etcd.fence_check_interval_s", "etcd.keepalive_interval_s"), _fence_check_vs_keepalive
    ),
    Invariant(("etcd.retry_s", "etcd.lease_ttl_s"), _retry_vs_ttl),
    Invariant(("broker.silence_timeout_s", "broker.serving_lease_s"), _silence_vs_lease),
    Invariant(("pulsar.publish_timeout_s", "assignment.settle_timeout_s"), _publish_vs_settle),
    Invariant(("monitor.tombstone_after_s", "monitor.inflight_timeout_s"), _tombstone_vs_inflight),
    Invariant(("shedding.load_data_ttl_s", "load_report.interval_s"), _load_ttl_vs_report),
    Invariant(
        ("pulsar.state_channel_topic", "pulsar.broker_load_topic", "pulsar.top_bundles_topic"),
        _distinct_topics,
    ),
    Invariant(("metrics.addr", "grpc.addr"), _distinct_listeners),
    Invariant(("history.uri", "history.enabled"), _history_uri),
    Invariant(
        (
            "grpc.addr",
            "grpc.allow_insecure",
            "grpc.tls_cert_file",
            "grpc.admin_token",
            "auth.tokens_file",
            "auth.token_key_file",
            "auth.anonymous_role",
        ),
        _exposed_without_protection,
    ),
    Invariant(("auth.anonymous_role", "grpc.admin_token"), _anonymous_admin_with_credentials),
)


def check_invariants(
    settings: Settings, valid_sections: frozenset[str] | None = None
) -> list[Problem]:
    """Every rule ``settings`` breaks; rules reading a section not in ``valid_sections`` (when
    given) are skipped, because its values there are stand-ins for ones that failed to parse."""
    return [
        Problem(rule.keys[0], message, rule.keys)
        for rule in INVARIANTS
        if valid_sections is None or rule.sections <= valid_sections
        if (message := rule.check(settings)) is not None
    ]
