"""The ownership view without I/O: topic answers against a scan of a model, the memo, and the
staleness bound on a clock the test moves."""

from __future__ import annotations

import functools
import random

import pytest

from bench import broker_cache_bench
from lbd.broker import OwnershipView, StaleOwnershipError
from lbd.core.bundles import FULL_UPPER, Bundle, parse_bundle_id, topic_hash
from lbd.core.errors import InvalidInputError
from lbd.gen.v1 import lbd_pb2
from tests.unit.broker.views import DONE, ManualClock, heartbeat, owned, topic_with_hash, value

NS = "public/default"
LOW = f"{NS}/0x00000000_0x80000000"
HIGH = f"{NS}/0x80000000_0xffffffff"
S = lbd_pb2


def synced(view: OwnershipView, *changes: lbd_pb2.OwnershipChange, age_ms: int = 0) -> None:
    """Open a stream on ``view`` that sends ``changes``, then snapshot_done and a heartbeat."""
    view.stream_opened()
    for change in (*changes, DONE, heartbeat(age_ms)):
        view.receive(change)


# -- topic answers ---------------------------------------------------------------------------


class Model:
    """What the stream said, kept the plain way: bundle -> (state, owner); the layouts."""

    def __init__(self, rng: random.Random, namespaces: list[str]) -> None:
        self.rng = rng
        self.values: dict[str, tuple[lbd_pb2.BundleState, str]] = {}
        self.layouts = {ns: [(0, FULL_UPPER)] for ns in namespaces}
        self.version = 0

    def bundle(self, ns: str, lo: int, hi: int) -> str:
        return f"{ns}/0x{lo:08x}_0x{hi:08x}"

    def change(self) -> list[lbd_pb2.OwnershipChange]:
        """One random step: a bundle's new value, a tombstone, or a split."""
        rng = self.rng
        ns = rng.choice(sorted(self.layouts))
        layout = self.layouts[ns]
        lo, hi = rng.choice(layout)
        bundle = self.bundle(ns, lo, hi)
        self.version += 1
        roll = rng.random()
        if roll < 0.2 and hi - lo > 1:
            mid = rng.randrange(lo + 1, hi)
            layout.remove((lo, hi))
            layout += [(lo, mid), (mid, hi)]
            out = [self.put(bundle, S.BUNDLE_STATE_DELETED, "")]
            for child in ((lo, mid), (mid, hi)):
                owner = rng.choice(["broker-1", "broker-2", "broker-3"])
                out.append(self.put(self.bundle(ns, *child), S.BUNDLE_STATE_OWNED, owner))
            return out
        if roll < 0.3:
            return [self.put(bundle, S.BUNDLE_STATE_INIT, "")]
        state = rng.choice(
            [S.BUNDLE_STATE_OWNED] * 3
            + [S.BUNDLE_STATE_ASSIGNING, S.BUNDLE_STATE_RELEASING, S.BUNDLE_STATE_FREE]
        )
        owner = "" if state == S.BUNDLE_STATE_FREE else rng.choice(["broker-1", "broker-2"])
        return [self.put(bundle, state, owner)]

    def put(self, bundle: str, state: lbd_pb2.BundleState, owner: str) -> lbd_pb2.OwnershipChange:
        if state == S.BUNDLE_STATE_INIT:
            self.values.pop(bundle, None)
        else:
            self.values[bundle] = (state, owner)
        return value(bundle, state, owner, self.version)

    def snapshot(self) -> list[lbd_pb2.OwnershipChange]:
        return [value(b, state, owner, 1) for b, (state, owner) in sorted(self.values.items())]

    def owner_of_topic(self, topic: str) -> str | None:
        """The owner by a scan of every Owned bundle of the topic's namespace."""
        ns = topic.split("://")[1].rsplit("/", 1)[0]
        h = topic_hash(topic)
        for bundle, (state, owner) in self.values.items():
            parsed = _parsed(bundle)
            if state == S.BUNDLE_STATE_OWNED and str(parsed.namespace) == ns and h in parsed.range:
                return owner
        return None


