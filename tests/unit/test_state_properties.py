"""Properties of the resolver and the table over generated channel logs.

Logs are generated step by step against a model table, so that most writes are plausible next
steps (the next version, an allowed transition, brokers that mostly pass the checks) mixed with
stale, gapped, forced, tombstone and malformed messages.

The ownership properties are stated per bundle, as the channel only ever sees bundles one at a
time: an ``Owned`` value accepted as a normal transition never takes a bundle from a broker that had
not released it, and a bundle that was split never becomes Owned again except after an Init value,
a tombstone or an override. Whatever the rule that accepts it (a gap, an override), no value makes
another broker the server while one still is, but by the hand-over Releasing -> Assigning. (That a
split's parent is not re-created next to its children is kept by the namespace bundle layout in the
metadata store, not by the channel.) Leader terms never jump further than ``MAX_TERM_JUMP``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from lbd.core.ids import BrokerId, BundleId
from lbd.core.state import (
    ALLOWED_TRANSITIONS,
    MAX_TERM_JUMP,
    Rule,
    ServiceUnitState,
    ServiceUnitStateData,
    encode_value,
    state_of,
)
from lbd.core.table import ApplyResult, ChannelPosition, Outcome, StateTable

S = ServiceUnitState
BROKERS = [BrokerId("a"), BrokerId("b"), BrokerId("c")]
BUNDLES = [BundleId("t/n/0x00000000_0x80000000"), BundleId("t/n/0x80000000_0xffffffff")]

Message = tuple[ChannelPosition, BundleId, bytes]

maybe_broker = st.sampled_from([None, *BROKERS])


def _make(
    state: ServiceUnitState,
    version: int,
    dst: BrokerId | None,
    src: BrokerId | None,
    force: bool,
    term: int | None,
) -> ServiceUnitStateData:
    if dst is None and src is None:
        dst = BROKERS[0]
    return ServiceUnitStateData(
        state=state,
        version_id=version,
        dst_broker=dst,
        source_broker=src,
        force=force,
        timestamp_ms=0,
        leader_term=term,
    )


@st.composite
def plausible_step(draw: st.DrawFn, cur: ServiceUnitStateData | None) -> ServiceUnitStateData:
    """A next write of the kind sidecars make: next version, mostly allowed, fitting brokers."""
    src_state = state_of(cur)
    allowed = sorted(ALLOWED_TRANSITIONS[src_state], key=lambda s: s.value)
    # Now and then a writer with a stale view proposes a step the bundle's state does not allow.
    to = draw(st.sampled_from(list(ServiceUnitState) if draw(st.integers(0, 4)) == 0 else allowed))
    version = 0 if cur is None else cur.version_id + 1
    dst, src = (None, None) if cur is None else (cur.dst_broker, cur.source_broker)
    if (src_state, to) == (S.Owned, S.Releasing):
        dst, src = draw(maybe_broker), cur.dst_broker if cur else None
    elif (src_state, to) == (S.Owned, S.Splitting):
        dst, src = None, cur.dst_broker if cur else None
    elif (src_state, to) == (S.Free, S.Assigning) or cur is None:
        dst, src = draw(st.sampled_from(BROKERS)), None
    if to not in allowed or draw(st.integers(0, 9)) == 0:
        # Now and then a broker that may fail the checks.
        dst = draw(maybe_broker)
    return _make(to, version, dst, src, False, None)


@st.composite
def arbitrary_value(draw: st.DrawFn, cur: ServiceUnitStateData | None) -> ServiceUnitStateData:
    """Any value near the current version: stale, next or gapped, forced or not, any term."""
    base = 0 if cur is None else cur.version_id
    return _make(
        draw(st.sampled_from(list(ServiceUnitState))),
        max(0, base + draw(st.integers(-1, 3))),
        draw(maybe_broker),
        draw(maybe_broker),
        draw(st.booleans()),
        # Now and then a forged term, within the largest jump or far beyond it.
        draw(st.one_of(st.none(), st.integers(0, 4), st.sampled_from([10**6, 2**62]))),
    )


malformed = st.one_of(
    st.binary(min_size=1, max_size=20),
    st.sampled_from([b"{}", b"null", b'{"state": "Owned", "version_id": 1}', b"[]"]),
)


@st.composite
def channel_logs(draw: st.DrawFn) -> list[Message]:
    """A channel log: positions strictly increasing, values guided by a model table."""
    model = StateTable()
    log: list[Message] = []
    entry = 0
    for _ in range(draw(st.integers(0, 40))):
        entry += draw(st.integers(1, 3))
        position = ChannelPosition(0, entry, draw(st.sampled_from([-1, 0, 1])))
        key = draw(st.sampled_from(BUNDLES))
        cur = model.get(key)
        kind = draw(st.sampled_from(["plausible"] * 6 + ["arbitrary"] * 3 + ["tomb", "bad"]))
        if kind == "plausible":
            raw = encode_value(draw(plausible_step(cur)))
        elif kind == "arbitrary":
            raw = encode_value(draw(arbitrary_value(cur)))
        elif kind == "tomb":
            raw = b""
        else:
            raw = draw(malformed)
        model.apply(position, key, raw)
        log.append((position, key, raw))
    return log


def replay(log: list[Message], table: StateTable | None = None) -> list[ApplyResult]:
    target = StateTable() if table is None else table
    return [target.apply(position, key, raw) for position, key, raw in log]


def table_of(log: list[Message]) -> StateTable:
    table = StateTable()
    replay(log, table)
    return table


PROPERTY_SETTINGS = settings(max_examples=100, deadline=None)


@PROPERTY_SETTINGS
@given(channel_logs())
def test_two_tables_fed_the_same_log_are_identical(log: list[Message]) -> None:
    first, second = StateTable(), StateTable()
    assert replay(log, first) == replay(log, second)
    assert first.snapshot() == second.snapshot()


@PROPERTY_SETTINGS
@given(channel_logs(), st.data())
def test_redelivered_messages_change_nothing(log: list[Message], data: st.DataObject) -> None:
    # A reader catching up may see any earlier message again, before or after later ones.
    delivered: list[Message] = []
    for i, message in enumerate(log):
        delivered.append(message)
        repeats = data.draw(st.lists(st.integers(0, i), max_size=2))
        delivered.extend(log[j] for j in repeats)
    clean = replay(log)
    noisy = [r for r in replay(delivered) if r.outcome is not Outcome.DUPLICATE]
    assert noisy == clean
    assert table_of(delivered).snapshot() == table_of(log).snapshot()


@PROPERTY_SETTINGS
@given(channel_logs(), st.data())
def test_snapshot_then_tail_equals_full_replay(log: list[Message], data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(log)))
    head = table_of(log[:cut])
    restored = StateTable.from_snapshot(json.loads(json.dumps(head.snapshot())))
    # A checkpoint may lag the channel: the tail is replayed from a little before the cut.
    overlap = data.draw(st.integers(0, cut))
    replay(log[overlap:], restored)
    assert restored.snapshot() == table_of(log).snapshot()


@PROPERTY_SETTINGS
@given(channel_logs())
def test_accepted_versions_only_grow_until_a_tombstone(log: list[Message]) -> None:
    last: dict[BundleId, int] = {}
    for result in replay(log):
        if result.outcome is not Outcome.ACCEPTED:
            continue
        if result.new is None:
            last.pop(result.key, None)
            continue
        if result.key in last:
            assert result.new.version_id > last[result.key]
        last[result.key] = result.new.version_id


@PROPERTY_SETTINGS
@given(channel_logs())
def test_forced_writes_of_deposed_leaders_never_apply(log: list[Message]) -> None:
    highest = 0
    for result in replay(log):
        new = result.new
        if result.outcome is Outcome.ACCEPTED and new is not None and new.leader_term is not None:
            if new.force:
                assert new.leader_term >= highest
            highest = max(highest, new.leader_term)


@PROPERTY_SETTINGS
@given(channel_logs())
def test_leader_terms_never_jump_beyond_the_largest_jump(log: list[Message]) -> None:
    highest = 0
    for result in replay(log):
        new = result.new
        if result.outcome is Outcome.ACCEPTED and new is not None and new.leader_term is not None:
            assert new.leader_term <= highest + MAX_TERM_JUMP
            highest = max(highest, new.leader_term)


def _holder(value: ServiceUnitStateData | None) -> BrokerId | None:
    """Who still serves a bundle in this state, until it has released it."""
    if value is None:
        return None
    if value.state is S.Owned:
        return value.dst_broker
    if value.state is S.Splitting:
        return value.source_broker
    return None


@dataclass
class _Bundle:
    holder: BrokerId | None = None
    split: bool = False


@PROPERTY_SETTINGS
@given(channel_logs())
def test_owner_changes_only_after_a_release(log: list[Message]) -> None:
    bundles = {key: _Bundle() for key in BUNDLES}
    for result in replay(log):
        if result.outcome is not Outcome.ACCEPTED:
            continue
        b, new = bundles[result.key], result.new
        normal = result.rule is Rule.TRANSITION
        if normal and new is not None and new.state is S.Owned:
            assert b.holder in (None, new.dst_broker), f"{b.holder} never released {result.key}"
            assert not b.split, f"{result.key} owned again after a split"
        if not normal or new is None or new.state is S.Init:
            b.split = False
        if new is not None and new.state is S.Splitting:
            b.split = True
        b.holder = _holder(new)


def _server(value: ServiceUnitStateData | None) -> BrokerId | None:
    """The broker that may be serving a bundle in this state (written out apart from the core's
    ``server_of``): the owner, the source of a Releasing or Splitting, the dst of an Assigning."""
    if value is None:
        return None
    if value.state in (S.Owned, S.Assigning):
        return value.dst_broker
    if value.state in (S.Releasing, S.Splitting):
        return value.source_broker
    return None


@PROPERTY_SETTINGS
@given(channel_logs())
def test_the_server_changes_only_by_a_hand_over(log: list[Message]) -> None:
    for result in replay(log):
        if result.outcome is not Outcome.ACCEPTED:
            continue
        was, will = _server(result.old), _server(result.new)
        if was is not None and will is not None and was != will:
            assert result.old is not None and result.new is not None
            assert (result.old.state, result.new.state) == (S.Releasing, S.Assigning), (
                f"{result.key}: {result.rule} made {will} the server while {was} still was"
            )
