"""The simulated brokers' synthetic traffic: deterministic, in the right bundles, moving along."""

import pytest

from lbd.core.bundles import NamespaceBundles, parse_bundle_id, topic_hash
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BundleId
from lbd.core.names import NamespaceName
from lbd.devcluster.sim_broker import SimBroker, SimBrokerConfig, load_report
from lbd.workload.traffic import Workload, WorkloadSpec, _NamePool

NS = NamespaceName("public", "default")
BUNDLES = [b.id for b in NamespaceBundles.default(NS, 16).bundles()]


def test_every_topic_hashes_into_its_bundle() -> None:
    workload = Workload(WorkloadSpec(topics_per_bundle=12))
    for bundle in BUNDLES:
        topics = workload.topics(bundle)
        assert len(topics) == 12
        bundle_range = parse_bundle_id(bundle).range
        assert all(topic_hash(t) in bundle_range for t in topics), bundle


def test_the_same_seed_gives_the_same_traffic_and_another_seed_another() -> None:
    a = Workload(WorkloadSpec(seed=7)).sample(BUNDLES[:5], sequence=3)
    b = Workload(WorkloadSpec(seed=7)).sample(BUNDLES[:5], sequence=3)
    c = Workload(WorkloadSpec(seed=8)).sample(BUNDLES[:5], sequence=3)
    assert a == b
    assert a != c


def test_a_bundle_carries_the_same_topics_whichever_broker_serves_it() -> None:
    bundle = BUNDLES[3]
    alone = Workload().bundle_traffic(bundle, 9)
    among_others = {b.bundle: b for b in Workload().sample(BUNDLES, 9).bundles}[bundle]
    assert alone == among_others


def test_the_children_of_a_split_share_their_parent_s_topics() -> None:
    spec = WorkloadSpec(topics_per_bundle=20)
    parent = parse_bundle_id(BUNDLES[0])
    mid = (parent.range.lo + parent.range.hi) // 2
    children = [
        BundleId(f"{NS}/0x{parent.range.lo:08x}_0x{mid:08x}"),
        BundleId(f"{NS}/0x{mid:08x}_0x{parent.range.hi:08x}"),
    ]
    parent_topics = set(Workload(spec).topics(parent.id))
    child_topics = [set(Workload(spec).topics(c)) for c in children]
    # Each child takes the parent's topics that fall in its half, then finds more of its own.
    assert parent_topics <= child_topics[0] | child_topics[1]
    assert all(len(t) == 20 for t in child_topics)


def test_usage_grows_with_the_bundles_served_and_an_idle_broker_uses_no_cpu() -> None:
    workload = Workload(WorkloadSpec(msg_rate=100.0, jitter=0.0))
    idle = workload.sample([], 1)
    few = workload.sample(BUNDLES[:2], 1)
    many = workload.sample(BUNDLES, 1)
    assert idle.cpu.usage == 0 and idle.bundles == ()
    assert 0 < few.cpu.usage < many.cpu.usage <= 100
    assert few.bandwidth_in.usage < many.bandwidth_in.usage
    assert few.memory.usage < many.memory.usage <= many.memory.limit
    assert len(many.bundles) == len(BUNDLES)


def test_a_zero_rate_broker_reports_bundles_but_no_traffic() -> None:
    sample = Workload(WorkloadSpec(msg_rate=0.0)).sample(BUNDLES[:3], 1)
    assert sample.cpu.usage == 0 and sample.bandwidth_out.usage == 0
    assert [b.msg_rate_in for b in sample.bundles] == [0.0, 0.0, 0.0]
    assert all(b.producers == 0 for b in sample.bundles)