@functools.cache
def _parsed(bundle: str) -> Bundle:
    return parse_bundle_id(bundle)


@pytest.mark.parametrize("seed", range(5))
def test_topic_answers_match_a_scan_of_the_owned_bundles_through_changes_splits_and_a_resync(
    seed: int,
) -> None:
    rng = random.Random(seed)
    namespaces = ["public/default", "tenant/ns"]
    model = Model(rng, namespaces)
    topics = [f"persistent://{ns}/t-{i}" for ns in [*namespaces, "other/ns"] for i in range(100)]
    view = OwnershipView(clock=ManualClock(), memo_size=150)
    synced(view)
    for step in range(300):
        for change in model.change():
            view.receive(change)
        if step == 150:  # a reconnect: the new snapshot replaces everything
            synced(view, *model.snapshot())
        for topic in rng.sample(topics, 10) * 2:  # each twice: the second from the memo
            assert view.owner_of_topic(topic) == model.owner_of_topic(topic), (step, topic)
        for bundle, (state, owner) in model.values.items():
            assert view.owner(bundle) == (owner if state == S.BUNDLE_STATE_OWNED else None)
    assert view.memoized <= 150


def test_a_split_sends_topics_to_the_children_and_a_move_to_nobody() -> None:
    view = OwnershipView(clock=ManualClock())
    low_topic = topic_with_hash(NS, 0x10000000)
    high_topic = topic_with_hash(NS, 0x90000000)
    synced(view, owned(LOW, "broker-1"), owned(HIGH, "broker-2"))
    assert view.owner_of_topic(low_topic) == "broker-1"
    assert view.owner_of_topic(high_topic) == "broker-2"

    view.receive(value(LOW, S.BUNDLE_STATE_SPLITTING, "broker-1", 2))
    assert view.owner_of_topic(low_topic) is None  # splitting: not Owned
    view.receive(value(LOW, S.BUNDLE_STATE_DELETED, "", 3))
    view.receive(owned(f"{NS}/0x00000000_0x40000000", "broker-3", 3))
    view.receive(owned(f"{NS}/0x40000000_0x80000000", "broker-1", 3))
    assert view.owner_of_topic(low_topic) == "broker-3"
    answer = view.lookup_topic(low_topic)
    assert answer is not None and answer.bundle == f"{NS}/0x00000000_0x40000000"
    assert view.owner_of_topic(topic_with_hash(NS, 0x7FFFFFFF)) == "broker-1"

    view.receive(value(HIGH, S.BUNDLE_STATE_RELEASING, "broker-3", 4))
    assert view.owner_of_topic(high_topic) is None  # moving: nobody to send clients to
    view.receive(owned(HIGH, "broker-3", 5))
    assert view.owner_of_topic(high_topic) == "broker-3"
    view.receive(value(HIGH, S.BUNDLE_STATE_INIT))
    assert view.owner_of_topic(high_topic) is None  # tombstoned


def test_the_range_bounds_hold_the_lower_and_the_last_bundle_holds_0xffffffff() -> None:
    view = OwnershipView(clock=ManualClock())
    synced(view, owned(LOW, "broker-1"), owned(HIGH, "broker-2"))
    assert view.owner_of_topic(topic_with_hash(NS, 0x00000000)) == "broker-1"
    assert view.owner_of_topic(topic_with_hash(NS, 0x7FFFFFFF)) == "broker-1"
    assert view.owner_of_topic(topic_with_hash(NS, 0x80000000)) == "broker-2"
    assert view.owner_of_topic(topic_with_hash(NS, 0xFFFFFFFF)) == "broker-2"
    view.receive(value(HIGH, S.BUNDLE_STATE_FREE, "", 2))
    view.receive(owned(f"{NS}/0x80000000_0xfffffffe", "broker-3", 3))  # not the last bundle
    assert view.owner_of_topic(topic_with_hash(NS, 0xFFFFFFFD)) == "broker-3"
    assert view.owner_of_topic(topic_with_hash(NS, 0xFFFFFFFE)) is None
    assert view.owner_of_topic(topic_with_hash(NS, 0xFFFFFFFF)) is None


