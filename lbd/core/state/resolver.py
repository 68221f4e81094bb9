"""The conflict resolver (DESIGN §4): every sidecar applies the state channel with
:func:`resolve`, in channel order, so every sidecar materialises the same table. The rules are
Pulsar's ``ServiceUnitStateDataConflictResolver`` for a system-topic channel, plus the leader term
of DESIGN §4, checked first of all, and the server rule (a bundle changes brokers only by a
hand-over), checked last (see :func:`resolve`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from lbd.core.probes import probe
from lbd.core.state.states import (
    _S,
    ServiceUnitStateData,
    is_allowed_transition,
    server_of,
    state_of,
)


class Rule(enum.Enum):
    """Which rule of the resolver decided; a closed set, fit for metric labels."""

    TOMBSTONE = "tombstone"
    """Accepted: a tombstone is always accepted."""
    STALE_TERM = "stale_term"
    """Rejected: a forced write from a leader term below the highest applied."""
    TERM_JUMP = "term_jump"
    """Rejected: a leader term more than :data:`MAX_TERM_JUMP` above the highest applied."""
    STALE_VERSION = "stale_version"
    """Rejected: version not above the current one."""
    VERSION_GAP = "version_gap"
    """Accepted: version at least current + 2 (the reader missed messages)."""
    FORCED = "forced"
    """Accepted: a forced write at the next version (or onto no value)."""
    TRANSITION = "transition"
    """Accepted if the state change is allowed and the broker checks hold."""
    BAD_TRANSITION = "bad_transition"
    """Rejected: the state change is not allowed."""
    BAD_BROKERS = "bad_brokers"
    """Rejected: the state change is allowed but the brokers do not fit it."""
    SERVER_CHANGE = "server_change"
    """Rejected: the value would make another broker the server while one still is, other than by
    the hand-over Releasing -> Assigning (forced, gapped or not)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """The resolver's answer on one proposed value."""

    accepted: bool
    rule: Rule
    reason: str
    """A human sentence: why it was accepted or rejected (logged once with the decision)."""


MAX_TERM_JUMP: Final = 2**40
"""How far a value's leader term may lie above the highest term applied so far.

A leader leads with its etcd revision T, or with H + T when the channel's highest term H is not
below T (:mod:`lbd.services.leader.election`). Its table at election is a prefix of what every
sidecar has applied before its writes, so its term lies at most T above the highest term they
have applied. etcd revisions never come near 2^40 (35 years at a thousand writes a second; lbd
makes a few a minute), so a term beyond the bound is forged or corrupt. Accepting it would make
every later leader's forced writes stale for good; a forged term within the bound costs one
re-election.
"""


def resolve(
    cur: ServiceUnitStateData | None, new: ServiceUnitStateData | None, *, highest_term: int
) -> Verdict:
    """Judge ``new`` against the bundle's current value ``cur`` (None: no value, i.e. Init).

    ``highest_term`` is the highest leader term of any value applied so far (0 if none). In order:

    1. a tombstone is accepted when the bundle has no server (:func:`server_of`: it is Init, Free
       or Deleted), and rejected otherwise (it carries no term to check);
    2. a forced write whose ``leader_term`` is below ``highest_term`` is rejected: it comes from a
       deposed leader, and a forced write is exactly what must not slip through on a gapped
       version or onto an empty bundle, so this check precedes every version rule. A non-forced
       write is judged by the transition rules alone, which keep it safe whoever wrote it;
    3. a value whose ``leader_term`` is above ``highest_term + MAX_TERM_JUMP`` is rejected, forced
       or not (any accepted term raises the highest term): no leader's term jumps that far, and
       accepting it would make every later leader's forced writes stale;
    4. with no current value, ``new`` is judged from Init and its version is not compared;
    5. ``new.version_id <= cur.version_id`` is rejected, forced or not; so is any value on top of
       a Deleted one but a reset to Init, forced or on a gap (a split's children hold the deleted
       bundle's range: a stale fix that brought it back would serve it twice);
    6. ``new.version_id >= cur.version_id + 2`` is accepted without the checks of rule 7;
    7. otherwise (the next version, or no current value) a forced write is accepted; else the
       transition must be allowed and the broker checks of :func:`_broker_problem` must hold;
    8. a value that rules 4 to 7 accept is still rejected if it makes another broker the server
       (:func:`server_of`) while one still is, unless it is the hand-over ``Releasing ->
       Assigning``: neither a gap (the reader missed messages) nor an override may let a broker
       serve before the previous one released. Likewise a value that leaves the bundle with no
       server is rejected unless it finishes a release (``Releasing -> Free``) or a split
       (``Splitting -> Deleted``): a bundle the table calls free may be handed to anyone. The
       normal flows never trip it.
    """
    if new is None:
        served_by = server_of(cur)
        if served_by is not None:
            assert cur is not None
            return Verdict(
                False,
                Rule.SERVER_CHANGE,
                f"a tombstone would drop {cur.state.value} {served_by!r} while it may still serve "
                "(only Free and Deleted values are tombstoned)",
            )
        return Verdict(True, Rule.TOMBSTONE, "tombstone")
    if new.force and new.leader_term is not None and new.leader_term < highest_term:
        probe("term.stale_rejected")
        return Verdict(
            False,
            Rule.STALE_TERM,
            f"forced write from leader term {new.leader_term} < highest applied term "
            f"{highest_term}",
        )
    if new.leader_term is not None and new.leader_term > highest_term + MAX_TERM_JUMP:
        return Verdict(
            False,
            Rule.TERM_JUMP,
            f"leader_term {new.leader_term} > highest applied term {highest_term} + "
            f"{MAX_TERM_JUMP} (the largest jump between two leaders)",
        )
    verdict = _judge(cur, new)
    if verdict.accepted and cur is not None:
        problem = _server_change_problem(cur, new)
        if problem is not None:
            probe("resolver.server_change")
            return Verdict(False, Rule.SERVER_CHANGE, f"{verdict.reason}: {problem}")
    return verdict


