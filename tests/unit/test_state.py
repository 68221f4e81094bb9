"""The state machine, the channel value codec and the conflict resolver (DESIGN §4)."""

from __future__ import annotations

import json
from itertools import pairwise, product

import pytest

from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.state import (
    FIELDS,
    LISTED_SPLIT_CHILDREN,
    MAX_SPLIT_CHILDREN,
    MAX_TERM_JUMP,
    MAX_VALUE_BYTES,
    ServiceUnitState,
    ServiceUnitStateData,
    decode_value,
    encode_value,
    is_allowed_transition,
    resolve,
    server_of,
    state_of,
)
from lbd.core.state import Rule as R
from lbd.core.state import ServiceUnitState as S

A, B, C = BrokerId("a:8080"), BrokerId("b:8080"), BrokerId("c:8080")
CUR_VERSION = 5

# Written out from DESIGN §4, independently of the module's table.
DESIGN_TRANSITIONS = {
    (S.Init, S.Free),
    (S.Init, S.Owned),
    (S.Init, S.Assigning),
    (S.Init, S.Releasing),
    (S.Init, S.Splitting),
    (S.Init, S.Deleted),
    (S.Free, S.Assigning),
    (S.Free, S.Init),
    (S.Owned, S.Splitting),
    (S.Owned, S.Releasing),
    (S.Assigning, S.Owned),
    (S.Releasing, S.Assigning),
    (S.Releasing, S.Free),
    (S.Splitting, S.Deleted),
    (S.Deleted, S.Init),
}


def data(
    state: ServiceUnitState,
    version: int = CUR_VERSION,
    *,
    dst: BrokerId | None = None,
    src: BrokerId | None = None,
    force: bool = False,
    term: int | None = None,
) -> ServiceUnitStateData:
    return ServiceUnitStateData(
        state=state,
        version_id=version,
        dst_broker=dst,
        source_broker=src,
        force=force,
        timestamp_ms=1000,
        leader_term=term,
    )


# A typical current value for every state (None: the bundle has no value).
CURRENT: dict[str, ServiceUnitStateData | None] = {
    "none": None,
    "Init": data(S.Init, src=A),
    "Free": data(S.Free, src=A),
    "Owned": data(S.Owned, dst=A),
    "Assigning": data(S.Assigning, dst=B, src=A),
    "Releasing": data(S.Releasing, dst=B, src=A),
    "Splitting": data(S.Splitting, src=A),
    "Deleted": data(S.Deleted, src=A),
}
PAIRS = list(product(CURRENT, ServiceUnitState))


def next_value(
    cur: ServiceUnitStateData | None, to: ServiceUnitState, version: int, force: bool = False
) -> ServiceUnitStateData:
    """A write of ``to`` whose brokers pass the broker checks of ``cur -> to`` when it has any."""
    match state_of(cur), to:
        case S.Owned, S.Releasing:
            assert cur is not None
            return data(to, version, dst=B, src=cur.dst_broker, force=force)
        case S.Owned, S.Splitting:
            assert cur is not None
            return data(to, version, src=cur.dst_broker, force=force)
        case S.Free, S.Assigning:
            return data(to, version, dst=B, force=force)
    if cur is None:
        return data(to, version, dst=A, force=force)
    return data(to, version, dst=cur.dst_broker, src=cur.source_broker, force=force)


def version_after(cur: ServiceUnitStateData | None, step: int) -> int:
    return (CUR_VERSION if cur is None else cur.version_id) + step


def same_server(cur: ServiceUnitStateData | None) -> BrokerId:
    """A broker that, as both src and dst of any value, keeps the server of ``cur`` (or names one
    where ``cur`` has none), and fails most broker checks."""
    return server_of(cur) or C


SERVERLESS = (S.Init, S.Free, S.Deleted)


def drops_server(cur: ServiceUnitStateData | None, to: S) -> bool:
    """Whether a value in state ``to`` would leave ``cur``'s server behind other than by
    finishing a release or a split (the server rule refuses that)."""
    return (
        server_of(cur) is not None
        and to in SERVERLESS
        and state_of(cur) not in (S.Releasing, S.Splitting)
    )


KEEPING_PAIRS = [
    p
    for p in PAIRS
    if not drops_server(CURRENT[p[0]], p[1]) and (p[0] != "Deleted" or p[1] is S.Init)
]
"""Pairs whose write keeps the server (a deleted bundle only ever goes back to Init)."""
DROPPING_PAIRS = [p for p in PAIRS if drops_server(CURRENT[p[0]], p[1])]