def test_invalid_topic_names_raise_and_unknown_namespaces_have_no_owner() -> None:
    view = OwnershipView(clock=ManualClock())
    synced(view, owned(LOW, "broker-1"), owned(HIGH, "broker-2"))
    for bad in ("", "t1", "public/default/t1", "persistent://public/t1", "http://a/b/c"):
        with pytest.raises(InvalidInputError):
            view.owner_of_topic(bad)
    assert view.owner_of_topic("persistent://other/ns/t1") is None
    view.receive(owned("other/ns/0x00000000_0xffffffff", "broker-4"))
    assert view.owner_of_topic("persistent://other/ns/t1") == "broker-4"  # its memo was voided
    assert view.owner_of_topic("non-persistent://other/ns/t1") == "broker-4"


def test_the_memo_stays_within_its_size_and_answers_stay_right() -> None:
    view = OwnershipView(clock=ManualClock(), memo_size=10)
    synced(view, owned(LOW, "broker-1"), owned(HIGH, "broker-2"))
    topics = [f"persistent://{NS}/t-{i}" for i in range(35)]
    for topic in topics * 2:
        expected = "broker-1" if topic_hash(topic) < 0x80000000 else "broker-2"
        assert view.owner_of_topic(topic) == expected
        assert 1 <= view.memoized <= 10


# -- the staleness bound ---------------------------------------------------------------------


def test_nothing_is_answered_before_a_heartbeat_vouches_for_the_snapshot() -> None:
    clock = ManualClock()
    view = OwnershipView(clock=clock, stale_after_s=1.0)
    with pytest.raises(StaleOwnershipError, match="not synced yet: the stream is down"):
        view.owner(LOW)
    with pytest.raises(RuntimeError, match="no stream is open"):
        view.receive(owned(LOW, "broker-1"))
    view.stream_opened()
    view.receive(owned(LOW, "broker-1"))
    view.receive(heartbeat())  # before snapshot_done: the table is not complete
    view.receive(DONE)
    with pytest.raises(StaleOwnershipError, match="not synced yet: a new snapshot waits for"):
        view.owner_of_topic(topic_with_hash(NS, 1))
    assert (view.syncs, view.live) == (0, False)
    view.receive(heartbeat())
    assert (view.syncs, view.live) == (1, True)
    assert view.owner_of_topic(topic_with_hash(NS, 1)) == "broker-1"


def test_answers_stop_exactly_at_the_bound_after_the_instant_vouched_for() -> None:
    clock = ManualClock()
    view = OwnershipView(clock=clock, stale_after_s=1.0)
    topic = topic_with_hash(NS, 1)
    synced(view, owned(LOW, "broker-1"), age_ms=300)  # vouched for as of 0.3 s ago
    clock.advance(0.7)
    assert view.owner_of_topic(topic) == "broker-1"
    assert view.vouched_age_s() == pytest.approx(1.0)
    clock.advance(0.001)
    assert not view.fresh()
    for ask in (view.owner_of_topic, view.lookup_topic):
        with pytest.raises(StaleOwnershipError, match=r"stale: vouched for as of 1\.00 s ago"):
            ask(topic)
    with pytest.raises(StaleOwnershipError, match=r"the last heartbeat came 0\.70 s ago"):
        view.owner(LOW)
    view.receive(heartbeat(100))  # the stream stayed open: a fresh heartbeat revives answers
    assert view.owner_of_topic(topic) == "broker-1"


def test_heartbeats_with_a_growing_age_do_not_keep_the_cache_fresh() -> None:
    """A sidecar cut off from the channel still sends heartbeats, vouching for nothing newer."""
    clock = ManualClock()
    view = OwnershipView(clock=clock, stale_after_s=1.0)
    synced(view, owned(LOW, "broker-1"))
    for tenths in range(1, 12):
        clock.advance(0.1)
        view.receive(heartbeat(tenths * 100))  # vouching for the instant of the cut, no later
        if tenths != 10:  # (at exactly the bound, float rounding decides)
            assert view.fresh() == (tenths < 10)
    with pytest.raises(StaleOwnershipError, match=r"last heartbeat came 0\.00 s ago and vouched"):
        view.owner(LOW)
    view.receive(heartbeat(50))  # it reads the channel again
    assert view.owner(LOW) == "broker-1"