def test_hot_topics_make_some_bundles_much_busier_than_the_median() -> None:
    workload = Workload(WorkloadSpec(topics_per_bundle=10, hot_fraction=0.1, jitter=0.0))
    rates = sorted(workload.bundle_traffic(b, 1).msg_rate_in for b in BUNDLES)
    assert rates[-1] > 2 * rates[len(rates) // 2]


def test_topics_are_reported_busiest_first() -> None:
    traffic = Workload(WorkloadSpec(jitter=0.0)).bundle_traffic(BUNDLES[5], 1)
    rates = [t.msg_rate for t in traffic.topics]
    assert rates == sorted(rates, reverse=True)


def test_jitter_varies_a_bundle_s_rate_between_reports_within_its_bound() -> None:
    workload = Workload(WorkloadSpec(jitter=0.1))
    base = Workload(WorkloadSpec(jitter=0.0)).bundle_traffic(BUNDLES[1], 1).msg_rate_in
    rates = {workload.bundle_traffic(BUNDLES[1], seq).msg_rate_in for seq in range(1, 20)}
    assert len(rates) > 1
    assert all(0.9 * base - 1e-9 <= r <= 1.1 * base + 1e-9 for r in rates)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("msg_rate", -1.0, "message rate"),
        ("topics_per_bundle", -1, "topics per bundle"),
        ("hot_fraction", 1.5, "hot fraction"),
        ("jitter", 1.0, "jitter"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkloadSpec(**{field: value})  # type: ignore[arg-type]


def test_a_bad_bundle_id_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="invalid bundle id"):
        Workload().topics(BundleId("not-a-bundle"))


def test_a_report_reuses_the_stats_of_steady_bundles_and_equals_one_made_afresh() -> None:
    quiet = Workload(WorkloadSpec(msg_rate=0.0, jitter=0.1))
    busy = Workload(WorkloadSpec(msg_rate=50.0, jitter=0.1))
    for workload, steady in ((quiet, True), (busy, False)):
        made: dict = {}
        first = load_report(workload.sample(BUNDLES, 1), made)
        kept = {b: stats for b, (_, stats) in made.items()}
        second = load_report(workload.sample(BUNDLES, 2), made)
        assert second == load_report(workload.sample(BUNDLES, 2))  # the same as made afresh
        assert (second == first) is steady  # a busy bundle's traffic jitters between reports
        reused = [b for b, (_, stats) in made.items() if stats is kept[b]]
        assert len(reused) == (len(BUNDLES) if steady else 0)
        # A bundle no longer served is forgotten.
        load_report(workload.sample(BUNDLES[1:], 3), made)
        assert set(made) == set(BUNDLES[1:])


@pytest.mark.parametrize("bundles", [1, 4, 1_000])
def test_a_bundle_s_topics_are_the_first_names_probing_would_find(bundles: int) -> None:
    # The pool hashes many names at once, however many a namespace needs; the topics must be
    # the smallest sim-<j> whose hash falls in the bundle, as probing j = 0, 1, ... finds them.
    spec = WorkloadSpec(topics_per_bundle=3)
    layout = NamespaceBundles.default(NamespaceName("t", "probe"), bundles)
    workload = Workload(spec)
    for bundle in list(layout.bundles())[:: max(1, bundles // 50)]:
        probed: list[str] = []
        j = 0
        while len(probed) < spec.topics_per_bundle:
            name = f"persistent://t/probe/sim-{j}"
            if layout.find(name).id == bundle.id:
                probed.append(name)
            j += 1
        assert sorted(workload.topics(bundle.id)) == sorted(probed)


def _count_growths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes the name pools grow to, from now on."""
    sizes: list[int] = []
    grow = _NamePool._grow

    def counted(pool: _NamePool, size: int) -> None:
        sizes.append(size)
        grow(pool, size)

    monkeypatch.setattr(_NamePool, "_grow", counted)
    return sizes


def test_one_growth_of_the_name_pool_serves_every_bundle_of_a_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A second growth rebuilds the pool four times as large, tens of milliseconds in the
    # middle of whatever the simulated broker was doing. With a pool of twice what a range
    # needs on average, some of this namespace's 4,000 ranges came up short.
    sizes = _count_growths(monkeypatch)
    layout = NamespaceBundles.default(NamespaceName("bench", "seq"), 4_000)
    workload = Workload(WorkloadSpec(topics_per_bundle=1))
    for bundle in layout.bundles():
        assert len(workload.topics(bundle.id)) == 1
    assert len(sizes) == 1


async def test_a_simulated_broker_builds_a_namespace_s_names_when_it_owns_a_bundle_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Not in a later load report: the pool a namespace's first bundle builds is built while
    # that Own is answered, so no report stalls the broker at some other instant.
    sizes = _count_growths(monkeypatch)
    broker = SimBroker(SimBrokerConfig("127.0.0.1:1", "b1"), Workload(WorkloadSpec()))
    await broker.own(BUNDLES[0])
    assert len(sizes) == 1
    report = broker.load_report()
    assert [b.bundle for b in report.bundles] == [BUNDLES[0]]
    assert len(sizes) == 1
