"""Topic and namespace names, parsed and validated the way Pulsar does.

A topic is ``{persistent|non-persistent}://tenant/namespace/local-name``; a namespace is
``tenant/namespace``. Tenant and namespace follow Pulsar's ``NamedEntity`` rule (ASCII letters,
digits and ``_ - = : .``). The local name may hold anything but ``/`` and control characters, as
Pulsar URL-encodes it where needed. Pulsar's short forms (``my-topic``, ``t/ns/my-topic``) and
legacy four-segment names (``t/cluster/ns/topic``) are rejected: lbd only speaks full names.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from enum import StrEnum

from lbd.core.errors import InvalidInputError

MAX_TOPIC_NAME_LENGTH = 1024
"""Longest accepted full topic name, in characters; far above real names, it bounds log lines."""

MAX_NAMESPACE_NAME_LENGTH = 255
"""Longest accepted ``tenant/namespace``: it becomes part of an etcd key and of every bundle id."""

PARTITION_SUFFIX = "-partition-"

_ENTITY_ALLOWED = re.compile(r"[-=:.\w]", re.ASCII)
_ENTITY_VALID = re.compile(f"{_ENTITY_ALLOWED.pattern}+", re.ASCII)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""Unicode's control characters (category Cc): U+0000-U+001F and U+007F-U+009F."""
_ENTITY_RULE = "letters, digits, '_', '-', '=', ':' and '.'"
_PARTITION_INDEX = re.compile(r"0|[1-9][0-9]*")
_INT32_MAX = 2**31 - 1


class TopicDomain(StrEnum):
    """Whether a topic's messages are stored (``persistent``) or not."""

    PERSISTENT = "persistent"
    NON_PERSISTENT = "non-persistent"


def _check_entity(kind: str, value: str, whole: str) -> None:
    """Raise unless ``value`` is a valid tenant or namespace (Pulsar ``NamedEntity.checkName``)."""
    if _ENTITY_VALID.fullmatch(value):
        return
    if not value:
        raise InvalidInputError(f"invalid {whole}: empty {kind}")
    bad = sorted({c for c in value if not _ENTITY_ALLOWED.fullmatch(c)})
    if bad:
        shown = ", ".join(repr(c) for c in bad)
        raise InvalidInputError(
            f"invalid {whole}: {kind} {value!r} has illegal characters {shown} "
            f"(allowed: {_ENTITY_RULE})"
        )


@dataclass(frozen=True, slots=True, order=True)
class NamespaceName:
    """A namespace, ``tenant/namespace``."""

    tenant: str
    namespace: str

    def __post_init__(self) -> None:
        whole = f"namespace name {self.tenant + '/' + self.namespace!r}"
        _check_entity("tenant", self.tenant, whole)
        _check_entity("namespace", self.namespace, whole)
        if len(self.tenant) + 1 + len(self.namespace) > MAX_NAMESPACE_NAME_LENGTH:
            raise InvalidInputError(
                f"invalid {whole}: longer than {MAX_NAMESPACE_NAME_LENGTH} characters"
            )

    @classmethod
    def parse(cls, text: str) -> NamespaceName:
        """Parse ``tenant/namespace``; raise InvalidInputError saying what is wrong."""
        parts = text.split("/")
        if len(parts) != 2:
            raise InvalidInputError(
                f"invalid namespace name {text!r}: expected tenant/namespace, "
                f"got {len(parts)} segment(s)"
            )
        return cls(parts[0], parts[1])

    def __str__(self) -> str:
        return f"{self.tenant}/{self.namespace}"


def _partition_index(local_name: str) -> int | None:
    """N for a local name ending in ``-partition-N`` (N without sign or leading zeros), else None.

    Pulsar reads the suffix the same way: ``t-partition-01`` or ``t-partition--1`` are plain
    topics that happen to have odd names, not partitions.
    """
    _, sep, suffix = local_name.rpartition(PARTITION_SUFFIX)
    if not sep or not _PARTITION_INDEX.fullmatch(suffix):
        return None
    index = int(suffix)
    return index if index <= _INT32_MAX else None


@dataclass(frozen=True, slots=True, order=True)
class TopicName:
    """A full topic name. ``str()`` gives the canonical form, which is what is hashed."""

    domain: TopicDomain
    namespace: NamespaceName
    local_name: str

    def __post_init__(self) -> None:
        local = self.local_name
        if not local:
            raise self._invalid("empty local name")
        if "/" in local:
            raise self._invalid("local name must not contain '/'")
        if _CONTROL.search(local):
            controls = sorted({c for c in local if unicodedata.category(c) == "Cc"})
            shown = ", ".join(repr(c) for c in controls)
            raise self._invalid(f"local name has control characters {shown}")
        if len(self._joined()) > MAX_TOPIC_NAME_LENGTH:
            raise self._invalid(f"longer than {MAX_TOPIC_NAME_LENGTH} characters")

    def _invalid(self, why: str) -> InvalidInputError:
        """The error for this name, saying ``why`` (the name is quoted only when it is bad)."""
        return InvalidInputError(f"invalid topic name {self._joined()!r}: {why}")

    def _joined(self) -> str:
        return f"{self.domain.value}://{self.namespace}/{self.local_name}"

    @classmethod
    def parse(cls, text: str) -> TopicName:
        """Parse ``domain://tenant/namespace/local-name``; InvalidInputError saying why not."""
        expected = "expected {persistent|non-persistent}://tenant/namespace/topic"
        if not text:
            raise InvalidInputError(f"invalid topic name: empty ({expected})")
        if len(text) > MAX_TOPIC_NAME_LENGTH:
            raise InvalidInputError(
                f"invalid topic name {text[:64]!r}...: longer than {MAX_TOPIC_NAME_LENGTH} "
                "characters"
            )
        domain_text, sep, rest = text.partition("://")
        if not sep:
            raise InvalidInputError(f"invalid topic name {text!r}: missing '://' ({expected})")
        try:
            domain = TopicDomain(domain_text)
        except ValueError:
            raise InvalidInputError(
                f"invalid topic name {text!r}: unknown domain {domain_text!r} "
                "(expected 'persistent' or 'non-persistent')"
            ) from None
        segments = rest.split("/")
        if len(segments) != 3:
            legacy = " (legacy names with a cluster segment are not supported)"
            raise InvalidInputError(
                f"invalid topic name {text!r}: {len(segments)} path segment(s) after '://', "
                f"expected 3 (tenant/namespace/topic){legacy if len(segments) == 4 else ''}"
            )
        tenant, namespace, local_name = segments
        whole = f"topic name {text!r}"
        _check_entity("tenant", tenant, whole)
        _check_entity("namespace", namespace, whole)
        return cls(domain, NamespaceName(tenant, namespace), local_name)

    @property
    def tenant(self) -> str:
        """The tenant part."""
        return self.namespace.tenant

    @property
    def partition_index(self) -> int | None:
        """N when this topic is partition N of a partitioned topic, else None."""
        return _partition_index(self.local_name)

    @property
    def is_persistent(self) -> bool:
        """True for ``persistent://`` topics."""
        return self.domain is TopicDomain.PERSISTENT

    def __str__(self) -> str:
        return self._joined()
