"""The materialised state table: the state channel applied in order, one value per bundle.

A reader of the channel may be handed a message twice, or older messages again while catching up
(DESIGN §1), so the table remembers the position of the last message it applied and refuses any
position that is not greater. A malformed value is skipped and reported, never raised: one bad
message must not stall every sidecar behind it, and as every sidecar skips it alike, their tables
stay identical. Each :meth:`StateTable.apply` returns what happened, old and new value included,
so a caller can log the decision and feed watchers from it.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import json
from collections.abc import Collection, ItemsView
from dataclasses import dataclass
from typing import Final

from lbd.core.bundles import FULL_UPPER, parse_bundle_id
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.state import (
    Rule,
    ServiceUnitState,
    ServiceUnitStateData,
    decode_value,
    from_json_object,
    holder,
    owner_of,
    resolve,
    to_json_object,
)


@dataclass(frozen=True, slots=True, order=True)
class ChannelPosition:
    """Where a message sits in the channel; positions compare in channel order.

    The fields are Pulsar's message id: ledger, entry within the ledger, and index within a
    batched entry (-1 for a message that was not batched).
    """

    ledger_id: int
    entry_id: int
    batch_index: int = -1

    def __post_init__(self) -> None:
        if type(self.ledger_id) is type(self.entry_id) is type(self.batch_index) is int:
            return  # the common case, checked at once (a bool is not an int here)
        for name in ("ledger_id", "entry_id", "batch_index"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidInputError(f"position {name} must be an integer, got {value!r}")

    def __str__(self) -> str:
        return f"{self.ledger_id}:{self.entry_id}:{self.batch_index}"

    def to_json(self) -> list[int]:
        """The position as a JSON array ``[ledger_id, entry_id, batch_index]``."""
        return [self.ledger_id, self.entry_id, self.batch_index]

    @classmethod
    def from_json(cls, obj: object) -> ChannelPosition:
        """Read a position written by :meth:`to_json`; InvalidInputError if it is not one."""
        if not isinstance(obj, list) or len(obj) != 3:
            raise InvalidInputError(
                f"position must be an array [ledger_id, entry_id, batch_index], got {obj!r}"
            )
        return cls(obj[0], obj[1], obj[2])


class Outcome(enum.Enum):
    """What applying one message did."""

    ACCEPTED = "accepted"
    """The resolver accepted the value (or tombstone); the table holds it now."""
    REJECTED = "rejected"
    """The resolver rejected the value; the table is unchanged."""
    DUPLICATE = "duplicate"
    """The position is not after the last applied one; the message was not looked at."""
    MALFORMED = "malformed"
    """The value could not be decoded; it was skipped."""


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """The result of applying one channel message to a :class:`StateTable`."""

    position: ChannelPosition
    key: BundleId
    outcome: Outcome
    reason: str
    """Why: the resolver's reason, or what is wrong with the value, or the duplicate position."""
    old: ServiceUnitStateData | None
    """The bundle's value before the message (None: no value)."""
    new: ServiceUnitStateData | None
    """The bundle's value after the message (the same as ``old`` unless accepted)."""
    proposed: ServiceUnitStateData | None = None
    """The decoded value the message carried (None for a tombstone, duplicate or malformed)."""
    rule: Rule | None = None
    """The resolver rule that decided (accepted and rejected messages only)."""
    digest: int = 0
    """The table's :attr:`StateTable.digest` once the message was applied."""

    @property
    def changed(self) -> bool:
        """Whether the bundle's value changed (an accepted write that was not a no-op)."""
        return self.outcome is Outcome.ACCEPTED and self.old != self.new


SNAPSHOT_FORMAT: Final = 1
"""Version of the :meth:`StateTable.snapshot` form; bumped on incompatible changes."""

DIGEST_MODULUS: Final = 2**64
""":attr:`StateTable.digest` is a sum of entry digests modulo this (a 64-bit value)."""


_CANONICAL: Final = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
"""Canonical JSON (keys sorted, no spaces), the encoder made once rather than per call."""


def entry_digest(bundle: BundleId, value: ServiceUnitStateData | None) -> int:
    """One bundle's share of :attr:`StateTable.digest`: 64 bits of the BLAKE2b hash of the bundle
    and its value as canonical JSON (keys sorted, so however the value was written or restored),
    0 for no value."""
    if value is None:
        return 0
    canonical = _CANONICAL.encode([bundle, to_json_object(value)]).encode()
    return int.from_bytes(hashlib.blake2b(canonical, digest_size=8).digest(), "big")


