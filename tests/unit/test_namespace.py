"""Namespace policies and the stored namespace record: validation and the JSON codec."""

import json

import pytest

from lbd.core.bundles import FULL_UPPER, default_boundaries
from lbd.core.errors import InvalidInputError
from lbd.core.names import NamespaceName
from lbd.core.namespace import IsolationPolicy, NamespacePolicies, NamespaceRecord

NS = NamespaceName("t", "ns")


def test_record_round_trips_through_json() -> None:
    record = NamespaceRecord(
        NS,
        (0, 0x40000000, 0x60000000, FULL_UPPER),
        NamespacePolicies(
            isolation=IsolationPolicy(("broker-[12]",), ("broker-3",), min_available_primaries=2),
            anti_affinity_group="g1",
            max_bundles=64,
        ),
    )
    text = record.to_json()
    assert NamespaceRecord.from_json(text) == record
    assert NamespaceRecord.from_json(text.encode()) == record
    data = json.loads(text)
    assert data["name"] == "t/ns"
    assert data["boundaries"] == ["0x00000000", "0x40000000", "0x60000000", "0xffffffff"]
    assert data["policies"] == {
        "isolation": {
            "primary": ["broker-[12]"],
            "secondary": ["broker-3"],
            "min_available_primaries": 2,
        },
        "anti_affinity_group": "g1",
        "max_bundles": 64,
    }


def test_absent_policies_are_null_and_optional() -> None:
    record = NamespaceRecord.create(NS, 4)
    assert record.boundaries == default_boundaries(4)
    assert json.loads(record.to_json())["policies"] == {
        "isolation": None,
        "anti_affinity_group": None,
        "max_bundles": None,
    }
    minimal = '{"name": "t/ns", "boundaries": ["0x0", "0xffffffff"], "future_key": 1}'
    assert NamespaceRecord.from_json(minimal) == NamespaceRecord(NS, (0, FULL_UPPER))


def test_record_bundles() -> None:
    layout = NamespaceRecord.create(NS, 2).bundles()
    assert [b.id for b in layout.bundles()] == [
        "t/ns/0x00000000_0x80000000",
        "t/ns/0x80000000_0xffffffff",
    ]


def test_create_respects_max_bundles() -> None:
    with pytest.raises(InvalidInputError, match="8 bundles exceed its max_bundles 4"):
        NamespaceRecord.create(NS, 8, NamespacePolicies(max_bundles=4))
    with pytest.raises(InvalidInputError, match="number of bundles must be between 1"):
        NamespaceRecord.create(NS, 0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        ("[]", "namespace record must be a JSON object"),
        ('{"boundaries": []}', "name must be a string, got None"),
        ('{"name": "t/ns/x", "boundaries": ["0x0", "0xffffffff"]}', "got 3 segment"),
        ('{"name": "t/ns"}', "boundaries must be a JSON list, got None"),
        ('{"name": "t/ns", "boundaries": ["0x0"]}', "need at least 2 boundaries"),
        (
            '{"name": "t/ns", "boundaries": ["0x0", "0x10", "0x8", "0xffffffff"]}',
            "strictly increasing",
        ),
        ('{"name": "t/ns", "boundaries": ["0x0", "0xfffffff0"]}', "end at 0xffffffff"),
        ('{"name": "t/ns", "boundaries": ["0", "0xffffffff"]}', "not a hex number"),
        ('{"name": "t/ns", "boundaries": ["0x100000000", "0xffffffff"]}', "not a hex number"),
        ('{"name": "t/ns", "boundaries": [0, 4294967296]}', "outside [0x00000000, 0xffffffff]"),
        ('{"name": "t/ns", "boundaries": [0, true]}', "boundary must be an integer, got True"),
        (
            '{"name": "t/ns", "boundaries": [0, 4294967295], "policies": []}',
            "policies must be a JSON object",
        ),
        (
            '{"name": "t/ns", "boundaries": [0, 4294967295], "policies": {"max_bundles": 0}}',
            "max_bundles must be >= 1, got 0",
        ),
        (
            '{"name": "t/ns", "boundaries": [0, 4294967295], "policies": {"max_bundles": "8"}}',
            "max_bundles must be an integer, got '8'",
        ),
        (
            '{"name": "t/ns", "boundaries": [0, 4294967295], '
            '"policies": {"anti_affinity_group": 3}}',
            "anti_affinity_group must be a string or null, got 3",
        ),
        (
            '{"name": "t/ns", "boundaries": [0, 4294967295], '
            '"policies": {"isolation": {"secondary": []}}}',
            "isolation.primary must be a JSON list, got None",
        ),
        (
            '{"name": "t/ns", "boundaries": [0, 4294967295], '
            '"policies": {"isolation": {"primary": ["a", 1]}}}',
            "isolation.primary must hold strings only, got 1",
        ),
    ],
)
def test_malformed_records(text: str, message: str) -> None:
    with pytest.raises(InvalidInputError) as err:
        NamespaceRecord.from_json(text)
    assert message in str(err.value)


def test_policy_validation() -> None:
    with pytest.raises(InvalidInputError, match="at least one primary broker pattern"):
        IsolationPolicy(())
    with pytest.raises(InvalidInputError, match="secondary pattern '\\(' is not a valid regular"):
        IsolationPolicy(("a",), ("(",))
    with pytest.raises(InvalidInputError, match="min_available_primaries must be >= 0"):
        IsolationPolicy(("a",), min_available_primaries=-1)
    for group in ("", " g", "g "):
        with pytest.raises(InvalidInputError, match="anti_affinity_group must be non-empty"):
            NamespacePolicies(anti_affinity_group=group)