# --- the transition table ---------------------------------------------------------------------


@pytest.mark.parametrize(("src", "dst"), list(product(ServiceUnitState, ServiceUnitState)))
def test_allowed_transitions_are_those_of_the_design(src: S, dst: S) -> None:
    assert is_allowed_transition(src, dst) == ((src, dst) in DESIGN_TRANSITIONS)


@pytest.mark.parametrize("state", list(ServiceUnitState))
def test_in_flight_states(state: S) -> None:
    assert state.is_in_flight == (state in {S.Assigning, S.Releasing, S.Splitting})


def test_no_value_is_init() -> None:
    assert state_of(None) is S.Init
    assert state_of(data(S.Owned, dst=A)) is S.Owned


# --- every (from, to) pair at the next version --------------------------------------------------


@pytest.mark.parametrize(("cur_name", "to"), PAIRS)
def test_next_version_is_accepted_iff_the_transition_is_allowed(cur_name: str, to: S) -> None:
    cur = CURRENT[cur_name]
    new = next_value(cur, to, version_after(cur, 1))
    verdict = resolve(cur, new, highest_term=0)
    allowed = (state_of(cur), to) in DESIGN_TRANSITIONS
    assert verdict.accepted == allowed, verdict.reason
    if allowed:
        assert verdict.rule is R.TRANSITION
        assert verdict.reason == f"{state_of(cur).value} -> {to.value}"
    else:
        assert verdict.rule is R.BAD_TRANSITION
        assert verdict.reason == f"{state_of(cur).value} -> {to.value} not allowed"


@pytest.mark.parametrize(("cur_name", "to"), KEEPING_PAIRS)
def test_forced_next_version_that_keeps_the_server_is_always_accepted(cur_name: str, to: S) -> None:
    cur = CURRENT[cur_name]
    # Brokers that fail most broker checks: force skips them as well as the transition table.
    broker = same_server(cur)
    new = data(to, version_after(cur, 1), dst=broker, src=broker, force=True)
    verdict = resolve(cur, new, highest_term=0)
    assert verdict.accepted
    assert verdict.rule is R.FORCED


@pytest.mark.parametrize(("cur_name", "to"), [p for p in KEEPING_PAIRS if p[0] != "none"])
@pytest.mark.parametrize("step", [2, 3, 1000])
def test_version_gap_that_keeps_the_server_is_accepted_without_checks(
    cur_name: str, to: S, step: int
) -> None:
    cur = CURRENT[cur_name]
    broker = same_server(cur)
    new = data(to, version_after(cur, step), dst=broker, src=broker)
    verdict = resolve(cur, new, highest_term=0)
    assert verdict.accepted
    assert verdict.rule is R.VERSION_GAP


@pytest.mark.parametrize(("cur_name", "to"), [p for p in PAIRS if p[0] != "none"])
@pytest.mark.parametrize("step", [0, -1, -CUR_VERSION])
@pytest.mark.parametrize("force", [False, True])
def test_version_not_above_current_is_rejected(
    cur_name: str, to: S, step: int, force: bool
) -> None:
    cur = CURRENT[cur_name]
    new = next_value(cur, to, version_after(cur, step), force=force)
    verdict = resolve(cur, new, highest_term=0)
    assert not verdict.accepted
    assert verdict.rule is R.STALE_VERSION
    assert verdict.reason == f"version {new.version_id} <= current {CUR_VERSION}"


@pytest.mark.parametrize("to", [s for s in ServiceUnitState if s is not S.Init])
@pytest.mark.parametrize("version", [0, 1, 7, 10**12])
def test_no_current_value_is_judged_from_init_whatever_the_version(to: S, version: int) -> None:
    verdict = resolve(None, data(to, version, dst=C, src=C), highest_term=0)
    assert verdict.accepted
    assert verdict.reason == f"Init -> {to.value}"


def test_init_value_onto_no_value_is_rejected() -> None:
    verdict = resolve(None, data(S.Init, 1, src=A), highest_term=0)
    assert not verdict.accepted
    assert verdict.reason == "Init -> Init not allowed"


# --- broker checks --------------------------------------------------------------------------

OWNED_A = data(S.Owned, dst=A)
FREE = data(S.Free, src=A)
ASSIGNING = data(S.Assigning, dst=B, src=A)
RELEASING = data(S.Releasing, dst=B, src=A)
SPLITTING = data(S.Splitting, src=A)
N = CUR_VERSION + 1