class StateTable:
    """Every bundle's current value, as the state channel says up to :attr:`last_position`."""

    def __init__(self) -> None:
        self._values: dict[BundleId, ServiceUnitStateData] = {}
        self._by_namespace: dict[str, _RangeIndex] = {}
        self._owners: dict[BundleId, BrokerId] = {}
        """:func:`owner_of` every bundle that has an owner, kept as values change."""
        self._holders: dict[BundleId, BrokerId] = {}
        """:func:`holder` of every bundle that has one, kept as values change."""
        self._owned_by: dict[BrokerId, dict[BundleId, None]] = {}
        """The bundles each owner owns (``_owners`` turned around), each in a dict as an
        ordered set: iterated in the order the bundles came, not in an order a set's hashing
        would give, which changes between processes (a simulation replays its seed exactly)."""
        self._unowned: dict[BundleId, None] = {}
        """Every bundle with a value and no owner (in flight, Free, Deleted), as an ordered set."""
        self._last: ChannelPosition | None = None
        self._highest_term = 0
        self._digest = 0
        self._shares: dict[BundleId, int] = {}
        """Each bundle's :func:`entry_digest`, so that a change hashes only its new value."""

    @property
    def last_position(self) -> ChannelPosition | None:
        """Position of the last message applied (None before the first one)."""
        return self._last

    @property
    def highest_term(self) -> int:
        """Highest leader term carried by an accepted value (0 if none)."""
        return self._highest_term

    @property
    def digest(self) -> int:
        """A digest of every value, independent of order: the sum of each bundle's
        :func:`entry_digest` modulo 2^64, kept up to date by each accepted change in O(1).

        Two tables that applied the same messages have the same digest, and a table differing in
        any value almost surely has another one; compare digests of tables at the same
        :attr:`last_position` (the leader's safety auditor does, :mod:`lbd.core.audit`).
        """
        return self._digest

    def get(self, bundle: BundleId) -> ServiceUnitStateData | None:
        """The bundle's current value; None if it has none (it is in Init)."""
        return self._values.get(bundle)

    def bundles(self) -> list[BundleId]:
        """Every bundle that has a value, as a list of its own (the table may change meanwhile).

        Cheaper to hold than a list of ``items()``: no pair is made per bundle, so a sweep of
        100k bundles does not set off the garbage collector.
        """
        return list(self._values)

    def items(self) -> ItemsView[BundleId, ServiceUnitStateData]:
        """A live read-only view of every bundle that has a value."""
        return self._values.items()

    def overlapping(self, bundle: BundleId) -> list[tuple[BundleId, ServiceUnitStateData]]:
        """Every other bundle with a value whose hash range intersects ``bundle``'s (same
        namespace: a split's parent and its children), with its value.

        Answered from a per-namespace index of ranges kept as values come and go, in time
        logarithmic in the namespace's bundles, not linear in the table's.
        """
        whole = parse_bundle_id(bundle)
        index = self._by_namespace.get(_namespace_of(bundle))
        if index is None:
            return []
        hi = whole.range.hi + whole.range.includes_upper
        values = self._values
        return [(b, values[b]) for b in index.overlapping(whole.range.lo, hi) if b != bundle]

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, bundle: object) -> bool:
        return bundle in self._values

    def owners(self) -> dict[BundleId, BrokerId]:
        """The owner of every Owned bundle (see :func:`~lbd.core.state.owner_of`), a copy."""
        return dict(self._owners)

    def splitting_into(self, broker: BrokerId, child: BundleId) -> bool:
        """Whether ``child`` is a child of a bundle that ``broker`` is splitting (``Splitting``
        from it): the broker may serve the child before the child has a value."""
        return any(
            value.state is ServiceUnitState.Splitting
            and value.source_broker == broker
            and child in (value.split_children or {})
            for _, value in self.unowned()
        )

    def holders(self) -> dict[BundleId, BrokerId]:
        """The broker each bundle depends on (see :func:`~lbd.core.state.holder`): its owner, or
        where an in-flight bundle is going; a copy."""
        return dict(self._holders)

    def apply(self, position: ChannelPosition, key: BundleId, value: bytes) -> ApplyResult:
        """Apply the message at ``position`` for bundle ``key`` with raw ``value``.

        Never raises on what the channel carries: a repeated position comes back DUPLICATE and a
        bad value MALFORMED (both leave the table as it was; a malformed one still advances the
        position so that it is not looked at again).
        """
        old = self._values.get(key)
        digest = self._digest
        if self._last is not None and position <= self._last:
            return ApplyResult(
                position,
                key,
                Outcome.DUPLICATE,
                f"position {position} <= last applied {self._last}",
                old,
                old,
                digest=digest,
            )
        self._last = position
        try:
            proposed = decode_value(value)
        except InvalidInputError as e:
            return ApplyResult(position, key, Outcome.MALFORMED, str(e), old, old, digest=digest)
        verdict = resolve(old, proposed, highest_term=self._highest_term)
        if not verdict.accepted:
            return ApplyResult(
                position,
                key,
                Outcome.REJECTED,
                verdict.reason,
                old,
                old,
                proposed,
                verdict.rule,
                digest,
            )
        if old != proposed:
            # The old value's share is kept, not hashed again: one hash per change.
            share = entry_digest(key, proposed)
            self._digest = digest = (digest - self._shares.get(key, 0) + share) % DIGEST_MODULUS
            if share:
                self._shares[key] = share
            else:
                self._shares.pop(key, None)
        if proposed is None:
            if self._values.pop(key, None) is not None:
                self._unindex(key)
        else:
            if old is None:
                self._index(key)
            self._values[key] = proposed
            if proposed.leader_term is not None and proposed.leader_term > self._highest_term:
                self._highest_term = proposed.leader_term
        self._note_brokers(key, proposed)
        return ApplyResult(
            position,
            key,
            Outcome.ACCEPTED,
            verdict.reason,
            old,
            proposed,
            proposed,
            verdict.rule,
            digest,
        )

    def owned_by(self, broker: BrokerId) -> list[BundleId]:
        """Every bundle Owned by ``broker``, as a list of its own, in time linear in those."""
        return list(self._owned_by.get(broker, ()))

    def unowned(self) -> list[tuple[BundleId, ServiceUnitStateData]]:
        """Every bundle with a value but no owner (in flight, Free, Deleted), with its value, in
        time linear in those: a calm table has few."""
        values = self._values
        return [(bundle, values[bundle]) for bundle in self._unowned]

    def not_owned_by(self, brokers: Collection[BrokerId]) -> list[BundleId]:
        """Every bundle with a value that is not Owned by one of ``brokers``: what the leader's
        monitor checks in a sweep, as a list of its own.

        In time linear in those bundles and the owners, not in the table: a sweep of a calm
        table of 100k bundles, all Owned by live brokers, checks none of them.
        """
        found = list(self._unowned)
        for owner, owned in self._owned_by.items():
            if owner not in brokers:
                found.extend(owned)
        return found

    def _note_brokers(self, bundle: BundleId, value: ServiceUnitStateData | None) -> None:
        owner = owner_of(value)
        before = self._owners.get(bundle)
        if before is not None and before != owner:
            owned = self._owned_by[before]
            del owned[bundle]
            if not owned:
                del self._owned_by[before]
        if owner is not None:
            self._owned_by.setdefault(owner, {})[bundle] = None
        if value is not None and owner is None:
            self._unowned[bundle] = None
        else:
            self._unowned.pop(bundle, None)
        for index, broker in ((self._owners, owner), (self._holders, holder(value))):
            if broker is None:
                index.pop(bundle, None)
            else:
                index[bundle] = broker

    def _index(self, bundle: BundleId) -> None:
        namespace = _namespace_of(bundle)
        index = self._by_namespace.get(namespace)
        if index is None:
            index = self._by_namespace[namespace] = _RangeIndex()
        index.add(bundle)

    def _unindex(self, bundle: BundleId) -> None:
        namespace = _namespace_of(bundle)
        index = self._by_namespace.get(namespace)
        if index is not None and index.remove(bundle) and not index:
            del self._by_namespace[namespace]

    def snapshot(self) -> dict[str, object]:
        """The table as plain JSON-able data (for checkpoints): values, position, highest term."""
        head, values = self.snapshot_source()
        head["table"] = {bundle: to_json_object(data) for bundle, data in values.items()}
        return head

    def snapshot_source(self) -> tuple[dict[str, object], dict[BundleId, ServiceUnitStateData]]:
        """:meth:`snapshot` as of now, not yet made: every field, with ``table`` last and empty,
        and a copy of the values (which are immutable) to make its entries from, in order.

        Making 100k entries JSON-able can then be spread over many turns of the event loop
        instead of one stretch of it (:func:`lbd.services.channel.checkpoints.serialised`).
        """
        head: dict[str, object] = {
            "format": SNAPSHOT_FORMAT,
            "position": None if self._last is None else self._last.to_json(),
            "highest_term": self._highest_term,
            "table": {},
        }
        return head, dict(self._values)

    @classmethod
    def from_snapshot(cls, obj: object) -> StateTable:
        """Rebuild a table from :meth:`snapshot` output; InvalidInputError naming what is wrong."""
        if not isinstance(obj, dict):
            raise InvalidInputError("snapshot must be a JSON object")
        if obj.get("format") != SNAPSHOT_FORMAT:
            raise InvalidInputError(
                f"snapshot format {obj.get('format')!r} is not supported "
                f"(expected {SNAPSHOT_FORMAT})"
            )
        term = obj.get("highest_term")
        if not isinstance(term, int) or isinstance(term, bool) or term < 0:
            raise InvalidInputError(f"snapshot highest_term must be an integer >= 0, got {term!r}")
        values = obj.get("table")
        if not isinstance(values, dict):
            raise InvalidInputError("snapshot table must be a JSON object")
        table = cls()
        raw_position = obj.get("position")
        table._last = None if raw_position is None else ChannelPosition.from_json(raw_position)
        table._highest_term = term
        for bundle, value in values.items():
            try:
                data = from_json_object(value)
            except InvalidInputError as e:
                raise InvalidInputError(f"snapshot table[{bundle!r}]: {e}") from None
            key = BundleId(bundle)
            table._values[key] = data
            table._index(key)
            table._note_brokers(key, data)
        table._shares = {b: entry_digest(b, v) for b, v in table._values.items()}
        table._digest = sum(table._shares.values()) % DIGEST_MODULUS
        return table


