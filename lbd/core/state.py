"""The service-unit state machine, its channel value and the conflict resolver (DESIGN §4).

Every sidecar applies the state channel with :func:`resolve`, in channel order, so every sidecar
materialises the same table: the first valid change of a bundle wins and later conflicting ones are
ignored by everyone. The rules are Pulsar's ``ServiceUnitStateDataConflictResolver`` for a
system-topic channel, plus the leader term of DESIGN §4, checked first of all, and the server rule
(a bundle changes brokers only by a hand-over), checked last (see :func:`resolve`).

A value travels as a JSON object with every field present (absent ones null); the empty value is a
tombstone. :func:`decode_value` is deliberately lenient where leniency cannot split the cluster
(unknown fields are ignored so that sidecars of different versions agree; a null ``force`` or
``timestamp_ms`` reads as Pulsar's defaults) and strict everywhere else.
"""

from __future__ import annotations

import enum
import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from lbd.core.bundles import bundle_id, parse_bundle_id
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.names import NamespaceName
from lbd.core.probes import probe


class ServiceUnitState(enum.Enum):
    """The state of a bundle in the channel; the value is its spelling on the wire."""

    Init = "Init"
    """No ownership; a bundle with no value (never written or tombstoned) is in Init."""
    Free = "Free"
    """Not owned by any broker (unloaded)."""
    Owned = "Owned"
    """Owned by ``dst_broker``."""
    Assigning = "Assigning"
    """Being assigned to ``dst_broker`` (from ``source_broker`` on a transfer)."""
    Releasing = "Releasing"
    """``source_broker`` is closing the bundle, handing it to ``dst_broker`` on a transfer."""
    Splitting = "Splitting"
    """``source_broker`` is splitting the bundle into ``split_children``."""
    Deleted = "Deleted"
    """Gone (the parent of a split); tombstoned later."""

    @property
    def is_in_flight(self) -> bool:
        """True for the transient states (Assigning, Releasing, Splitting)."""
        return self in _IN_FLIGHT


_IN_FLIGHT: Final = frozenset(
    {ServiceUnitState.Assigning, ServiceUnitState.Releasing, ServiceUnitState.Splitting}
)

_S = ServiceUnitState
ALLOWED_TRANSITIONS: Final[Mapping[ServiceUnitState, frozenset[ServiceUnitState]]] = (
    MappingProxyType(
        {
            # Out of Init anything goes but Init: a reader may start after older messages of an
            # assignment, transfer or split were dropped.
            _S.Init: frozenset(
                {_S.Free, _S.Owned, _S.Assigning, _S.Releasing, _S.Splitting, _S.Deleted}
            ),
            _S.Free: frozenset({_S.Assigning, _S.Init}),
            _S.Owned: frozenset({_S.Splitting, _S.Releasing}),
            _S.Assigning: frozenset({_S.Owned}),
            _S.Releasing: frozenset({_S.Assigning, _S.Free}),
            _S.Splitting: frozenset({_S.Deleted}),
            _S.Deleted: frozenset({_S.Init}),
        }
    )
)
"""For each state, the states a non-forced write may move it to (DESIGN §4)."""


