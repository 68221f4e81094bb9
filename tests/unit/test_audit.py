"""The safety auditor's pure parts: the table digest, what sidecars publish for the audit, each
check at its bound, the digest history, and findings over consecutive audits."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbd.core.audit import (
    AuditBounds,
    AuditData,
    DeadOwnerAnswers,
    DeadOwnerWatch,
    DigestHistory,
    DivergenceTracker,
    Finding,
    FindingKind,
    FindingTracker,
    check_bundle,
    check_dead_owner_answers,
    check_table,
    divergence,
    value_age_s,
)
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData
from lbd.core.settings import MonitorConfig
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, encode_value
from lbd.core.table import DIGEST_MODULUS, ChannelPosition, StateTable, entry_digest
from tests.channel_values import data

S = ServiceUnitState
A, B, C = BrokerId("broker-a"), BrokerId("broker-b"), BrokerId("broker-c")
B1 = BundleId("public/default/0x00000000_0x40000000")
B2 = BundleId("public/default/0x40000000_0x80000000")
NOW_MS = 1_700_000_000_000
BOUNDS = AuditBounds.of(
    MonitorConfig(interval_s=10, inflight_timeout_s=30, orphan_cleanup_grace_s=60),
    handover_wait_s=25,
)
"""G 60, I 30, D 25, slack 20: announce due at 80 s, a stuck value at 50 s."""
LONG = 10.0**6
"""A leader that has led for ever: no bound is cut short."""


def value(state: ServiceUnitState, version: int = 1, **fields: Any) -> ServiceUnitStateData:
    """The shared builder's value, to broker ``A`` unless said otherwise."""
    fields.setdefault("dst", A)
    fields.setdefault("timestamp_ms", 0)
    return data(state, version, **fields)


def pos(entry: int) -> ChannelPosition:
    return ChannelPosition(3, entry)


# -- the table digest --------------------------------------------------------------------------


def apply_all(table: StateTable, messages: list[tuple[BundleId, bytes]], first: int = 0) -> None:
    for i, (bundle, raw) in enumerate(messages):
        table.apply(pos(first + i), bundle, raw)


LOG = [
    (B1, encode_value(value(S.Assigning))),
    (B2, encode_value(value(S.Owned, dst=B))),
    (B1, encode_value(value(S.Owned, 2))),
    (B1, encode_value(value(S.Owned, 2, dst=C))),  # rejected: same version
    (B2, b"{not json"),  # malformed
    (B2, b""),  # tombstone
    (B2, encode_value(value(S.Splitting, 1, src=B, children={B1: A, B2: None}))),
]


def test_two_tables_that_applied_the_same_messages_have_the_same_digest() -> None:
    one, other = StateTable(), StateTable()
    apply_all(one, LOG)
    apply_all(other, LOG)
    assert one.digest == other.digest != 0
    assert StateTable.from_snapshot(json.loads(json.dumps(one.snapshot()))).digest == one.digest


def test_the_digest_does_not_depend_on_the_order_of_different_bundles() -> None:
    one, other = StateTable(), StateTable()
    apply_all(one, [LOG[0], LOG[1]])
    apply_all(other, [LOG[1], LOG[0]])
    assert one.digest == other.digest


def test_a_tombstone_takes_the_bundle_out_of_the_digest() -> None:
    table = StateTable()
    free = value(S.Free, dst=None, src=B)
    apply_all(table, [(B2, encode_value(free))])
    assert table.digest == entry_digest(B2, free) != 0
    table.apply(pos(1), B2, b"")
    assert table.get(B2) is None and table.digest == 0


@pytest.mark.parametrize(
    "changed",
    [
        {"state": S.Assigning},
        {"version_id": 3},
        {"dst_broker": B},
        {"source_broker": C},
        {"split_children": {B1: None}},
        {"force": True},
        {"timestamp_ms": 1},
        {"leader_term": 7},
    ],
    ids=lambda c: next(iter(c)),
)
def test_any_difference_in_one_value_changes_the_digest(changed: dict[str, object]) -> None:
    base = value(S.Owned, 2, timestamp_ms=0)
    different = dataclasses.replace(base, **changed)  # type: ignore[arg-type]
    one, other = StateTable(), StateTable()
    for table, last in ((one, base), (other, different)):
        apply_all(table, [(B2, encode_value(value(S.Owned, dst=B))), (B1, encode_value(last))])
        assert table.get(B1) == last
    assert one.last_position == other.last_position
    assert one.digest != other.digest


