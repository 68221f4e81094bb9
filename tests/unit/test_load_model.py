"""The one load model behind lbd demo, lbd bench balance and lbd analytics replay."""

import pytest

from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerUsage
from lbd.core.settings import MB, SheddingConfig
from lbd.core.shedding import DecisionReason, UnloadDecision
from lbd.workload.model import LoadModel, usage_of

A, B, C = BrokerId("a"), BrokerId("b"), BrokerId("c")
X, Y, Z = (BundleId(f"t/ns/0x{i:08x}_0x{i + 1:08x}") for i in range(3))


def model() -> LoadModel:
    """Three brokers of 100 MB/s each way; X and Y on a, Z on b."""
    traffic = {X: 40 * MB, Y: 20 * MB, Z: 20 * MB}
    return LoadModel({A: 100.0, B: 100.0, C: 100.0}, traffic, {X: A, Y: A, Z: B})


def test_a_broker_carries_its_bundles_traffic_over_its_capacity() -> None:
    m = model()
    assert m.carried() == {A: pytest.approx(0.3), B: pytest.approx(0.1), C: 0.0}
    assert m.throughputs() == {A: 60 * MB, B: 20 * MB, C: 0.0}


def test_moving_a_bundle_moves_its_load() -> None:
    m = model()
    moves = m.apply([UnloadDecision(X, A, C, DecisionReason.OVERLOADED)])
    assert [(mv.bundle, mv.src, mv.dst) for mv in moves] == [(X, A, C)]
    assert m.carried() == {A: pytest.approx(0.1), B: pytest.approx(0.1), C: pytest.approx(0.2)}
    assert m.unloaded_bundles == {X: m.now_ms} and m.unloaded_brokers == {A: m.now_ms}


def test_a_decision_for_a_bundle_no_longer_on_its_source_is_dropped() -> None:
    m = model()
    assert m.apply([UnloadDecision(Z, A, C, DecisionReason.OVERLOADED)]) == []
    assert m.owners[Z] == B and m.moves == []


def test_an_unloaded_bundle_waits_for_a_placement_that_counts_as_its_arrival() -> None:
    m = model()
    m.report()
    [unload] = m.apply([UnloadDecision(Y, A, None, DecisionReason.OVERLOADED)])
    assert unload.dst is None and Y not in m.owners
    assert m.carried()[A] == pytest.approx(0.2)
    [arrival] = m.place_orphans()
    assert arrival.src is None and arrival.dst == C  # the least loaded broker
    assert m.owners[Y] == C and len(m.moves) == 2


def test_a_leaving_broker_s_bundles_are_placed_on_the_others_without_counting_as_moves() -> None:
    m = model()
    assert sorted(m.leave(A)) == sorted([X, Y])
    assert A not in m.carried()
    assert m.place_orphans() == []  # first placements are not moves
    assert set(m.owners.values()) <= {B, C} and len(m.owners) == 3


def test_reports_fold_the_carried_load_into_the_ema_the_shedder_sees() -> None:
    m = model()
    m.report()
    assert m.seen()[A] == pytest.approx(0.3)
    m.apply([UnloadDecision(X, A, C, DecisionReason.OVERLOADED)])
    m.advance(60)
    m.report()
    carried, seen = m.stds()
    assert m.seen()[A] > m.carried()[A]  # the EMA lags the move
    assert seen > carried
    snapshot = m.snapshot(SheddingConfig())
    assert snapshot.brokers[A] is m.loads[A] and snapshot.owners[X] == C
    assert [b.bundle for b in snapshot.top_bundles[C]] == [X]


def test_an_ema_only_broker_reports_no_raw_sample_and_a_late_one_skips_reports() -> None:
    m = model()
    m.ema_only.add(A)
    m.report_every_s[B] = 120
    m.report()
    assert m.loads[A].usage == BrokerUsage() and m.loads[A].msg_throughput_ema == 60 * MB
    assert m.loads[C].usage != BrokerUsage()
    first = m.loads[B].updated_at_ms
    m.advance(60)
    m.report()
    assert m.loads[B].updated_at_ms == first and m.loads[C].updated_at_ms == first + 60_000
    m.advance(60)
    m.report()
    assert m.loads[B].updated_at_ms == first + 120_000


def test_background_load_is_carried_beside_the_bundles() -> None:
    m = model()
    m.background[C] = 0.25
    m.background_throughput[C] = 10 * MB
    assert m.carried()[C] == pytest.approx(0.25)
    assert m.throughputs()[C] == 10 * MB


def test_the_top_bundles_report_holds_the_busiest_first() -> None:
    m = LoadModel({A: 100.0}, {X: 1.0, Y: 3.0, Z: 2.0}, {X: A, Y: A, Z: A}, top_count=2)
    assert [b.bundle for b in m.snapshot().top_bundles[A]] == [Y, Z]


def test_usage_is_bandwidth_bound_with_cpu_at_80_percent_of_it() -> None:
    usage = usage_of(0.5, 2048.0, 3)
    assert usage.bandwidth_in.percent() == pytest.approx(50.0)
    assert usage.cpu.percent() == pytest.approx(40.0)
    assert usage.msg_rate_in == pytest.approx(1.0) and usage.bundle_count == 3


def test_a_broker_reports_its_bandwidth_against_its_own_capacity() -> None:
    # As a broker front reports its link: the planner sizes a broker it has no traffic
    # measurement of yet (a new one) by the capacity it reports.
    m = LoadModel({A: 100.0, B: 250.0}, {X: 40 * MB}, {X: A})
    m.report()
    assert m.loads[A].usage.bandwidth_in.limit == pytest.approx(800.0)
    assert m.loads[B].usage.bandwidth_out.limit == pytest.approx(2000.0)
    assert m.loads[A].usage.bandwidth_in.percent() == pytest.approx(100 * m.carried()[A])