def is_allowed_transition(src: ServiceUnitState, dst: ServiceUnitState) -> bool:
    """Whether a non-forced write may move a bundle from ``src`` to ``dst``."""
    return dst in ALLOWED_TRANSITIONS[src]


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceUnitStateData:
    """One value of the state channel: a bundle's state and who is involved.

    Pulsar keeps the same record; as there, at least one broker must be named. Brokers are either
    None or non-blank (:func:`decode_value` reads a blank broker as None).
    """

    state: ServiceUnitState
    version_id: int
    """Per-bundle counter: a writer proposes the current value's version + 1."""
    dst_broker: BrokerId | None = None
    """The owner (Owned), or the broker the bundle is going to (Assigning, Releasing)."""
    source_broker: BrokerId | None = None
    """The broker the bundle comes from (Releasing, Assigning on a transfer, Splitting)."""
    split_children: Mapping[BundleId, BrokerId | None] | None = field(default=None, hash=False)
    """Splitting: each child bundle and the broker it goes to (None: assigned later)."""
    force: bool = False
    """An override (of the leader's monitor or cleanup): skips the transition checks."""
    timestamp_ms: int = 0
    """When the writer wrote it (its wall clock); 0 when unknown."""
    leader_term: int | None = None
    """The writer's leader term, set on writes the leader makes as leader."""

    def __post_init__(self) -> None:
        if not isinstance(self.state, ServiceUnitState):
            raise InvalidInputError(f"state must be a ServiceUnitState, got {self.state!r}")
        _check_count("version_id", self.version_id)
        _check_count("timestamp_ms", self.timestamp_ms)
        if self.leader_term is not None:
            _check_count("leader_term", self.leader_term)
        if not isinstance(self.force, bool):
            raise InvalidInputError(f"force must be a boolean, got {self.force!r}")
        for name in ("dst_broker", "source_broker"):
            _check_broker(name, getattr(self, name))
        if self.dst_broker is None and self.source_broker is None:
            raise InvalidInputError(
                "dst_broker and source_broker are both empty; name at least one"
            )
        if self.split_children is not None:
            if len(self.split_children) > MAX_SPLIT_CHILDREN:
                raise InvalidInputError(
                    f"split_children: {len(self.split_children)} children, at most "
                    f"{MAX_SPLIT_CHILDREN}"
                )
            for child, broker in self.split_children.items():
                if not isinstance(child, str) or not child.strip():
                    raise InvalidInputError(f"split_children: bad bundle id {child!r}")
                _check_broker(f"split_children[{child!r}]", broker)
            # A read-only copy keeps the value immutable however the caller built it.
            object.__setattr__(self, "split_children", MappingProxyType(dict(self.split_children)))


INT64_MAX: Final = 2**63 - 1
"""The largest version, term or timestamp: the API carries them as int64."""
MAX_VALUE_BYTES: Final = 64 * 1024
"""A channel value larger than this is malformed (a real one is a few hundred bytes)."""
MAX_BROKER_ID_CHARS: Final = 256
MAX_SPLIT_CHILDREN: Final = 8192
"""Most children one split names. Up to :data:`LISTED_SPLIT_CHILDREN` the value lists them by
id; beyond, by the widths of their ranges (:func:`to_json_object`), which keeps 8,192 children of
a full range within :data:`MAX_VALUE_BYTES`."""
LISTED_SPLIT_CHILDREN: Final = 64
"""Up to this many children, a Splitting value lists each child's id (as Pulsar's does)."""


