"""Topic and namespace names: valid forms, canonical strings, and each malformed case's message."""

import pytest

from lbd.core.errors import InvalidInputError
from lbd.core.names import (
    MAX_NAMESPACE_NAME_LENGTH,
    MAX_TOPIC_NAME_LENGTH,
    NamespaceName,
    TopicDomain,
    TopicName,
)


@pytest.mark.parametrize(
    ("text", "domain", "tenant", "namespace", "local"),
    [
        (
            "persistent://public/default/my-topic",
            TopicDomain.PERSISTENT,
            "public",
            "default",
            "my-topic",
        ),
        ("non-persistent://t/ns/x", TopicDomain.NON_PERSISTENT, "t", "ns", "x"),
        ("persistent://a-b_c.d:e=f/N0/t", TopicDomain.PERSISTENT, "a-b_c.d:e=f", "N0", "t"),
        (
            "persistent://t/ns/with space & ünïcode",
            TopicDomain.PERSISTENT,
            "t",
            "ns",
            "with space & ünïcode",
        ),
    ],
)
def test_valid_topic_names(
    text: str, domain: TopicDomain, tenant: str, namespace: str, local: str
) -> None:
    topic = TopicName.parse(text)
    assert topic.domain is domain
    assert topic.tenant == tenant
    assert topic.namespace == NamespaceName(tenant, namespace)
    assert topic.local_name == local
    assert str(topic) == text
    assert topic.is_persistent == (domain is TopicDomain.PERSISTENT)


@pytest.mark.parametrize(
    ("local", "index"),
    [
        ("t-partition-0", 0),
        ("t-partition-7", 7),
        ("a-partition-1-partition-12", 12),
        ("t-partition-2147483647", 2147483647),
        ("t", None),
        ("t-partition-", None),
        ("t-partition-01", None),
        ("t-partition--1", None),
        ("t-partition-+1", None),
        ("t-partition-1x", None),
        ("t-partition-2147483648", None),
    ],
)
def test_partition_index(local: str, index: int | None) -> None:
    assert TopicName.parse(f"persistent://t/ns/{local}").partition_index == index


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("my-topic", "missing '://'"),
        ("t/ns/my-topic", "missing '://'"),
        ("persistent:/t/ns/x", "missing '://'"),
        ("http://t/ns/x", "unknown domain 'http'"),
        ("Persistent://t/ns/x", "unknown domain 'Persistent'"),
        ("://t/ns/x", "unknown domain ''"),
        ("persistent://t/ns", "2 path segment(s) after '://', expected 3"),
        ("persistent://t", "1 path segment(s)"),
        ("persistent://t/cluster/ns/x", "4 path segment(s) after '://', expected 3"),
        ("persistent://t/ns/a/b/c", "5 path segment(s)"),
        ("persistent:///ns/x", "empty tenant"),
        ("persistent://t//x", "empty namespace"),
        ("persistent://t/ns/", "empty local name"),
        ("persistent://t t/ns/x", "tenant 't t' has illegal characters ' '"),
        ("persistent://t/n$s/x", "namespace 'n$s' has illegal characters '$'"),
        ("persistent://t/né/x", "namespace 'né' has illegal characters 'é'"),
        ("persistent://t/ns/x\ny", "local name has control characters '\\n'"),
        ("persistent://t/ns/" + "x" * MAX_TOPIC_NAME_LENGTH, "longer than 1024"),
    ],
)
def test_malformed_topic_names(text: str, message: str) -> None:
    with pytest.raises(InvalidInputError) as err:
        TopicName.parse(text)
    assert message in str(err.value)
    assert str(err.value).startswith("invalid topic name")


def test_legacy_name_gets_a_hint() -> None:
    with pytest.raises(InvalidInputError, match="legacy names with a cluster segment"):
        TopicName.parse("persistent://t/cluster/ns/x")


def test_topic_names_compare_by_value() -> None:
    assert TopicName.parse("persistent://t/ns/x") == TopicName.parse("persistent://t/ns/x")
    assert TopicName.parse("persistent://t/ns/x") != TopicName.parse("non-persistent://t/ns/x")
    assert (
        len({TopicName.parse("persistent://t/ns/x"), TopicName.parse("persistent://t/ns/x")}) == 1
    )


def test_direct_construction_is_validated() -> None:
    ns = NamespaceName("t", "ns")
    with pytest.raises(InvalidInputError, match="local name must not contain '/'"):
        TopicName(TopicDomain.PERSISTENT, ns, "a/b")
    with pytest.raises(InvalidInputError, match="empty local name"):
        TopicName(TopicDomain.PERSISTENT, ns, "")


def test_namespace_name_parse_and_str() -> None:
    ns = NamespaceName.parse("my-tenant/my.ns")
    assert (ns.tenant, ns.namespace) == ("my-tenant", "my.ns")
    assert str(ns) == "my-tenant/my.ns"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "got 1 segment(s)"),
        ("tenant", "expected tenant/namespace, got 1 segment(s)"),
        ("t/c/ns", "got 3 segment(s)"),
        ("/ns", "empty tenant"),
        ("t/", "empty namespace"),
        ("t/n s", "namespace 'n s' has illegal characters ' '"),
        ("t#/ns", "tenant 't#' has illegal characters '#'"),
        ("t/" + "n" * MAX_NAMESPACE_NAME_LENGTH, "longer than 255"),
    ],
)
def test_malformed_namespace_names(text: str, message: str) -> None:
    with pytest.raises(InvalidInputError) as err:
        NamespaceName.parse(text)
    assert message in str(err.value)


def test_illegal_characters_are_all_listed() -> None:
    with pytest.raises(InvalidInputError, match="illegal characters ' ', '#', '\\$'"):
        NamespaceName.parse("t/a $#b")
