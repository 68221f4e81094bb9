"""The dual-serving checker on synthetic event logs: it must find what it exists to find."""

from __future__ import annotations

from lbd.devcluster.serving import Interval, dual_serving, serving_intervals

MS = 1_000_000
B = "public/demo/0x00000000_0x10000000"


def ev(t_ms: float, broker: str, event: str, bundle: str | None = B, **detail: object) -> dict:
    return {"t_ns": round(t_ms * MS), "broker": broker, "event": event, "bundle": bundle, **detail}


def lease(t_ms: float, broker: str, until_ms: float) -> dict:
    return ev(t_ms, broker, "lease", None, until_ns=str(round(until_ms * MS)))


def test_a_planted_one_millisecond_overlap_is_found() -> None:
    events = [
        lease(0, "a", 10_000),
        ev(1, "a", "own"),
        ev(5_000, "a", "release"),
        lease(0, "b", 10_000),
        ev(4_999, "b", "own"),
    ]
    problems = dual_serving(serving_intervals(events, {}))
    assert problems == [f"{B}: a and b both served it for 1.000 ms"]


def test_a_broker_stops_serving_when_a_release_arrives_not_when_its_turn_comes() -> None:
    # a's Release arrived at 5 s and waited behind a slower command until 9 s; b owns at 6 s.
    events = [
        lease(0, "a", 10_000),
        ev(1, "a", "own"),
        ev(5_000, "a", "revoked", command="release"),
        ev(9_000, "a", "release"),
        lease(0, "b", 10_000),
        ev(6_000, "b", "own"),
    ]
    intervals = serving_intervals(events, {})
    assert Interval(B, 1 * MS, 5_000 * MS, "a") in intervals
    assert dual_serving(intervals) == []
    without_arrival = [e for e in events if e["event"] != "revoked"]
    assert dual_serving(serving_intervals(without_arrival, {})) == [
        f"{B}: a and b both served it for 3000.000 ms"
    ]


def test_a_hand_over_with_no_gap_is_no_overlap() -> None:
    events = [
        lease(0, "a", 10_000),
        ev(1, "a", "own"),
        ev(5_000, "a", "release"),
        lease(0, "b", 10_000),
        ev(5_000, "b", "own"),
    ]
    assert dual_serving(serving_intervals(events, {})) == []


def test_a_silent_broker_serves_only_until_its_lease_ends() -> None:
    # a is paused after its last grant: it logs nothing more, but its lease ends at 3 s.
    events = [
        lease(0, "a", 3_000),
        ev(1, "a", "own"),
        lease(2_000, "b", 9_000),
        ev(3_000, "b", "own"),
    ]
    intervals = serving_intervals(events, {})
    assert Interval(B, 1 * MS, 3_000 * MS, "a") in intervals
    assert dual_serving(intervals) == []
    later = [*events[:2], lease(2_000, "b", 9_000), ev(2_999, "b", "own")]
    assert dual_serving(serving_intervals(later, {})) == [
        f"{B}: a and b both served it for 1.000 ms"
    ]


def test_nothing_is_served_without_a_lease_or_after_death() -> None:
    events = [ev(1, "a", "own"), lease(0, "b", 9_000), ev(2, "b", "own")]
    assert dual_serving(serving_intervals(events, {})) == []  # a never held a lease
    killed = [lease(0, "a", 9_000), ev(1, "a", "own"), lease(0, "b", 9_000), ev(600, "b", "own")]
    assert dual_serving(serving_intervals(killed, {"a": 500 * MS})) == []
    assert dual_serving(serving_intervals(killed, {"a": 601 * MS})) != []


def test_a_lost_session_ends_every_bundle() -> None:
    events = [
        lease(0, "a", 9_000),
        ev(1, "a", "own"),
        ev(100, "a", "session", None, detail="lost"),
        lease(0, "b", 9_000),
        ev(100, "b", "own"),
    ]
    assert dual_serving(serving_intervals(events, {})) == []


def test_a_killed_broker_stops_at_its_death_and_serves_anew_once_started_again() -> None:
    events = [
        lease(0, "a", 10_000),
        ev(1, "a", "own"),
        # killed at 2,000 ms, its lease (until 10,000) dies with it; started again at 3,000
        ev(3_000, "a", "session", None, detail="open"),
        lease(3_001, "a", 13_000),
        ev(3_002, "a", "own"),
        ev(6_000, "a", "release"),
    ]
    intervals = serving_intervals(events, {"a": 2_000 * MS})
    assert [(i.start // MS, i.end // MS) for i in intervals] == [(1, 2_000), (3_002, 6_000)]


def test_a_write_is_judged_against_the_serving_interval_it_falls_in() -> None:
    from lbd.devcluster.serving import writes, writes_outside_serving

    events = [
        lease(0, "a", 10_000),
        ev(1, "a", "own"),
        ev(5_000, "a", "release"),
        ev(100, "a", "write", topic="t", until_ns=200 * MS, first="1:0", last="1:9", count=10),
        ev(5_001, "a", "write", topic="t", until_ns=5_002 * MS, first="1:10", last="1:10", count=1),
    ]
    problems = writes_outside_serving(serving_intervals(events, {}), writes(events))
    assert len(problems) == 1 and "entries (1, 10)..(1, 10) of t" in problems[0]