BROKER_CASES = [
    # Owned -> Releasing: src set and == cur.dst, dst != cur.dst
    ("unload", OWNED_A, data(S.Releasing, N, src=A), None),
    ("transfer", OWNED_A, data(S.Releasing, N, dst=B, src=A), None),
    ("release no src", OWNED_A, data(S.Releasing, N, dst=B), "src must be set"),
    (
        "release wrong src",
        OWNED_A,
        data(S.Releasing, N, dst=B, src=C),
        "src 'c:8080' must equal current dst 'a:8080'",
    ),
    (
        "release to owner",
        OWNED_A,
        data(S.Releasing, N, dst=A, src=A),
        "dst must differ from current dst 'a:8080'",
    ),
    # Owned -> Splitting: src == cur.dst, dst blank
    ("split", OWNED_A, data(S.Splitting, N, src=A), None),
    (
        "split wrong src",
        OWNED_A,
        data(S.Splitting, N, src=B),
        "src 'b:8080' must equal current dst 'a:8080'",
    ),
    ("split with dst", OWNED_A, data(S.Splitting, N, dst=B, src=A), "dst must be blank"),
    # Assigning -> Owned: unchanged
    ("own", ASSIGNING, data(S.Owned, N, dst=B, src=A), None),
    ("own other dst", ASSIGNING, data(S.Owned, N, dst=C, src=A), "must be unchanged"),
    ("own other src", ASSIGNING, data(S.Owned, N, dst=B), "must be unchanged"),
    # Releasing -> Free: unchanged
    ("free", RELEASING, data(S.Free, N, dst=B, src=A), None),
    ("free other dst", RELEASING, data(S.Free, N, src=A), "must be unchanged"),
    ("free other src", RELEASING, data(S.Free, N, dst=B, src=C), "must be unchanged"),
    # Splitting -> Deleted: unchanged
    ("delete", SPLITTING, data(S.Deleted, N, src=A), None),
    ("delete other src", SPLITTING, data(S.Deleted, N, src=B), "must be unchanged"),
    ("delete with dst", SPLITTING, data(S.Deleted, N, dst=B, src=A), "must be unchanged"),
    # Releasing -> Assigning: dst set, unchanged
    ("hand over", RELEASING, data(S.Assigning, N, dst=B, src=A), None),
    (
        "hand over no dst",
        data(S.Releasing, src=A),
        data(S.Assigning, N, src=A),
        "dst must be set",
    ),
    ("hand over other dst", RELEASING, data(S.Assigning, N, dst=C, src=A), "must be unchanged"),
    ("hand over other src", RELEASING, data(S.Assigning, N, dst=B, src=C), "must be unchanged"),
    # Free -> Assigning: dst set, src blank
    ("assign", FREE, data(S.Assigning, N, dst=B), None),
    ("assign no dst", FREE, data(S.Assigning, N, src=B), "dst must be set"),
    ("assign with src", FREE, data(S.Assigning, N, dst=B, src=A), "src must be blank"),
    # No checks: Free -> Init, Deleted -> Init, out of an Init value
    ("reset free", FREE, data(S.Init, N, dst=C), None),
    ("reset deleted", data(S.Deleted, src=A), data(S.Init, N, dst=C), None),
    ("from init value", data(S.Init, src=A), data(S.Owned, N, dst=C), None),
]


@pytest.mark.parametrize(
    ("cur", "new", "problem"),
    [case[1:] for case in BROKER_CASES],
    ids=[case[0] for case in BROKER_CASES],
)
def test_broker_checks(
    cur: ServiceUnitStateData, new: ServiceUnitStateData, problem: str | None
) -> None:
    verdict = resolve(cur, new, highest_term=0)
    if problem is None:
        assert verdict.accepted, verdict.reason
        assert verdict.rule is R.TRANSITION
    else:
        assert not verdict.accepted
        assert verdict.rule is R.BAD_BROKERS
        assert verdict.reason.startswith(f"{cur.state.value} -> {new.state.value}: ")
        assert problem in verdict.reason


SERVER_CHANGING_CASES = {"release wrong src", "split wrong src", "own other dst", "release no src"}
"""The broker cases whose new value names another server, or none: force does not skip that
rule."""