def test_an_older_vouch_never_moves_the_bound_back() -> None:
    clock = ManualClock()
    view = OwnershipView(clock=clock, stale_after_s=1.0)
    synced(view, owned(LOW, "broker-1"))
    clock.advance(0.5)
    view.receive(heartbeat(900))  # vouches for an instant before the first heartbeat's
    assert view.vouched_age_s() == pytest.approx(0.5)
    clock.advance(0.5)
    assert view.fresh()


def test_a_resync_keeps_the_old_table_until_a_heartbeat_vouches_for_the_new_one() -> None:
    clock = ManualClock()
    view = OwnershipView(clock=clock, stale_after_s=1.0)
    synced(view, owned(LOW, "broker-1"), owned(HIGH, "broker-2"))
    view.stream_closed()
    assert view.owner(HIGH) == "broker-2"  # within the bound: what it had
    clock.advance(0.5)
    view.stream_opened()
    view.receive(owned(LOW, "broker-3", 2))  # HIGH's value was removed meanwhile
    view.receive(DONE)
    view.receive(owned(LOW, "broker-4", 3))
    assert (view.owner(LOW), view.owner(HIGH)) == ("broker-1", "broker-2")
    clock.advance(0.6)
    assert view.stale_reason() == (
        "ownership from the ownership stream is stale: vouched for as of 1.10 s ago (bound 1 s); "
        "a new snapshot waits for the sidecar's first heartbeat"
    )
    view.receive(heartbeat(2000))  # the new table, but as of an instant past the bound
    assert (view.syncs, view.live, view.fresh()) == (2, True, False)
    view.receive(heartbeat(0))
    assert (view.owner(LOW), view.get(HIGH)) == ("broker-4", None)
    assert view.owner_of_topic(topic_with_hash(NS, 0x90000000)) is None


def test_a_new_table_is_only_as_fresh_as_the_heartbeat_that_vouches_for_it() -> None:
    """What vouched for the old table says nothing of the new (it may come from a sidecar that
    lags behind the one before)."""
    clock = ManualClock()
    view = OwnershipView(clock=clock, stale_after_s=1.0)
    synced(view, owned(LOW, "broker-1"))
    view.stream_closed()
    synced(view, owned(LOW, "broker-2", 2), age_ms=900)
    assert view.vouched_age_s() == pytest.approx(0.9)
    clock.advance(0.2)
    with pytest.raises(StaleOwnershipError, match=r"vouched for 0\.90 s before it"):
        view.owner(LOW)


def test_a_closed_stream_answers_until_the_bound_then_refuses() -> None:
    clock = ManualClock()
    view = OwnershipView(clock=clock, stale_after_s=1.0)
    synced(view, owned(LOW, "broker-1"))
    view.stream_closed()
    clock.advance(1.0)
    assert view.owner(LOW) == "broker-1"
    clock.advance(0.01)
    with pytest.raises(StaleOwnershipError, match="the stream is down"):
        view.owner(LOW)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="stale bound"):
        OwnershipView(stale_after_s=0)
    with pytest.raises(InvalidInputError, match="memo size"):
        OwnershipView(memo_size=0)


def test_the_cache_benchmark_measures_every_path() -> None:
    result = broker_cache_bench.run(bundles=40, topics=200, rounds=2, misses=300)
    assert set(result) >= {
        "owner_of_topic_memo_hit_per_s",
        "owner_of_topic_miss_per_s",
        "owner_bundle_per_s",
        "changes_applied_per_s",
        "snapshot_bundles_per_s",
    }
    assert all(rate > 0 for rate in result.values())
    assert result["bundles"] == 40
