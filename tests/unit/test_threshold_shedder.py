"""The ThresholdShedder: brokers over ``avg + threshold`` shed their largest bundles (plain
unloads), optionally lower-boundary shedding, and the rules shared with the TransferShedder."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BrokerUsage, BundleLoad
from lbd.core.settings import SheddingConfig
from lbd.core.shedding import (
    DecisionReason,
    LoadSnapshot,
    ShedderState,
    SheddingResult,
    SkipReason,
    threshold_shed,
)
from lbd.core.shedding.model import MB

NOW = 1_700_000_000_000
BASE = SheddingConfig(min_throughput_threshold=0, threshold_shedder_percentage=10)
B1, B2, B3, B4 = (BrokerId(f"b{i}") for i in range(1, 5))


def bid(broker: BrokerId, index: int) -> BundleId:
    return BundleId(f"t/{broker}/{index}")


def cluster(
    loads: dict[BrokerId, float], tputs: dict[BrokerId, list[float]], **changes: object
) -> LoadSnapshot:
    """Brokers whose throughput is the sum of their bundles', bundle ``i`` named ``t/<b>/<i>``."""
    snap = LoadSnapshot(
        brokers={
            b: BrokerLoadData(
                broker=b,
                weighted_max_ema=load,
                msg_throughput_ema=sum(tputs.get(b, [])),
                updated_at_ms=NOW,
            )
            for b, load in loads.items()
        },
        top_bundles={
            b: tuple(BundleLoad(bundle=bid(b, i), msg_throughput_in=t) for i, t in enumerate(ts))
            for b, ts in tputs.items()
        },
    )
    return replace(snap, **changes)  # type: ignore[arg-type]


def shed(snap: LoadSnapshot, config: SheddingConfig = BASE) -> SheddingResult:
    state = ShedderState(hit_count=7)
    result, next_state = threshold_shed(snap, config, state, NOW, random.Random(0))
    assert next_state == state
    return result


LOADS = {B1: 0.2, B2: 0.3, B3: 0.4, B4: 0.9}
TPUTS = {
    B1: [5e6, 5e6],
    B2: [5e6, 10e6],
    B3: [10e6, 10e6],
    B4: [10e6, 20e6, 30e6, 40e6],
}


def unloads(result: SheddingResult) -> list[tuple[BundleId, BrokerId]]:
    assert all(d.dst is None for d in result.decisions)
    return [(d.bundle, d.src) for d in result.decisions]


def test_a_broker_over_the_threshold_sheds_its_largest_bundles_first() -> None:
    # avg 0.45; broker b4 is 0.35 over it: it sheds (0.35 - 0.10 + 0.05) of its 100 MB/s.
    result = shed(cluster(LOADS, TPUTS))
    assert unloads(result) == [(bid(B4, 3), B4)]
    assert {d.reason for d in result.decisions} == {DecisionReason.OVERLOADED}
    assert result.avg == 0.45


def test_it_sheds_until_the_target_throughput_is_marked() -> None:
    result = shed(cluster(LOADS, TPUTS, recently_unloaded_bundles={bid(B4, 3): NOW}))
    assert unloads(result) == [(bid(B4, 2), B4), (bid(B4, 1), B4)]


def test_a_broker_keeps_its_last_bundle() -> None:
    result = shed(cluster(LOADS, {**TPUTS, B4: [10e6, 10e6]}))
    assert len(unloads(result)) == 1


def test_a_sole_bundle_stays_and_the_cycle_reports_no_bundles() -> None:
    result = shed(cluster(LOADS, {**TPUTS, B4: [100e6]}))
    assert result.skip_reason is SkipReason.NO_BUNDLES


def test_a_bundle_owned_by_another_broker_is_not_unloaded() -> None:
    result = shed(cluster(LOADS, TPUTS, owners={bid(B4, 3): B1}))
    assert (bid(B4, 3), B4) not in unloads(result)
    assert unloads(result) == [(bid(B4, 2), B4), (bid(B4, 1), B4)]


def test_min_throughput_threshold_skips_small_sheds() -> None:
    planned = 0.4 * 100e6 / MB  # 38.1 MiB/s
    assert shed(
        cluster(LOADS, TPUTS), replace(BASE, min_throughput_threshold=planned - 1)
    ).decisions
    skipped = shed(cluster(LOADS, TPUTS), replace(BASE, min_throughput_threshold=planned + 1))
    assert skipped.skip_reason is SkipReason.NO_BUNDLES


def test_min_throughput_threshold_weighs_the_latest_throughput_in_mib() -> None:
    # As Pulsar's ThresholdShedder: the planned offload is the broker's latest throughput in plus
    # out (not its EMA) times the share to shed, compared with the threshold in MiB/s.
    snap = cluster(LOADS, TPUTS)
    b4 = snap.brokers[B4]
    assert b4 is not None
    latest = replace(b4, usage=BrokerUsage(msg_throughput_in=5e6, msg_throughput_out=5e6))
    quiet = replace(snap, brokers={**snap.brokers, B4: latest})
    planned = 0.4 * 10e6 / MB  # 3.8 MiB/s, where the EMA (100 MB/s) would plan 38 MiB/s
    config = replace(BASE, min_throughput_threshold=planned + 0.01)
    assert shed(quiet, config).skip_reason is SkipReason.NO_BUNDLES
    assert shed(quiet, replace(config, min_throughput_threshold=planned - 0.01)).decisions
    # The unit is Pulsar's MB, 2^20 bytes: 4 MB/s is over the planned 4,000,000 bytes/s.
    assert shed(quiet, replace(BASE, min_throughput_threshold=4.0)).skip_reason is (
        SkipReason.NO_BUNDLES
    )
    assert shed(quiet, replace(BASE, min_throughput_threshold=3.81)).decisions


