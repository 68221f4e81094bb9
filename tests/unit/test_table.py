"""The materialised state table: positions, duplicates, malformed values, snapshots."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbd.core.bundles import parse_bundle_id
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.state import (
    Rule,
    ServiceUnitState,
    ServiceUnitStateData,
    encode_value,
    holder,
    owner_of,
    to_json_object,
)
from lbd.core.table import ChannelPosition, Outcome, StateTable
from tests.channel_values import data as value

S = ServiceUnitState
A, B = BrokerId("a:8080"), BrokerId("b:8080")
X, Y = BundleId("t/n/0x00000000_0x80000000"), BundleId("t/n/0x80000000_0xffffffff")


def pos(entry: int, batch: int = -1, ledger: int = 1) -> ChannelPosition:
    return ChannelPosition(ledger, entry, batch)


# --- positions --------------------------------------------------------------------------------


def test_positions_order_by_ledger_then_entry_then_batch() -> None:
    ordered = [pos(9, ledger=1), pos(0, ledger=2), pos(1, -1, 2), pos(1, 0, 2), pos(1, 3, 2)]
    assert sorted(reversed(ordered)) == ordered
    assert pos(1, 0) < pos(1, 1) < pos(2, -1)
    assert pos(3) == ChannelPosition(1, 3, -1)


def test_position_json_round_trip() -> None:
    p = ChannelPosition(7, 8, 2)
    assert ChannelPosition.from_json(json.loads(json.dumps(p.to_json()))) == p
    assert str(p) == "7:8:2"


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"ledger_id": 1}, "must be an array"),
        ([1, 2], "must be an array"),
        ([1, "2", 3], "entry_id must be an integer"),
        ([1, 2, None], "batch_index must be an integer"),
        ([True, 2, 3], "ledger_id must be an integer"),
    ],
)
def test_bad_position_json_is_named(obj: object, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        ChannelPosition.from_json(obj)


# --- applying ---------------------------------------------------------------------------------


def test_accepted_write_is_stored_and_reported() -> None:
    table = StateTable()
    first = value(S.Assigning, 1, dst=A)
    result = table.apply(pos(1), X, encode_value(first))
    assert result.outcome is Outcome.ACCEPTED
    assert result.rule is Rule.TRANSITION
    assert (result.old, result.new, result.proposed) == (None, first, first)
    assert result.changed
    assert result.reason == "Init -> Assigning"
    assert table.get(X) == first
    assert table.get(Y) is None
    assert table.last_position == pos(1)
    assert len(table) == 1
    assert X in table
    assert dict(table.items()) == {X: first}


def test_rejected_write_leaves_the_table_and_reports_the_proposal() -> None:
    table = StateTable()
    owned = value(S.Owned, 1, dst=A)
    table.apply(pos(1), X, encode_value(owned))
    loser = value(S.Assigning, 2, dst=B)
    result = table.apply(pos(2), X, encode_value(loser))
    assert result.outcome is Outcome.REJECTED
    assert result.rule is Rule.BAD_TRANSITION
    assert result.reason == "Owned -> Assigning not allowed"
    assert (result.old, result.new, result.proposed) == (owned, owned, loser)
    assert not result.changed
    assert table.get(X) == owned
    assert table.last_position == pos(2)


def test_tombstone_removes_the_bundle() -> None:
    table = StateTable()
    free = value(S.Free, 3, src=A)
    table.apply(pos(1), X, encode_value(free))
    result = table.apply(pos(2), X, b"")
    assert result.outcome is Outcome.ACCEPTED
    assert (result.old, result.new) == (free, None)
    assert result.changed
    assert table.get(X) is None
    assert X not in table
    # With no value the next write is judged from Init, whatever its version.
    again = value(S.Assigning, 1, dst=B)
    assert table.apply(pos(3), X, encode_value(again)).outcome is Outcome.ACCEPTED


def test_tombstone_of_nothing_is_accepted_but_changes_nothing() -> None:
    table = StateTable()
    result = table.apply(pos(1), X, b"")
    assert result.outcome is Outcome.ACCEPTED
    assert not result.changed
    assert len(table) == 0


@pytest.mark.parametrize("again", [pos(5), pos(4), pos(5, 0, 0), pos(1)])
def test_positions_not_after_the_last_are_duplicates(again: ChannelPosition) -> None:
    table = StateTable()
    owned = value(S.Owned, 1, dst=A)
    table.apply(pos(5), X, encode_value(owned))
    # Even a value that would otherwise be accepted is not looked at.
    tomb = table.apply(again, X, b"")
    assert tomb.outcome is Outcome.DUPLICATE
    assert tomb.reason == f"position {again} <= last applied {pos(5)}"
    assert (tomb.old, tomb.new) == (owned, owned)
    assert table.apply(again, Y, b"garbage").outcome is Outcome.DUPLICATE
    assert table.get(X) == owned
    assert table.last_position == pos(5)


def test_batch_index_orders_messages_within_an_entry() -> None:
    table = StateTable()
    owned = encode_value(value(S.Owned, 1, dst=A))
    assert table.apply(pos(5, 0), X, owned).outcome is Outcome.ACCEPTED
    assert table.apply(pos(5, 1), Y, owned).outcome is Outcome.ACCEPTED
    assert table.apply(pos(5, 1), Y, b"").outcome is Outcome.DUPLICATE


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"not json", "value is not JSON"),
        (b'{"state": "Gone", "version_id": 1, "dst_broker": "a"}', "unknown state 'Gone'"),
        (b'{"state": "Owned", "dst_broker": "a"}', "missing required field 'version_id'"),
    ],
)
def test_malformed_value_is_skipped_reported_and_passed(raw: bytes, reason: str) -> None:
    table = StateTable()
    owned = value(S.Owned, 1, dst=A)
    table.apply(pos(1), X, encode_value(owned))
    result = table.apply(pos(2), X, raw)
    assert result.outcome is Outcome.MALFORMED
    assert reason in result.reason
    assert (result.old, result.new, result.proposed, result.rule) == (owned, owned, None, None)
    assert table.get(X) == owned
    # The position moved on: the channel does not stall on a bad message.
    assert table.last_position == pos(2)
    assert table.apply(pos(2), X, raw).outcome is Outcome.DUPLICATE
    release = value(S.Releasing, 2, src=A)
    assert table.apply(pos(3), X, encode_value(release)).outcome is Outcome.ACCEPTED


def test_highest_term_follows_accepted_values_only() -> None:
    table = StateTable()
    assert table.highest_term == 0
    table.apply(pos(1), X, encode_value(value(S.Owned, 1, dst=A, force=True, term=4)))
    assert table.highest_term == 4
    # Rejected (stale version) although its term is higher: terms count once applied.
    table.apply(pos(2), X, encode_value(value(S.Free, 1, src=A, force=True, term=9)))
    assert table.highest_term == 4
    stale = table.apply(pos(3), Y, encode_value(value(S.Owned, 1, dst=B, force=True, term=3)))
    assert stale.outcome is Outcome.REJECTED
    assert stale.rule is Rule.STALE_TERM
    assert table.get(Y) is None
    table.apply(pos(4), Y, encode_value(value(S.Owned, 1, dst=B, term=6)))
    assert table.highest_term == 6
    table.apply(pos(5), X, encode_value(value(S.Releasing, 2, src=A, term=2)))
    assert table.highest_term == 6


# --- snapshots --------------------------------------------------------------------------------


def _filled() -> StateTable:
    table = StateTable()
    table.apply(pos(1), X, encode_value(value(S.Owned, 1, dst=A, force=True, term=2)))
    splitting = ServiceUnitStateData(
        state=S.Splitting,
        version_id=4,
        source_broker=A,
        split_children={BundleId("t/n/a"): A, BundleId("t/n/b"): None},
        timestamp_ms=5,
    )
    table.apply(pos(2, 0), Y, encode_value(splitting))
    return table


def test_snapshot_round_trips_through_json() -> None:
    table = _filled()
    snap = json.loads(json.dumps(table.snapshot()))
    assert snap["position"] == [1, 2, 0]
    assert snap["highest_term"] == 2
    assert snap["table"][X]["dst_broker"] == A
    restored = StateTable.from_snapshot(snap)
    assert dict(restored.items()) == dict(table.items())
    assert restored.last_position == table.last_position
    assert restored.highest_term == table.highest_term
    assert restored.snapshot() == table.snapshot()
    # The restored table refuses what the original already covered.
    assert restored.apply(pos(2, 0), X, b"").outcome is Outcome.DUPLICATE


def test_a_snapshot_made_from_its_source_later_is_the_table_as_it_was_when_asked_for() -> None:
    table = _filled()
    before = table.snapshot()
    head, values = table.snapshot_source()
    table.apply(pos(9), X, encode_value(value(S.Releasing, 9, src=A, term=5)))
    table.apply(
        pos(10), BundleId("t/n/0x00000000_0x00000010"), encode_value(value(S.Owned, 1, dst=B))
    )
    assert list(head)[-1] == "table"
    assert {**head, "table": {b: to_json_object(d) for b, d in values.items()}} == before
    assert table.snapshot() != before


def test_empty_snapshot_round_trips() -> None:
    restored = StateTable.from_snapshot(json.loads(json.dumps(StateTable().snapshot())))
    assert restored.last_position is None
    assert restored.highest_term == 0
    assert len(restored) == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: [1], "snapshot must be a JSON object"),
        (lambda s: {**s, "format": 99}, "snapshot format 99 is not supported"),
        (lambda s: {k: v for k, v in s.items() if k != "format"}, "snapshot format None"),
        (lambda s: {**s, "highest_term": -1}, "highest_term must be an integer >= 0"),
        (lambda s: {**s, "highest_term": "2"}, "highest_term must be an integer >= 0"),
        (lambda s: {**s, "table": []}, "snapshot table must be a JSON object"),
        (lambda s: {**s, "position": [1, 2]}, "position must be an array"),
        (
            lambda s: {**s, "table": {**s["table"], X: {"state": "Owned"}}},
            f"snapshot table['{X}']: value is missing required field 'version_id'",
        ),
    ],
)
def test_bad_snapshot_is_named(change: Callable[[dict[str, Any]], object], message: str) -> None:
    snap = json.loads(json.dumps(_filled().snapshot()))
    with pytest.raises(InvalidInputError) as info:
        StateTable.from_snapshot(change(snap))
    assert message in str(info.value)


@pytest.mark.slow
def test_a_hundred_thousand_bundles() -> None:
    table = StateTable()
    for i in range(100_000):
        raw = encode_value(value(S.Owned, 1, dst=A if i % 2 else B))
        table.apply(pos(i), BundleId(f"t/n/{i:08x}"), raw)
    assert len(table) == 100_000
    restored = StateTable.from_snapshot(json.loads(json.dumps(table.snapshot())))
    assert dict(restored.items()) == dict(table.items())
    assert restored.get(BundleId("t/n/00000003")) == value(S.Owned, 1, dst=A)


# --- overlapping bundles ---------------------------------------------------------------------


def _brute_overlapping(table: StateTable, bundle: BundleId) -> set[BundleId]:
    whole = parse_bundle_id(bundle)
    return {b for b, _ in table.items() if b != bundle and parse_bundle_id(b).overlaps(whole)}


_ns = st.sampled_from(["t/n", "t/m"])
_bound = st.integers(min_value=0, max_value=0xFFFFFFFF)


@st.composite
def _bundles(draw: st.DrawFn) -> BundleId:
    lo, hi = sorted(draw(st.lists(_bound, min_size=2, max_size=2, unique=True)))
    return BundleId(f"{draw(_ns)}/0x{lo:08x}_0x{hi:08x}")


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.tuples(_bundles(), st.booleans()), max_size=40),
    queries=st.lists(_bundles(), min_size=1, max_size=10),
)
def test_overlaps_owners_and_holders_follow_the_values(
    steps: list[tuple[BundleId, bool]], queries: list[BundleId]
) -> None:
    # Values come (Owned) and go (released, freed and tombstoned); the index follows them, and
    # a checkpoint's table answers the same.
    table = StateTable()
    entry = 0

    def write(bundle: BundleId, value: ServiceUnitStateData | None) -> None:
        nonlocal entry
        entry += 1
        table.apply(pos(entry), bundle, encode_value(value))

    for bundle, present in steps:
        current = table.get(bundle)
        if present and current is None:
            write(bundle, value(S.Owned, 1, dst=A))
        elif not present and current is not None:
            write(bundle, value(S.Releasing, current.version_id + 1, src=A))
            write(bundle, value(S.Free, current.version_id + 2, src=A))
            write(bundle, None)
        # The owners and holders kept as values change are those of the values.
        assert table.owners() == {b: o for b, v in table.items() if (o := owner_of(v))}
        assert table.holders() == {b: h for b, v in table.items() if (h := holder(v))}
    restored = StateTable.from_snapshot(json.loads(json.dumps(table.snapshot())))
    assert restored.owners() == table.owners() and restored.holders() == table.holders()
    for query in [*queries, *(b for b, _ in steps)]:
        expected = _brute_overlapping(table, query)
        assert {b for b, _ in table.overlapping(query)} == expected, query
        assert {b for b, _ in restored.overlapping(query)} == expected, query
        assert all(v == table.get(b) for b, v in table.overlapping(query))


_C = BrokerId("c:8080")
_brokers = st.sampled_from([A, B, _C])


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from([X, Y, BundleId("t/m/0x00000000_0xffffffff")]),
            st.sampled_from([S.Owned, S.Assigning, S.Releasing, S.Splitting, S.Free, None]),
            _brokers,
        ),
        max_size=40,
    ),
    live=st.sets(_brokers),
)
def test_the_bundles_owned_by_each_broker_and_by_none_follow_the_values(
    steps: list[tuple[BundleId, ServiceUnitState | None, BrokerId]], live: set[BrokerId]
) -> None:
    # What the leader's sweep checks: every bundle whose value is not Owned by a live broker,
    # kept as values come, change owner and go; a checkpoint's table answers the same.
    table = StateTable()

    def expected(t: StateTable) -> set[BundleId]:
        return {b for b, v in t.items() if not (v.state is S.Owned and v.dst_broker in live)}

    for entry, (bundle, state, broker) in enumerate(steps, 1):
        current = table.get(bundle)
        version = 1 if current is None else current.version_id + 1
        new = None if state is None else value(state, version, dst=broker, src=broker, force=True)
        table.apply(pos(entry), bundle, encode_value(new))
        found = table.not_owned_by(live)
        assert len(found) == len(set(found))
        assert set(found) == expected(table)
        assert dict(table.unowned()) == {b: v for b, v in table.items() if v.state is not S.Owned}
        for broker in (A, B, _C):
            owned = {b for b, v in table.items() if v.state is S.Owned and v.dst_broker == broker}
            assert set(table.owned_by(broker)) == owned
    restored = StateTable.from_snapshot(json.loads(json.dumps(table.snapshot())))
    assert set(restored.not_owned_by(live)) == expected(table)


def test_a_key_that_is_no_bundle_id_overlaps_nothing() -> None:
    table = StateTable()
    table.apply(pos(1), BundleId("t/n/not-a-range"), encode_value(value(S.Owned, 1, dst=A)))
    table.apply(pos(2), X, encode_value(value(S.Owned, 1, dst=A)))
    assert table.overlapping(Y) == []
    assert table.overlapping(BundleId("t/n/0x00000000_0xffffffff")) == [(X, table.get(X))]