@pytest.mark.parametrize(
    ("cur", "new", "changes_server"),
    [(case[1], case[2], case[0] in SERVER_CHANGING_CASES) for case in BROKER_CASES if case[3]],
    ids=[case[0] for case in BROKER_CASES if case[3]],
)
def test_force_skips_broker_checks_but_not_the_server_rule(
    cur: ServiceUnitStateData, new: ServiceUnitStateData, changes_server: bool
) -> None:
    forced = data(new.state, new.version_id, dst=new.dst_broker, src=new.source_broker, force=True)
    verdict = resolve(cur, forced, highest_term=0)
    assert verdict.accepted != changes_server, verdict.reason
    assert verdict.rule is (R.SERVER_CHANGE if changes_server else R.FORCED)


# --- tombstones and leader terms ----------------------------------------------------------------


@pytest.mark.parametrize(("cur_name", "to"), DROPPING_PAIRS)
@pytest.mark.parametrize(("step", "force"), [(1, True), (2, False), (1000, True)])
def test_a_value_leaving_a_served_bundle_without_a_server_is_rejected(
    cur_name: str, to: S, step: int, force: bool
) -> None:
    cur = CURRENT[cur_name]
    new = data(to, version_after(cur, step), src=server_of(cur), force=force)
    verdict = resolve(cur, new, highest_term=0)
    assert not verdict.accepted
    assert verdict.rule is R.SERVER_CHANGE
    assert "would drop" in verdict.reason


@pytest.mark.parametrize("cur_name", list(CURRENT))
@pytest.mark.parametrize("highest_term", [0, 9])
def test_a_tombstone_is_accepted_only_where_nobody_serves(cur_name: str, highest_term: int) -> None:
    cur = CURRENT[cur_name]
    verdict = resolve(cur, None, highest_term=highest_term)
    if server_of(cur) is None:
        assert verdict.accepted and verdict.rule is R.TOMBSTONE
    else:
        assert not verdict.accepted and verdict.rule is R.SERVER_CHANGE
        assert "tombstone" in verdict.reason


def _forced(version: int, term: int | None) -> ServiceUnitStateData:
    return data(S.Owned, version, dst=A, force=True, term=term)


@pytest.mark.parametrize(
    ("cur", "version"),
    [(None, 1), (OWNED_A, N), (OWNED_A, N + 5)],
    ids=["no value", "next version", "version gap"],
)
def test_forced_write_from_an_older_term_is_rejected_first(
    cur: ServiceUnitStateData | None, version: int
) -> None:
    verdict = resolve(cur, _forced(version, term=3), highest_term=4)
    assert not verdict.accepted
    assert verdict.rule is R.STALE_TERM
    assert verdict.reason == "forced write from leader term 3 < highest applied term 4"


@pytest.mark.parametrize("term", [4, 5, None])
def test_forced_write_from_the_current_or_a_newer_term_or_none_is_judged_normally(
    term: int | None,
) -> None:
    assert resolve(OWNED_A, _forced(N, term=term), highest_term=4).rule is R.FORCED
    stale_version = resolve(OWNED_A, _forced(CUR_VERSION, term=term), highest_term=4)
    assert stale_version.rule is R.STALE_VERSION


def test_non_forced_write_from_an_older_term_is_judged_by_the_transition_rules() -> None:
    ok = data(S.Releasing, N, src=A, term=1)
    bad = data(S.Assigning, N, dst=B, term=1)
    assert resolve(OWNED_A, ok, highest_term=4).rule is R.TRANSITION
    assert resolve(OWNED_A, bad, highest_term=4).rule is R.BAD_TRANSITION


@pytest.mark.parametrize(
    ("cur", "version"),
    [(None, 1), (OWNED_A, N), (OWNED_A, N + 5)],
    ids=["no value", "next version", "version gap"],
)
@pytest.mark.parametrize("force", [True, False])
def test_a_leader_term_beyond_the_largest_jump_is_rejected(
    cur: ServiceUnitStateData | None, version: int, force: bool
) -> None:
    # A non-forced value is judged by its term too: any accepted term raises the highest one.
    new = data(S.Releasing, version, dst=B, src=A, force=force, term=2**62)
    verdict = resolve(cur, new, highest_term=7)
    assert not verdict.accepted
    assert verdict.rule is R.TERM_JUMP
    assert verdict.reason == (
        f"leader_term {2**62} > highest applied term 7 + {2**40} "
        "(the largest jump between two leaders)"
    )


