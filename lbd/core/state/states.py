"""The service-unit states, the transitions between them, and the value a bundle has on the
state channel (DESIGN §4), with who owns, holds and serves a bundle by its value."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId


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