def _judge(cur: ServiceUnitStateData | None, new: ServiceUnitStateData) -> Verdict:
    """Rules 4 to 7 of :func:`resolve`: versions, transitions and brokers."""
    if cur is not None:
        if new.version_id <= cur.version_id:
            return Verdict(
                False,
                Rule.STALE_VERSION,
                f"version {new.version_id} <= current {cur.version_id}",
            )
        if new.version_id >= cur.version_id + 2 and (
            cur.state is not _S.Deleted or new.state is _S.Init
        ):
            probe("resolver.version_gap")
            return Verdict(
                True,
                Rule.VERSION_GAP,
                f"version {new.version_id} skips past current {cur.version_id} + 1",
            )
    src, dst = state_of(cur), new.state
    move = f"{src.value} -> {dst.value}"
    if src is _S.Deleted and dst is not _S.Init:
        return Verdict(False, Rule.BAD_TRANSITION, f"{move} not allowed")
    if new.force:
        return Verdict(True, Rule.FORCED, f"forced {move}")
    if not is_allowed_transition(src, dst):
        return Verdict(False, Rule.BAD_TRANSITION, f"{move} not allowed")
    problem = None if cur is None else _broker_problem(cur, new)
    if problem is not None:
        return Verdict(False, Rule.BAD_BROKERS, f"{move}: {problem}")
    return Verdict(True, Rule.TRANSITION, move)


def _server_change_problem(cur: ServiceUnitStateData, new: ServiceUnitStateData) -> str | None:
    """Rule 8 of :func:`resolve`: what is wrong with the change of server, or None if nothing."""
    was, will = server_of(cur), server_of(new)
    if was is None or was == will:
        return None
    if will is None:
        # Dropping the server: only a finished release (Free) or split (Deleted) may.
        if cur.state in (_S.Releasing, _S.Splitting):
            return None
        return (
            f"{new.state.value} would drop {cur.state.value} {was!r} while it may still serve "
            "(only a finished release or split leaves a bundle without a server)"
        )
    if cur.state is _S.Releasing and new.state is _S.Assigning:
        return None
    return (
        f"{new.state.value} would make {will!r} the server while {cur.state.value} {was!r} still "
        f"is (only Releasing -> Assigning hands a bundle over)"
    )


def _broker_problem(cur: ServiceUnitStateData, new: ServiceUnitStateData) -> str | None:
    """What is wrong with the brokers of an allowed ``cur -> new`` step, or None if nothing.

    Transitions out of Init have no broker checks (the caller skips them when there is no value;
    an Init value matches none of the cases below).
    """
    match cur.state, new.state:
        case _S.Owned, _S.Releasing:
            if new.source_broker is None:
                return "src must be set"
            if new.source_broker != cur.dst_broker:
                return _differs("src", new.source_broker, "current dst", cur.dst_broker)
            if new.dst_broker == cur.dst_broker:
                return f"dst must differ from current dst {new.dst_broker!r}"
        case _S.Owned, _S.Splitting:
            if new.source_broker != cur.dst_broker:
                return _differs("src", new.source_broker, "current dst", cur.dst_broker)
            if new.dst_broker is not None:
                return f"dst must be blank, got {new.dst_broker!r}"
        case (_S.Assigning, _S.Owned) | (_S.Releasing, _S.Free) | (_S.Splitting, _S.Deleted):
            return _changed_brokers(cur, new)
        case _S.Releasing, _S.Assigning:
            if new.dst_broker is None:
                return "dst must be set"
            return _changed_brokers(cur, new)
        case _S.Free, _S.Assigning:
            if new.dst_broker is None:
                return "dst must be set"
            if new.source_broker is not None:
                return f"src must be blank, got {new.source_broker!r}"
    return None


def _show(broker: str | None) -> str:
    return "null" if broker is None else repr(broker)


def _differs(name: str, value: str | None, other_name: str, other: str | None) -> str:
    return f"{name} {_show(value)} must equal {other_name} {_show(other)}"


def _changed_brokers(cur: ServiceUnitStateData, new: ServiceUnitStateData) -> str | None:
    if new.source_broker == cur.source_broker and new.dst_broker == cur.dst_broker:
        return None
    return (
        f"src and dst must be unchanged (current src={_show(cur.source_broker)} "
        f"dst={_show(cur.dst_broker)}, got src={_show(new.source_broker)} "
        f"dst={_show(new.dst_broker)})"
    )