def _check_count(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidInputError(f"{name} must be an integer, got {value!r}")
    if not 0 <= value <= INT64_MAX:
        raise InvalidInputError(f"{name} must be between 0 and 2^63-1, got {value}")


def _check_broker(name: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise InvalidInputError(f"{name} must be a string or null, got {value!r}")
    if not value.strip():
        raise InvalidInputError(f"{name} must not be blank (use null)")
    if len(value) > MAX_BROKER_ID_CHARS or not value.isprintable():
        raise InvalidInputError(
            f"{name} must be at most {MAX_BROKER_ID_CHARS} printable characters, got {value[:40]!r}"
        )


def state_of(data: ServiceUnitStateData | None) -> ServiceUnitState:
    """The state of a bundle whose current value is ``data`` (no value means Init)."""
    return ServiceUnitState.Init if data is None else data.state


# --- the JSON codec -------------------------------------------------------------------------

TOMBSTONE: Final = b""
"""The empty value: deletes the bundle's entry."""

FIELDS: Final = (
    "state",
    "dst_broker",
    "source_broker",
    "split_children",
    "force",
    "timestamp_ms",
    "version_id",
    "leader_term",
)
"""The fields of a channel value, in wire order."""


def owner_of(data: ServiceUnitStateData | None) -> BrokerId | None:
    """The broker that owns the bundle now: ``dst`` of an Owned value, else None."""
    if data is not None and data.state is _S.Owned:
        return data.dst_broker
    return None


def holder(data: ServiceUnitStateData | None) -> BrokerId | None:
    """The broker a bundle depends on: its owner, or where an in-flight bundle is going (the
    source of a Splitting or of a plain unload). None for Init, Free and Deleted.

    This is who must be alive for the bundle to make progress: the leader's monitor treats a
    bundle whose holder left the registry as an orphan.
    """
    if data is not None and (data.state is _S.Owned or data.state.is_in_flight):
        return data.dst_broker or data.source_broker
    return None


def server_of(data: ServiceUnitStateData | None) -> BrokerId | None:
    """The broker that may be serving the bundle: the owner of an Owned value, the source of a
    Releasing or Splitting one (it serves until it has closed the bundle), the destination of an
    Assigning one (it is told to Own as soon as its sidecar sees the value). None for Init, Free,
    Deleted and no value.

    :func:`resolve` lets a value change the server from one broker to another only in the hand-over
    ``Releasing(src=X) -> Assigning(dst=Y)``, which a sidecar writes only once X has stopped.
    """
    if data is None:
        return None
    if data.state is _S.Owned or data.state is _S.Assigning:
        return data.dst_broker
    if data.state is _S.Releasing or data.state is _S.Splitting:
        return data.source_broker
    return None


def to_json_object(data: ServiceUnitStateData) -> dict[str, object]:
    """``data`` as the JSON object of the channel: every field present, absent ones None."""
    children = data.split_children
    obj: dict[str, object] = {
        "state": data.state.value,
        "dst_broker": data.dst_broker,
        "source_broker": data.source_broker,
        "split_children": None if children is None else dict(children),
        "force": data.force,
        "timestamp_ms": data.timestamp_ms,
        "version_id": data.version_id,
        "leader_term": data.leader_term,
    }
    if children is not None and len(children) > LISTED_SPLIT_CHILDREN:
        ranges = _as_ranges(children)
        if ranges is not None:
            obj["split_children"] = None
            obj["split_ranges"] = ranges
    return obj


def _as_ranges(children: Mapping[BundleId, BrokerId | None]) -> dict[str, object] | None:
    """The children as ``{"namespace", "lo", "widths", "broker", "brokers"}``: the namespace, the
    lower bound of the first range, the width of each range in order (the next starts where one
    ends), the broker of most children (or null), and the broker (or null) of each other child by
    its index. None when the children are not adjacent ranges of one namespace (a split's always
    are)."""
    try:
        bundles = sorted(parse_bundle_id(child) for child in children)
    except InvalidInputError:
        return None
    namespace = bundles[0].namespace
    widths = []
    for i, bundle in enumerate(bundles):
        if bundle.namespace != namespace or (i and bundle.range.lo != bundles[i - 1].range.hi):
            return None
        widths.append(bundle.range.hi - bundle.range.lo)
    brokers = [children[bundle.id] for bundle in bundles]
    usual = Counter(brokers).most_common(1)[0][0]
    return {
        "namespace": str(namespace),
        "lo": bundles[0].range.lo,
        "widths": widths,
        "broker": usual,
        "brokers": {str(i): broker for i, broker in enumerate(brokers) if broker != usual},
    }


def from_json_object(obj: object) -> ServiceUnitStateData:
    """Read a channel value from its parsed JSON object.

    ``state`` and ``version_id`` are required; ``force`` and ``timestamp_ms`` read null or absent
    as False and 0; a blank broker reads as None; unknown fields are ignored (a newer writer may
    add some). Raises InvalidInputError naming the field that is wrong.
    """
    if not isinstance(obj, dict):
        raise InvalidInputError(f"value must be a JSON object, got {_json_type(obj)}")
    for name in ("state", "version_id"):
        if obj.get(name) is None:
            raise InvalidInputError(f"value is missing required field {name!r}")
    raw_state = obj["state"]
    try:
        state = ServiceUnitState(raw_state)
    except ValueError:
        known = ", ".join(s.value for s in ServiceUnitState)
        raise InvalidInputError(f"unknown state {raw_state!r} (expected one of {known})") from None
    force = obj.get("force")
    timestamp_ms = obj.get("timestamp_ms")
    return ServiceUnitStateData(
        state=state,
        version_id=obj["version_id"],
        dst_broker=_read_broker("dst_broker", obj.get("dst_broker")),
        source_broker=_read_broker("source_broker", obj.get("source_broker")),
        split_children=_read_children(obj.get("split_children"), obj.get("split_ranges")),
        force=False if force is None else force,
        timestamp_ms=0 if timestamp_ms is None else timestamp_ms,
        leader_term=obj.get("leader_term"),
    )


_COMPACT: Final = json.JSONEncoder(separators=(",", ":"))
"""``json.dumps(..., separators=(",", ":"))`` made once: ``dumps`` with any argument builds a
new encoder per call, a third of the cost of encoding a value."""


def encode_value(data: ServiceUnitStateData | None) -> bytes:
    """The channel message value for ``data``; None encodes as the tombstone (empty bytes).

    Raises InvalidInputError when the value would be larger than :data:`MAX_VALUE_BYTES`.
    """
    if data is None:
        return TOMBSTONE
    raw = _COMPACT.encode(to_json_object(data)).encode()
    if len(raw) > MAX_VALUE_BYTES:
        # Every reader would skip it as malformed: refused before it is ever published.
        what = f" ({len(data.split_children)} split children)" if data.split_children else ""
        raise InvalidInputError(
            f"a {data.state.value} value{what} would be {len(raw)} bytes, more than the "
            f"channel's {MAX_VALUE_BYTES}"
        )
    return raw


def decode_value(raw: bytes) -> ServiceUnitStateData | None:
    """Decode a channel message value; the empty value is a tombstone (None).

    Raises InvalidInputError saying what is wrong with a malformed value.
    """
    if not raw:
        return None
    if len(raw) > MAX_VALUE_BYTES:
        raise InvalidInputError(f"value is {len(raw)} bytes, more than {MAX_VALUE_BYTES}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInputError(f"value is not UTF-8 (byte {e.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidInputError(f"value is not JSON: {e}") from None
    return from_json_object(obj)


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _read_broker(name: str, value: object) -> BrokerId | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str):
        raise InvalidInputError(f"{name} must be a string or null, got {_json_type(value)}")
    return BrokerId(value)


def _read_children(value: object, ranges: object = None) -> dict[BundleId, BrokerId | None] | None:
    if ranges is not None:
        if value is not None:
            raise InvalidInputError("split_children and split_ranges are both set; set one")
        return _read_ranges(ranges)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidInputError(
            f"split_children must be an object or null, got {_json_type(value)}"
        )
    return {
        BundleId(child): _read_broker(f"split_children[{child!r}]", broker)
        for child, broker in value.items()
    }


def _read_ranges(value: object) -> dict[BundleId, BrokerId | None]:
    """The children of a ``split_ranges`` object (see :func:`_as_ranges`)."""
    if not isinstance(value, dict):
        raise InvalidInputError(f"split_ranges must be an object, got {_json_type(value)}")
    namespace_text, lo, widths, brokers = (
        value.get(k) for k in ("namespace", "lo", "widths", "brokers")
    )
    if not isinstance(namespace_text, str):
        raise InvalidInputError("split_ranges.namespace must be a string")
    namespace = NamespaceName.parse(namespace_text)
    if not isinstance(widths, list) or not 2 <= len(widths) <= MAX_SPLIT_CHILDREN:
        raise InvalidInputError(
            f"split_ranges.widths must be an array of 2 to {MAX_SPLIT_CHILDREN} widths"
        )
    if not isinstance(brokers, dict):
        raise InvalidInputError("split_ranges.brokers must be an object")
    _check_count("split_ranges.lo", lo)
    assert isinstance(lo, int)
    ids: list[BundleId] = []
    for i, width in enumerate(widths):
        _check_count(f"split_ranges.widths[{i}]", width)
        try:
            ids.append(bundle_id(namespace, lo, lo + width))  # validates the range
        except InvalidInputError as e:
            raise InvalidInputError(f"split_ranges.widths[{i}]: {e}") from None
        lo += width
    usual = _read_broker("split_ranges.broker", value.get("broker"))
    children: dict[BundleId, BrokerId | None] = dict.fromkeys(ids, usual)
    for index, broker in brokers.items():
        if not (isinstance(index, str) and index.isdigit() and int(index) < len(ids)):
            raise InvalidInputError(f"split_ranges.brokers: no child {index!r}")
        children[ids[int(index)]] = _read_broker(f"split_ranges.brokers[{index!r}]", broker)
    return children


# --- the resolver ---------------------------------------------------------------------------


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