def test_a_leader_term_at_the_largest_jump_is_judged_normally() -> None:
    assert MAX_TERM_JUMP == 2**40
    at_bound = _forced(N, term=7 + MAX_TERM_JUMP)
    assert resolve(OWNED_A, at_bound, highest_term=7).rule is R.FORCED
    beyond = _forced(N, term=7 + MAX_TERM_JUMP + 1)
    assert resolve(OWNED_A, beyond, highest_term=7).rule is R.TERM_JUMP


# --- the server rule ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "server"),
    [
        (None, None),
        (data(S.Init, src=A), None),
        (data(S.Free, dst=B, src=A), None),
        (data(S.Owned, dst=A, src=B), A),
        (data(S.Assigning, dst=B, src=A), B),
        (data(S.Releasing, dst=B, src=A), A),
        (data(S.Releasing, dst=B), None),
        (data(S.Splitting, src=A), A),
        (data(S.Deleted, src=A), None),
    ],
    ids=[
        "none",
        "Init",
        "Free",
        "Owned",
        "Assigning",
        "Releasing",
        "Releasing without src",
        "Splitting",
        "Deleted",
    ],
)
def test_server_of(value: ServiceUnitStateData | None, server: BrokerId | None) -> None:
    assert server_of(value) == server


GAP = N + 3
SERVER_CHANGES = [
    # (case, cur, new): the new value makes another broker the server while one still is.
    ("owned to owned by a gap", OWNED_A, data(S.Owned, GAP, dst=B)),
    ("owned to owned forced", OWNED_A, data(S.Owned, N, dst=B, force=True)),
    ("owned to assigning by a gap", OWNED_A, data(S.Assigning, GAP, dst=B, src=A)),
    ("owned to assigning forced", OWNED_A, data(S.Assigning, N, dst=B, src=A, force=True)),
    ("owned to releasing from another", OWNED_A, data(S.Releasing, GAP, dst=B, src=C)),
    ("owned to splitting by another", OWNED_A, data(S.Splitting, N, src=B, force=True)),
    ("splitting to owned by another", SPLITTING, data(S.Owned, N, dst=B, force=True)),
    ("releasing to owned by the dst", RELEASING, data(S.Owned, GAP, dst=B, src=A)),
    ("assigning to owned by another", ASSIGNING, data(S.Owned, N, dst=C, src=A, force=True)),
    ("assigning to releasing from another", ASSIGNING, data(S.Releasing, GAP, dst=C, src=A)),
]


@pytest.mark.parametrize(
    ("cur", "new"),
    [case[1:] for case in SERVER_CHANGES],
    ids=[case[0] for case in SERVER_CHANGES],
)
def test_a_value_that_changes_the_server_other_than_by_a_hand_over_is_rejected(
    cur: ServiceUnitStateData, new: ServiceUnitStateData
) -> None:
    verdict = resolve(cur, new, highest_term=0)
    assert not verdict.accepted
    assert verdict.rule is R.SERVER_CHANGE
    was, will = server_of(cur), server_of(new)
    assert verdict.reason.endswith(
        f": {new.state.value} would make {will!r} the server while {cur.state.value} {was!r} "
        "still is (only Releasing -> Assigning hands a bundle over)"
    )


def test_the_server_rule_names_the_rule_that_would_have_accepted() -> None:
    verdict = resolve(OWNED_A, data(S.Owned, GAP, dst=B), highest_term=0)
    assert verdict.reason.startswith(f"version {GAP} skips past current {CUR_VERSION} + 1: ")
    verdict = resolve(OWNED_A, data(S.Owned, N, dst=B, force=True), highest_term=0)
    assert verdict.reason.startswith("forced Owned -> Owned: ")


SERVER_KEPT_OR_HANDED_OVER = [
    # (case, cur, new, rule): accepted although forced or gapped.
    ("hand over to another dst, forced", RELEASING, data(S.Assigning, N, dst=C, src=A, force=True)),
    ("hand over by a gap", RELEASING, data(S.Assigning, GAP, dst=C)),
    ("free to owned by a gap", FREE, data(S.Owned, GAP, dst=B)),
    ("deleted reset forced", data(S.Deleted, src=A), data(S.Init, N, src=B, force=True)),
    ("init value to owned", data(S.Init, src=A), data(S.Owned, N, dst=B)),
    ("no value to owned", None, data(S.Owned, 1, dst=B)),
    # What the leader's monitor writes: an announced move, its hand-over, and undone moves.
    ("announce a move off the owner", OWNED_A, data(S.Releasing, N, dst=C, src=A, force=True)),
    ("announce a move off the dst", ASSIGNING, data(S.Releasing, N, dst=C, src=B, force=True)),
    ("announce a move off a splitter", SPLITTING, data(S.Releasing, N, dst=C, src=A, force=True)),
    ("finish a stuck assignment", ASSIGNING, data(S.Owned, N, dst=B, force=True)),
    ("undo a stuck release", RELEASING, data(S.Owned, N, dst=A, force=True)),
    ("undo a stuck split", SPLITTING, data(S.Owned, N, dst=A, force=True)),
]


