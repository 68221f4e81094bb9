"""The execution governor's budgets (lbd.core.admission): per broker, per cluster, per minute."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbd.core.admission import RATE_WINDOW_S, Governor, MoveKind, Ticket
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.settings import Budget, GovernorConfig

A, B, C = BrokerId("a"), BrokerId("b"), BrokerId("c")
BAL, REC = MoveKind.BALANCING, MoveKind.RECOVERY


def move(i: int, src: BrokerId | None, dst: BrokerId | None, kind: MoveKind = BAL) -> Ticket:
    return Ticket(BundleId(f"t/ns/0x{i:08x}_0x{i + 1:08x}"), src, dst, kind)


def governor(per_broker: int = 0, cluster: int = 0, per_minute: int = 0) -> Governor:
    budget = Budget(per_broker=per_broker, cluster=cluster, per_minute=per_minute)
    return Governor(GovernorConfig(balancing=budget, recovery=Budget(0, 0, 0)))


def test_a_move_counts_at_both_of_its_brokers() -> None:
    g = governor(per_broker=2)
    g.start(move(0, A, B), 0.0)
    g.start(move(1, A, C), 0.0)
    assert g.in_flight(BAL, A) == 2 and g.in_flight(BAL, B) == 1
    blocked = g.blocked_by(move(2, C, A), 0.0)
    assert blocked is not None and "at a (broker limit)" in blocked
    assert g.blocked_by(move(3, B, C), 0.0) is None


def test_finishing_frees_the_slot_at_both_ends() -> None:
    g = governor(per_broker=1)
    g.start(move(0, A, B), 0.0)
    assert g.blocked_by(move(1, B, C), 0.0) is not None
    assert g.finish(move(0, A, B).bundle) == move(0, A, B)
    assert g.blocked_by(move(1, B, C), 0.0) is None
    assert g.in_flight(BAL) == 0 and g.finish(move(0, A, B).bundle) is None


def test_the_cluster_limit_holds_whatever_the_brokers() -> None:
    g = governor(cluster=2)
    g.start(move(0, A, B), 0.0)
    g.start(move(1, C, A), 0.0)
    blocked = g.blocked_by(move(2, B, C), 0.0)
    assert blocked is not None and "cluster limit" in blocked
    with pytest.raises(ValueError, match="may not start"):
        g.start(move(2, B, C), 0.0)


def test_the_rate_limit_counts_starts_in_the_last_minute() -> None:
    g = governor(per_minute=2)
    g.start(move(0, A, B), 0.0)
    g.finish(move(0, A, B).bundle)
    g.start(move(1, A, B), 10.0)
    g.finish(move(1, A, B).bundle)
    # Both finished, but both started within the minute.
    assert "rate limit" in (g.blocked_by(move(2, A, B), 30.0) or "")
    assert g.retry_after_s(BAL, 30.0) == pytest.approx(RATE_WINDOW_S - 30.0)
    assert g.blocked_by(move(2, A, B), RATE_WINDOW_S + 0.5) is None
    assert g.retry_after_s(BAL, RATE_WINDOW_S + 0.5) is None


def test_recovery_and_balancing_have_separate_budgets() -> None:
    tight = Budget(per_broker=1, cluster=1, per_minute=1)
    g = Governor(GovernorConfig(balancing=tight, recovery=Budget(0, 0, 0)))
    g.start(move(0, A, B), 0.0)
    assert g.blocked_by(move(1, A, B), 0.0) is not None
    # An orphan's source is gone: only its destination counts, against the recovery budget.
    for i in range(1, 50):
        g.start(move(i, None, B, REC), 0.0)
    assert g.in_flight(REC, B) == 49 and g.in_flight(BAL, B) == 1


def test_a_bundle_never_holds_two_slots() -> None:
    g = governor()
    g.start(move(0, A, B), 0.0)
    assert "already moving" in (g.blocked_by(move(0, B, C), 0.0) or "")
    assert "already moving" in (g.blocked_by(move(0, None, C, REC), 0.0) or "")


def test_zero_turns_a_limit_off_and_negative_limits_are_refused() -> None:
    g = governor()
    for i in range(500):
        g.start(move(i, A, B), 0.0)
    assert g.in_flight(BAL, A) == 500
    with pytest.raises(InvalidInputError, match="per_broker must be an integer >= 0"):
        Budget(per_broker=-1, cluster=0, per_minute=0)


@settings(max_examples=200, deadline=None)
@given(
    limits=st.tuples(st.integers(0, 4), st.integers(0, 6), st.integers(0, 8)),
    steps=st.lists(
        st.tuples(
            st.booleans(),
            st.integers(0, 20),
            st.sampled_from([A, B, C, None]),
            st.sampled_from([A, B, C, None]),
            st.floats(0, 30),
        ),
        max_size=80,
    ),
)
def test_no_sequence_of_starts_and_finishes_breaks_a_limit(
    limits: tuple[int, int, int],
    steps: list[tuple[bool, int, BrokerId | None, BrokerId | None, float]],
) -> None:
    per_broker, cluster, per_minute = limits
    g = governor(per_broker, cluster, per_minute)
    now = 0.0
    starts: list[float] = []
    for start, i, src, dst, dt in steps:
        now += dt
        ticket = move(i, src, dst)
        assert g.may_start(ticket, now) == (g.blocked_by(ticket, now) is None)
        if start:
            if g.blocked_by(ticket, now) is None:
                g.start(ticket, now)
                starts.append(now)
        else:
            g.finish(ticket.bundle)
        held = g.held(BAL)
        if cluster:
            assert len(held) <= cluster
        if per_broker:
            for broker in (A, B, C):
                assert sum(1 for t in held if broker in t.brokers) <= per_broker
        if per_minute:
            assert sum(1 for t in starts if t > now - RATE_WINDOW_S) <= per_minute