def test_min_throughput_threshold_applies_to_lower_boundary_shedding() -> None:
    # b3 would shed 10 % x 0.5 of its 20 MB/s: 1 MB/s, 0.95 MiB/s.
    config = replace(BASE, lower_boundary_shedding_enabled=True)
    snap = cluster(LOW, TPUTS)
    assert shed(snap, replace(config, min_throughput_threshold=0.9)).decisions
    result = shed(snap, replace(config, min_throughput_threshold=1.0))
    assert result.skip_reason is SkipReason.NO_BUNDLES


def test_no_broker_over_the_threshold_is_skipped_with_hit_count() -> None:
    result = shed(cluster({B1: 0.4, B2: 0.45, B3: 0.5}, TPUTS))
    assert result.skip_reason is SkipReason.HIT_COUNT


def test_max_brokers_per_cycle_takes_the_most_loaded_first() -> None:
    loads = {B1: 0.1, B2: 0.1, B3: 0.8, B4: 0.9}
    tputs = {**TPUTS, B3: [10e6, 20e6, 30e6, 40e6]}
    both = shed(cluster(loads, tputs), replace(BASE, max_brokers_per_cycle=2))
    assert {src for _, src in unloads(both)} == {B3, B4}
    one = shed(cluster(loads, tputs), replace(BASE, max_brokers_per_cycle=1))
    assert {src for _, src in unloads(one)} == {B4}


def test_missing_top_bundles_are_reported_as_no_load_data() -> None:
    result = shed(cluster(LOADS, {b: t for b, t in TPUTS.items() if b != B4}))
    assert result.skip_reason is SkipReason.NO_LOAD_DATA


LOW = {B1: 0.5, B2: 0.52, B3: 0.54, B4: 0.30}


def test_lower_boundary_shedding_feeds_a_broker_far_below_the_average() -> None:
    # avg 0.465: nobody is over 0.565, b4 is under 0.365; the most loaded broker sheds 5%.
    snap = cluster(LOW, TPUTS)
    assert shed(snap).skip_reason is SkipReason.HIT_COUNT
    result = shed(snap, replace(BASE, lower_boundary_shedding_enabled=True))
    assert unloads(result) == [(bid(B3, 0), B3)]
    assert {d.reason for d in result.decisions} == {DecisionReason.UNDERLOADED}


def test_lower_boundary_shedding_needs_a_broker_below_the_boundary() -> None:
    snap = cluster({**LOW, B4: 0.45}, TPUTS)
    result = shed(snap, replace(BASE, lower_boundary_shedding_enabled=True))
    assert result.skip_reason is SkipReason.HIT_COUNT


def test_shares_the_load_data_gate() -> None:
    stale = cluster(LOADS, TPUTS)
    stale = replace(
        stale, brokers={b: replace(d, updated_at_ms=0) for b, d in stale.brokers.items() if d}
    )
    assert shed(stale).skip_reason is SkipReason.OUT_DATED_DATA
    cooling = cluster(LOADS, TPUTS, recently_unloaded_brokers={B4: NOW})
    assert shed(cooling).skip_reason is SkipReason.COOL_DOWN
    assert shed(LoadSnapshot(brokers={})).skip_reason is SkipReason.NO_BROKERS


@st.composite
def snapshots(draw: st.DrawFn) -> LoadSnapshot:
    ids = [BrokerId(f"b{i}") for i in range(draw(st.integers(min_value=1, max_value=6)))]
    loads = {b: draw(st.floats(min_value=0, max_value=1.5)) for b in ids}
    tputs = {b: draw(st.lists(st.floats(min_value=0, max_value=50e6), max_size=4)) for b in ids}
    bundles = [bid(b, i) for b, ts in tputs.items() for i in range(len(ts))]
    grace = draw(st.lists(st.sampled_from(bundles), unique=True)) if bundles else []
    return cluster(loads, tputs, recently_unloaded_bundles=dict.fromkeys(grace, NOW - 1))


@settings(max_examples=200, deadline=None)
@given(
    snap=snapshots(),
    max_brokers=st.integers(min_value=1, max_value=3),
    lower=st.booleans(),
)
def test_properties_of_every_decision(snap: LoadSnapshot, max_brokers: int, lower: bool) -> None:
    config = replace(BASE, max_brokers_per_cycle=max_brokers, lower_boundary_shedding_enabled=lower)
    result = shed(snap, config)
    for d in result.decisions:
        assert d.dst is None
        assert d.bundle in snap.owned_bundles(d.src)
        assert d.bundle not in snap.recently_unloaded_bundles
    sources = {d.src for d in result.decisions}
    assert len(sources) <= max_brokers
    for src in sources:
        given_away = {d.bundle for d in result.decisions if d.src == src}
        assert given_away < snap.owned_bundles(src)