@pytest.mark.parametrize(
    ("cur", "new"),
    [case[1:] for case in SERVER_KEPT_OR_HANDED_OVER],
    ids=[case[0] for case in SERVER_KEPT_OR_HANDED_OVER],
)
def test_a_value_that_keeps_the_server_hands_it_over_or_has_none_is_accepted(
    cur: ServiceUnitStateData | None, new: ServiceUnitStateData
) -> None:
    verdict = resolve(cur, new, highest_term=0)
    assert verdict.accepted, verdict.reason
    assert verdict.rule is not R.SERVER_CHANGE


FLOWS = {
    "lookup": [data(S.Assigning, 1, dst=A), data(S.Owned, 2, dst=A)],
    "lookup after free": [
        data(S.Free, 1, src=B),
        data(S.Assigning, 2, dst=A),
        data(S.Owned, 3, dst=A),
    ],
    "transfer": [
        data(S.Owned, 1, dst=A),
        data(S.Releasing, 2, dst=B, src=A),
        data(S.Assigning, 3, dst=B, src=A),
        data(S.Owned, 4, dst=B, src=A),
    ],
    "unload": [data(S.Owned, 1, dst=A), data(S.Releasing, 2, src=A), data(S.Free, 3, src=A)],
    "split": [data(S.Owned, 1, dst=A), data(S.Splitting, 2, src=A), data(S.Deleted, 3, src=A)],
    "split child": [data(S.Owned, 1, dst=A)],
}


@pytest.mark.parametrize("flow", list(FLOWS))
def test_the_normal_flows_pass_every_rule(flow: str) -> None:
    cur: ServiceUnitStateData | None = None
    for new in FLOWS[flow]:
        verdict = resolve(cur, new, highest_term=0)
        assert verdict.rule is R.TRANSITION, verdict.reason
        cur = new


# --- the value and its codec --------------------------------------------------------------------

CHILD_1, CHILD_2 = BundleId("t/n/0x00000000_0x80000000"), BundleId("t/n/0x80000000_0xffffffff")


def test_round_trip_with_every_field_set() -> None:
    value = ServiceUnitStateData(
        state=S.Splitting,
        version_id=7,
        dst_broker=None,
        source_broker=A,
        split_children={CHILD_1: A, CHILD_2: None},
        force=True,
        timestamp_ms=1_700_000_000_000,
        leader_term=3,
    )
    raw = encode_value(value)
    assert decode_value(raw) == value
    assert json.loads(raw) == {
        "state": "Splitting",
        "dst_broker": None,
        "source_broker": "a:8080",
        "split_children": {CHILD_1: "a:8080", CHILD_2: None},
        "force": True,
        "timestamp_ms": 1_700_000_000_000,
        "version_id": 7,
        "leader_term": 3,
    }


def test_encoding_names_every_field_even_when_absent() -> None:
    obj = json.loads(encode_value(data(S.Owned, 1, dst=A)))
    assert list(obj) == list(FIELDS)
    assert obj["split_children"] is None
    assert obj["leader_term"] is None


def test_tombstone_codec() -> None:
    assert encode_value(None) == b""
    assert decode_value(b"") is None


def test_lenient_reading() -> None:
    raw = json.dumps(
        {
            "state": "Owned",
            "version_id": 2,
            "dst_broker": "a:8080",
            "source_broker": " ",
            "newer_field": [1],
        }
    ).encode()
    value = decode_value(raw)
    assert value == ServiceUnitStateData(state=S.Owned, version_id=2, dst_broker=A)


def test_value_is_immutable_and_hashable() -> None:
    children = {CHILD_1: A}
    value = ServiceUnitStateData(
        state=S.Splitting, version_id=1, source_broker=A, split_children=children
    )
    children[CHILD_2] = B
    assert value.split_children == {CHILD_1: A}
    with pytest.raises(TypeError):
        value.split_children[CHILD_2] = B  # type: ignore[index]
    assert hash(value) == hash(
        ServiceUnitStateData(state=S.Splitting, version_id=1, source_broker=A)
    )