def test_the_same_value_under_another_bundle_changes_the_digest() -> None:
    assert entry_digest(B1, value(S.Owned)) != entry_digest(B2, value(S.Owned))


_values = st.builds(
    value,
    st.sampled_from([S.Owned, S.Assigning, S.Releasing, S.Free]),
    st.integers(1, 4),
    dst=st.sampled_from([A, B]),
    src=st.sampled_from([None, C]),
    force=st.booleans(),
)
_messages = st.lists(
    st.tuples(
        st.sampled_from([B1, B2]),
        st.one_of(_values.map(encode_value), st.just(b""), st.just(b"[]")),
    ),
    max_size=30,
)


@settings(max_examples=100, deadline=None)
@given(_messages)
def test_the_incremental_digest_is_the_digest_of_the_whole_table(
    messages: list[tuple[BundleId, bytes]],
) -> None:
    table = StateTable()
    for i, (bundle, raw) in enumerate(messages):
        table.apply(pos(i), bundle, raw)
        whole = sum(entry_digest(b, v) for b, v in table.items()) % DIGEST_MODULUS
        assert table.digest == whole


# -- what a sidecar publishes ------------------------------------------------------------------


def test_audit_data_travels_with_the_load_report() -> None:
    audit = AuditData(pos(9), 2**64 - 1, DeadOwnerAnswers(3, B1, C, 12.5))
    data = BrokerLoadData(A, reported_at_ms=5, audit=audit)
    assert BrokerLoadData.from_json(data.to_json()) == data
    assert json.loads(data.to_json())["audit"]["digest"] == "ffffffffffffffff"
    fresh = AuditData(None, 0)
    assert BrokerLoadData.from_json(BrokerLoadData(A, audit=fresh).to_json()).audit == fresh


def test_a_report_without_audit_data_reads_as_unknown() -> None:
    old = json.dumps({"broker": A, "weighted_max_ema": 0.5}).encode()
    assert BrokerLoadData.from_json(old).audit is None
    assert "audit" not in json.loads(BrokerLoadData(A).to_json())


@pytest.mark.parametrize(
    ("audit", "names"),
    [
        ({"position": [1, 2, -1], "digest": 5}, "digest"),
        ({"position": [1, 2, -1], "digest": "abc"}, "digest"),
        ({"position": [1, 2], "digest": "0" * 16}, "position"),
        ({"position": None, "digest": "0" * 16, "dead_owner_lookups": -1}, "dead_owner_lookups"),
        ({"position": None, "digest": "0" * 16, "dead_owner_broker": " "}, "dead_owner_broker"),
        ([], "audit"),
    ],
)
def test_malformed_audit_data_names_the_field(audit: object, names: str) -> None:
    raw = json.dumps({"broker": A, "audit": audit}).encode()
    with pytest.raises(InvalidInputError, match=names):
        BrokerLoadData.from_json(raw)


# -- the table and the registry ----------------------------------------------------------------


def check(
    v: ServiceUnitStateData,
    *,
    live: tuple[BrokerId, ...] = (A, B, C),
    away: dict[BrokerId, float] | None = None,
    age: float = 0.0,
    responsible: float = LONG,
) -> Finding | None:
    return check_bundle(
        B1,
        v,
        live=live,
        away_s=away or {},
        age_s=age,
        responsible_s=responsible,
        bounds=BOUNDS,
    )


def test_an_owner_gone_past_the_grace_and_two_sweeps_is_a_stale_owner() -> None:
    owned = value(S.Owned)
    assert check(owned, live=(B,), away={A: 80.0}) is None
    finding = check(owned, live=(B,), away={A: 81.0})
    assert finding is not None
    assert (finding.kind, finding.bundle, finding.broker) == (FindingKind.STALE_OWNER, B1, A)
    assert "81s ago" in finding.detail
    assert "lbd ctl decisions" in finding.action and "lbd ctl transfer" in finding.action
    # A leader elected 70 s ago has not been late yet, however long the broker has been away.
    assert check(owned, live=(B,), away={A: 500.0}, responsible=70.0) is None


