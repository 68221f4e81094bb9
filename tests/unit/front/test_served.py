"""Which of the bundles the front holds a topic falls in, splits included."""

from __future__ import annotations

import pytest

from lbd.core.bundles import NamespaceBundles, topic_hash
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BundleId
from lbd.core.names import NamespaceName
from lbd.front.served import ServedBundles, Topic

NS = NamespaceName.parse("t/n")
LAYOUT = NamespaceBundles.default(NS, 4)
BUNDLES = [b.id for b in LAYOUT.bundles()]


def topic_of(bundle: BundleId) -> Topic:
    for i in range(10_000):
        topic = Topic.parse(f"persistent://t/n/x{i}")
        if LAYOUT.find(topic.name).id == bundle:
            return topic
    raise AssertionError(bundle)


def test_a_topic_falls_in_the_held_bundle_whose_range_has_its_hash() -> None:
    served = ServedBundles()
    served.add(BUNDLES[1])
    assert served.containing(topic_of(BUNDLES[1])) == [BUNDLES[1]]
    assert served.containing(topic_of(BUNDLES[2])) == []


def test_the_last_bundle_includes_the_top_of_the_hash_space() -> None:
    served = ServedBundles()
    served.add(BUNDLES[3])
    top = Topic("persistent://t/n/top", "t/n", 0xFFFFFFFF)
    assert served.containing(top) == [BUNDLES[3]]


def test_during_a_split_a_topic_falls_in_the_parent_and_its_child() -> None:
    parent = BUNDLES[0]
    topic = topic_of(parent)
    mid = 0x20000000
    low, high = BundleId(f"t/n/0x00000000_0x{mid:08x}"), BundleId(f"t/n/0x{mid:08x}_0x40000000")
    served = ServedBundles()
    for b in (parent, low, high):
        served.add(b)
    child = low if topic.hash < mid else high
    assert sorted(served.containing(topic)) == sorted([parent, child])
    served.remove(parent)
    assert served.containing(topic) == [child]


def test_adding_and_removing_are_idempotent_and_clear_says_what_was_held() -> None:
    served = ServedBundles()
    served.add(BUNDLES[0])
    served.add(BUNDLES[0])
    served.remove(BUNDLES[2])
    assert len(served) == 1 and BUNDLES[0] in served
    assert served.clear() == [BUNDLES[0]]
    assert len(served) == 0


def test_a_topic_name_is_parsed_once_with_its_hash() -> None:
    topic = Topic.parse("persistent://t/n/abc")
    assert (topic.namespace, topic.hash) == ("t/n", topic_hash("persistent://t/n/abc"))
    with pytest.raises(InvalidInputError):
        Topic.parse("t/n/abc")