BAD_VALUES = [
    (b"\xff\xfe", "not UTF-8"),
    (b"{", "not JSON"),
    (b"[1, 2]", "must be a JSON object, got an array"),
    (b'"Owned"', "must be a JSON object, got a string"),
    (b'{"version_id": 1, "dst_broker": "a"}', "missing required field 'state'"),
    (b'{"state": "Owned", "dst_broker": "a"}', "missing required field 'version_id'"),
    (b'{"state": "Owned", "version_id": null, "dst_broker": "a"}', "'version_id'"),
    (b'{"state": "Own", "version_id": 1, "dst_broker": "a"}', "unknown state 'Own'"),
    (b'{"state": 3, "version_id": 1, "dst_broker": "a"}', "unknown state 3"),
    (b'{"state": "Owned", "version_id": "1", "dst_broker": "a"}', "version_id must be an integer"),
    (b'{"state": "Owned", "version_id": 1.5, "dst_broker": "a"}', "version_id must be an integer"),
    (b'{"state": "Owned", "version_id": true, "dst_broker": "a"}', "version_id must be an integer"),
    (
        b'{"state": "Owned", "version_id": -1, "dst_broker": "a"}',
        "version_id must be between 0 and 2^63-1",
    ),
    (b'{"state": "Owned", "version_id": 1, "dst_broker": 5}', "dst_broker must be a string"),
    (b'{"state": "Owned", "version_id": 1, "source_broker": {}}', "source_broker must be a string"),
    (b'{"state": "Owned", "version_id": 1}', "dst_broker and source_broker are both empty"),
    (b'{"state": "Owned", "version_id": 1, "dst_broker": ""}', "both empty"),
    (b'{"state": "Owned", "version_id": 1, "dst_broker": "a", "force": 1}', "force must be"),
    (
        b'{"state": "Owned", "version_id": 1, "dst_broker": "a", "timestamp_ms": "now"}',
        "timestamp_ms must be an integer",
    ),
    (
        b'{"state": "Owned", "version_id": 1, "dst_broker": "a", "leader_term": -2}',
        "leader_term must be between 0 and 2^63-1",
    ),
    (
        b'{"state": "Owned", "version_id": 18446744073709551616, "dst_broker": "a"}',
        "version_id must be between 0 and 2^63-1",
    ),
    (
        b'{"state": "Owned", "version_id": 1, "dst_broker": "a", '
        b'"leader_term": 9223372036854775808}',
        "leader_term must be between 0 and 2^63-1",
    ),
    (
        b'{"state": "Owned", "version_id": 1, "dst_broker": "a", "timestamp_ms": 1e400}',
        "timestamp_ms must be an integer",
    ),
    (
        b'{"state": "Owned", "version_id": 1, "dst_broker": "' + b"x" * 300 + b'"}',
        "dst_broker must be at most 256 printable characters",
    ),
    (
        b'{"state": "Owned", "version_id": 1, "dst_broker": "a\\u0000"}',
        "dst_broker must be at most 256 printable characters",
    ),
    (
        b'{"state": "Owned", "version_id": 1, "dst_broker": "a", "pad": "' + b"x" * 70000 + b'"}',
        "more than 65536",
    ),
    (
        b'{"state": "Splitting", "version_id": 1, "source_broker": "a", "split_children": []}',
        "split_children must be an object",
    ),
    (
        b'{"state": "Splitting", "version_id": 1, "source_broker": "a", '
        b'"split_children": {"t/n/x": 1}}',
        "split_children['t/n/x'] must be a string",
    ),
    (
        b'{"state": "Splitting", "version_id": 1, "source_broker": "a", '
        b'"split_children": {"": "a"}}',
        "split_children: bad bundle id ''",
    ),
    (
        b'{"state": "Splitting", "version_id": 1, "source_broker": "a", "split_children": {}, '
        b'"split_ranges": {"namespace": "t/n", "lo": 0, "widths": [1, 1], "brokers": {}}}',
        "split_children and split_ranges are both set",
    ),
    (
        b'{"state": "Splitting", "version_id": 1, "source_broker": "a", '
        b'"split_ranges": {"namespace": "t/n", "lo": 0, "widths": [5], "brokers": {}}}',
        "split_ranges.widths must be an array of 2 to 8192 widths",
    ),
    (
        b'{"state": "Splitting", "version_id": 1, "source_broker": "a", '
        b'"split_ranges": {"namespace": "t/n", "lo": 0, "widths": [5, 0], "brokers": {}}}',
        "split_ranges.widths[1]: bundle lower bound 0x00000005 must be below",
    ),
    (
        b'{"state": "Splitting", "version_id": 1, "source_broker": "a", '
        b'"split_ranges": {"namespace": "t/n", "lo": 0, "widths": [5, 5], "brokers": {"2": "b"}}}',
        "split_ranges.brokers: no child '2'",
    ),
    (
        b'{"state": "Splitting", "version_id": 1, "source_broker": "a", '
        b'"split_ranges": {"namespace": "t/n", "lo": 0, "widths": [5, 5], "brokers": {"0": 7}}}',
        "split_ranges.brokers['0'] must be a string",
    ),
    (
        b'{"state": "Splitting", "version_id": 1, "source_broker": "a", '
        b'"split_ranges": {"namespace": "t/n", "lo": -1, "widths": [5, 5], "brokers": {}}}',
        "split_ranges.lo must be between 0",
    ),
]