@pytest.mark.parametrize(
    ("state", "fields", "says"),
    [
        (S.Assigning, {"dst": A}, "never confirmed owning"),
        (S.Releasing, {"dst": B, "src": A}, "did not finish releasing"),
        (S.Splitting, {"dst": None, "src": A}, "split"),
    ],
)
def test_an_in_flight_value_past_its_timeout_and_two_sweeps_is_stuck(
    state: ServiceUnitState, fields: dict[str, object], says: str
) -> None:
    v = value(state, 1, **fields)
    assert check(v, age=50.0) is None
    finding = check(v, age=51.0)
    assert finding is not None
    assert (finding.kind, finding.broker) == (FindingKind.STUCK_IN_FLIGHT, A)
    assert says in finding.action
    assert check(v, age=500.0, responsible=49.0) is None


def test_an_announced_move_off_a_gone_broker_is_stuck_only_past_the_hand_over() -> None:
    announced = value(S.Releasing, dst=B, src=A, force=True)
    away_past = {A: 60 + 20 + 25 + 1.0}
    assert check(announced, live=(B,), away=away_past, age=45.0) is None  # D + slack
    assert check(announced, live=(B,), away={A: 105.0}, age=46.0) is None  # G + D + slack
    finding = check(announced, live=(B,), away=away_past, age=46.0)
    assert finding is not None and finding.kind is FindingKind.STUCK_IN_FLIGHT
    assert "hand" in finding.detail and "etcd" in finding.action


def test_an_assigning_to_a_gone_broker_is_due_for_announcement_like_an_owned_bundle() -> None:
    assigning = value(S.Assigning, dst=A)
    assert check(assigning, live=(B,), away={A: 80.0}, age=500.0) is None
    finding = check(assigning, live=(B,), away={A: 81.0})
    assert finding is not None and finding.kind is FindingKind.STUCK_IN_FLIGHT
    assert "left the broker registry 81s ago" in finding.detail


def test_settled_values_with_live_servers_are_fine() -> None:
    for v in (value(S.Owned), value(S.Free), value(S.Deleted, dst=None, src=A)):
        assert check(v, age=10.0**6) is None


def test_the_table_check_ages_undated_values_from_when_they_were_first_seen() -> None:
    undated = value(S.Releasing, 4, dst=B, src=A)
    assert value_age_s(B1, undated, NOW_MS, {}) == 0
    assert value_age_s(B1, undated, NOW_MS, {(B1, 4): NOW_MS - 60_000}) == 60
    dated = dataclasses.replace(undated, timestamp_ms=NOW_MS - 1000)
    assert value_age_s(B1, dated, NOW_MS, {(B1, 4): 0}) == 1
    findings = check_table(
        [(B2, value(S.Owned)), (B1, undated)],
        live=(A, B),
        away_s={},
        now_ms=NOW_MS,
        first_seen_ms={(B1, 4): NOW_MS - 60_000},
        responsible_s=LONG,
        bounds=BOUNDS,
    )
    assert [(f.kind, f.bundle) for f in findings] == [(FindingKind.STUCK_IN_FLIGHT, B1)]


# -- the sidecars' tables ----------------------------------------------------------------------


def test_the_digest_history_answers_for_positions_it_covers() -> None:
    history = DigestHistory(pos(10), 100, limit=3)
    history.record(pos(12), 120)
    history.record(pos(15), 150)
    assert history.at(pos(10), known_until=pos(20)) == 100
    assert history.at(pos(11), known_until=pos(20)) == 100  # a rejected message: no change
    assert history.at(pos(14), known_until=pos(20)) == 120
    assert history.at(pos(20), known_until=pos(20)) == 150
    assert history.at(pos(21), known_until=pos(20)) is None  # not reached yet
    assert history.at(pos(9), known_until=pos(20)) is None  # before it started
    history.record(pos(15), 999)  # replayed: ignored
    assert history.latest == 150


def test_the_digest_history_keeps_bounded_memory() -> None:
    history = DigestHistory(None, 0, limit=4)
    assert history.at(None, known_until=None) == 0
    for i in range(100):
        history.record(pos(i), i)
        assert len(history) <= 8
    assert history.at(pos(99), known_until=pos(99)) == 99
    assert history.at(pos(96), known_until=pos(99)) == 96
    assert history.at(pos(50), known_until=pos(99)) is None
    assert history.at(None, known_until=pos(99)) is None