def _namespace_of(bundle: BundleId) -> str:
    """``tenant/namespace`` of a bundle id (any key: the part before its last slash)."""
    return bundle.rpartition("/")[0]


_ABOVE_ALL: Final = FULL_UPPER + 2
"""Above every upper bound an index entry holds (the top of the space is stored plus one)."""


class _RangeIndex:
    """One namespace's bundles sorted by the lower bound of their range, for overlap queries.

    A bundle overlaps ``[lo, hi)`` when its lower bound is below ``hi`` and its upper bound
    above ``lo``; its lower bound is then at least ``lo`` minus the longest range indexed, so a
    query looks at that slice only (a namespace's bundles rarely overlap: a split's parent and
    children do, until the parent's tombstone). Keys that are no bundle id overlap nothing and
    are not indexed.
    """

    __slots__ = ("_entries", "_lengths", "_longest")

    def __init__(self) -> None:
        self._entries: list[tuple[int, int, BundleId]] = []
        """(lower bound, upper bound + 1 if it includes the top of the space, bundle), sorted."""
        self._lengths: dict[BundleId, int] = {}
        self._longest: int | None = 0
        """The longest range indexed; None when it must be found again (it was removed)."""

    def __bool__(self) -> bool:
        return bool(self._entries)

    def add(self, bundle: BundleId) -> None:
        try:
            r = parse_bundle_id(bundle).range
        except InvalidInputError:
            return
        hi = r.hi + r.includes_upper
        bisect.insort(self._entries, (r.lo, hi, bundle))
        self._lengths[bundle] = hi - r.lo
        if self._longest is not None:
            self._longest = max(self._longest, hi - r.lo)

    def remove(self, bundle: BundleId) -> bool:
        """Drop ``bundle``; whether it was indexed."""
        length = self._lengths.pop(bundle, None)
        if length is None:
            return False
        r = parse_bundle_id(bundle).range
        i = bisect.bisect_left(self._entries, (r.lo, r.hi + r.includes_upper, bundle))
        del self._entries[i]
        if length == self._longest:
            self._longest = None
        return True

    def overlapping(self, lo: int, hi: int) -> list[BundleId]:
        """The bundles whose range intersects ``[lo, hi)``."""
        if self._longest is None:
            self._longest = max(self._lengths.values(), default=0)
        entries = self._entries
        start = bisect.bisect_right(entries, (lo - self._longest, _ABOVE_ALL))
        end = bisect.bisect_left(entries, (hi,))
        return [b for _, b_hi, b in entries[start:end] if b_hi > lo]