@pytest.mark.parametrize(("raw", "message"), BAD_VALUES)
def test_malformed_values_are_named(raw: bytes, message: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        decode_value(raw)
    assert message in str(info.value)


def test_constructor_rejects_blank_brokers() -> None:
    with pytest.raises(InvalidInputError, match="dst_broker must not be blank"):
        ServiceUnitStateData(state=S.Owned, version_id=1, dst_broker=BrokerId("  "))


@pytest.mark.parametrize("to", [s for s in ServiceUnitState if s is not S.Init])
@pytest.mark.parametrize("step", [1, 2, 1000])
@pytest.mark.parametrize("force", [False, True])
def test_nothing_but_a_reset_brings_a_deleted_bundle_back(to: S, step: int, force: bool) -> None:
    # A leader's fix decided before a split finished must not resurrect the parent over its
    # children, whatever its version and however forced.
    cur = CURRENT["Deleted"]
    new = data(to, version_after(cur, step), dst=A, src=A, force=force, term=5)
    verdict = resolve(cur, new, highest_term=5)
    assert not verdict.accepted
    assert verdict.rule is R.BAD_TRANSITION
    assert verdict.reason == f"Deleted -> {to.value} not allowed"


def _children(count: int, lo: int = 0, hi: int = 0xFFFFFFFF) -> dict[BundleId, BrokerId | None]:
    """``count`` adjacent children of ``lo``..``hi``, as a split names them: most to the source
    broker A, a few to nobody yet, one elsewhere."""
    step = (hi - lo) // count
    bounds = [lo + step * i for i in range(count)] + [hi]

    def broker(i: int) -> BrokerId | None:
        return B if i == 1 else None if i % 500 == 0 else A

    return {
        BundleId(f"tenant/ns/0x{a:08x}_0x{b:08x}"): broker(i)
        for i, (a, b) in enumerate(pairwise(bounds))
    }


@pytest.mark.parametrize("count", [2, 64, 65, 5_000, MAX_SPLIT_CHILDREN])
def test_a_split_names_its_children_compactly_beyond_a_few_and_reads_back_the_same(
    count: int,
) -> None:
    children = _children(count, lo=0x10000000, hi=0xF0000000)
    value = ServiceUnitStateData(
        state=S.Splitting, version_id=3, source_broker=A, split_children=children
    )
    raw = encode_value(value)
    obj = json.loads(raw)
    listed = count <= LISTED_SPLIT_CHILDREN
    assert (obj["split_children"] is not None) is listed
    assert ("split_ranges" in obj) is not listed
    assert len(raw) <= MAX_VALUE_BYTES
    decoded = decode_value(raw)
    assert decoded == value
    assert decoded is not None and dict(decoded.split_children or {}) == children


def test_children_that_are_not_adjacent_ranges_are_listed() -> None:
    children = _children(200)
    del children[next(iter(children))]
    children[BundleId("other/ns/0x00000000_0x00000010")] = None
    value = ServiceUnitStateData(
        state=S.Splitting, version_id=1, source_broker=A, split_children=children
    )
    obj = json.loads(encode_value(value))
    assert "split_ranges" not in obj and len(obj["split_children"]) == 200
    assert decode_value(encode_value(value)) == value