def test_a_divergence_is_confirmed_by_two_reports_in_a_row() -> None:
    tracker = DivergenceTracker()
    assert tracker.observe(B, 1, pos(5), 7, 8) is None  # the first one may be a fluke
    assert tracker.observe(B, 1, pos(5), 7, 8) is None  # the same report again
    assert tracker.observe(B, 2, pos(9), 7, None) is None  # not comparable: nothing learnt
    mismatch = tracker.observe(B, 3, pos(9), 7, 9)
    assert mismatch is not None and (mismatch.reports, mismatch.ours) == (2, 9)
    assert tracker.observe(B, 4, pos(99), 7, None) == mismatch  # still divergent
    assert tracker.observe(B, 5, pos(10), 9, 9) is None  # agrees: cleared
    assert tracker.observe(B, 6, pos(10), 1, 2) is None
    tracker.retain([A])
    assert tracker.observe(B, 7, pos(10), 1, 2) is None


def test_a_divergence_names_the_sidecar_or_the_leader_when_most_disagree() -> None:
    mismatch = DivergenceTracker()
    mismatch.observe(B, 1, pos(5), 7, 8)
    confirmed = mismatch.observe(B, 2, pos(5), 7, 8)
    assert confirmed is not None
    one = divergence(B, confirmed, address="10.0.0.2:7000", leader=A, disagreeing=1, compared=3)
    assert (one.kind, one.broker, one.bundle) == (FindingKind.TABLE_DIVERGENCE, B, None)
    assert one.action.startswith(f"Restart sidecar {B}")
    assert "--server 10.0.0.2:7000 bundles" in one.action
    assert "3:5:-1" in one.detail and f"{7:016x}" in one.detail
    most = divergence(B, confirmed, address=None, leader=A, disagreeing=2, compared=3)
    assert most.action.startswith(f"2 of 3 sidecars disagree with the leader {A}")


# -- the lookups -------------------------------------------------------------------------------


def test_dead_owner_answers_count_only_when_they_grew() -> None:
    watch = DeadOwnerWatch()
    assert not watch.grew(B, 5)  # the baseline
    assert not watch.grew(B, 5)
    assert watch.grew(B, 6)
    assert not watch.grew(B, 0)  # restarted
    assert watch.grew(B, 1)


def dead_owner(
    away: float | None, *, registered: bool = False, leader: ServiceUnitStateData | None = None
) -> Finding | None:
    return check_dead_owner_answers(
        C,
        DeadOwnerAnswers(4, B1, A, away),
        registered=registered,
        leader_away_s=None if registered else 1000.0,
        leader_value=leader,
        responsible_s=LONG,
        bounds=BOUNDS,
    )


def test_dead_owner_answers_during_a_failover_are_no_finding() -> None:
    assert dead_owner(80.0, leader=value(S.Owned)) is None


def test_dead_owner_answers_past_the_failover_say_why() -> None:
    behind_etcd = dead_owner(81.0, registered=True)
    assert behind_etcd is not None
    assert (behind_etcd.kind, behind_etcd.broker, behind_etcd.bundle) == (
        FindingKind.LOOKUP_DEAD_OWNER,
        C,
        B1,
    )
    assert "registry is behind etcd" in behind_etcd.action
    not_moved = dead_owner(81.0, leader=value(S.Owned))
    assert not_moved is not None and "stale_owner" in not_moved.action
    moved = dead_owner(81.0, leader=value(S.Owned, dst=B))
    assert moved is not None and "table is behind" in moved.action
    # Never saw it registered: the leader's view of how long it has been away decides.
    assert dead_owner(None, leader=value(S.Owned)) is not None


# -- findings over time ------------------------------------------------------------------------


def test_a_finding_is_dated_from_when_it_was_first_seen_in_a_row() -> None:
    tracker = FindingTracker()
    stale = Finding(FindingKind.STALE_OWNER, B1, A, "d", "a")
    lookups = Finding(FindingKind.LOOKUP_DEAD_OWNER, B1, C, "d", "a")
    assert [f.since_ms for f in tracker.update([stale], 100)] == [100]
    moved_on = dataclasses.replace(lookups, bundle=B2)
    dated = tracker.update([stale, lookups], 200)
    assert [(f.kind, f.since_ms) for f in dated] == [
        (FindingKind.LOOKUP_DEAD_OWNER, 200),
        (FindingKind.STALE_OWNER, 100),
    ]
    # A sidecar's finding keeps its date when its latest bundle changes; a gap resets it.
    assert [f.since_ms for f in tracker.update([moved_on], 300)] == [200]
    assert [f.since_ms for f in tracker.update([stale], 400)] == [400]
