"""Namespace policies and the namespace record stored in the metadata store.

The record is the value of ``namespaces/<tenant>/<ns>``: the bundle boundaries and the policies
(isolation, anti-affinity group, max bundles), as JSON. Boundaries are written as ``0x%08x``
strings, as Pulsar writes its ``BundlesData``, so that an operator can read them in ``etcdctl``.
Unknown keys are ignored when reading, so that a record written by a newer sidecar still loads.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lbd.core.bundles import FULL_UPPER, NamespaceBundles, default_boundaries
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId
from lbd.core.names import NamespaceName


def _broker_host(broker: BrokerId) -> str:
    """The host of a ``host:port`` broker id (the id itself when it has no port)."""
    host, sep, port = broker.rpartition(":")
    return host if sep and port.isdigit() else broker


@functools.lru_cache(maxsize=8192)
def _matches(patterns: tuple[str, ...], broker: BrokerId) -> bool:
    """Whether a pattern matches ``broker`` or its host (remembered: the filters ask about the
    same brokers for every bundle)."""
    host = _broker_host(broker)
    return any(re.fullmatch(p, broker) or re.fullmatch(p, host) for p in patterns)


@dataclass(frozen=True, slots=True)
class IsolationPolicy:
    """Which brokers may own a namespace (Pulsar ``NamespaceIsolationPolicy``, simplified).

    Each pattern is a regular expression matched in full against a broker id or its host.
    Primary brokers are preferred; secondary ones are added while fewer than
    ``min_available_primaries`` primaries are available (Pulsar's ``min_available`` auto-failover
    policy). Brokers primary for any namespace's policy are reserved: namespaces without a policy
    are not placed on them.
    """

    primary: tuple[str, ...]
    secondary: tuple[str, ...] = ()
    min_available_primaries: int = 1

    def __post_init__(self) -> None:
        # Tuples whatever the caller gave: the patterns are a key of the matching cache.
        object.__setattr__(self, "primary", tuple(self.primary))
        object.__setattr__(self, "secondary", tuple(self.secondary))
        if not self.primary:
            raise InvalidInputError("isolation policy: at least one primary broker pattern needed")
        for kind, patterns in (("primary", self.primary), ("secondary", self.secondary)):
            for pattern in patterns:
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise InvalidInputError(
                        f"isolation policy: {kind} pattern {pattern!r} is not a valid regular "
                        f"expression: {e}"
                    ) from None
        if self.min_available_primaries < 0:
            raise InvalidInputError(
                "isolation policy: min_available_primaries must be >= 0, "
                f"got {self.min_available_primaries}"
            )

    def is_primary(self, broker: BrokerId) -> bool:
        """Whether ``broker`` matches a primary pattern."""
        return _matches(self.primary, broker)

    def is_secondary(self, broker: BrokerId) -> bool:
        """Whether ``broker`` matches a secondary pattern."""
        return _matches(self.secondary, broker)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of this policy."""
        return {
            "primary": list(self.primary),
            "secondary": list(self.secondary),
            "min_available_primaries": self.min_available_primaries,
        }

    @classmethod
    def from_dict(cls, data: object) -> IsolationPolicy:
        """Parse the JSON object of a policy; InvalidInputError naming the bad field."""
        obj = _object(data, "isolation")
        return cls(
            primary=_strings(obj.get("primary"), "isolation.primary"),
            secondary=_strings(obj.get("secondary", []), "isolation.secondary"),
            min_available_primaries=_int(
                obj.get("min_available_primaries", 1), "isolation.min_available_primaries"
            ),
        )


@dataclass(frozen=True, slots=True)
class NamespacePolicies:
    """Placement and split policies of one namespace; every field is optional."""

    isolation: IsolationPolicy | None = None
    anti_affinity_group: str | None = None
    """Namespaces of the same group are spread over brokers (compared case-insensitively)."""
    max_bundles: int | None = None
    """Split no further than this many bundles; None means the cluster default."""

    def __post_init__(self) -> None:
        group = self.anti_affinity_group
        if group is not None and (not group or group != group.strip()):
            raise InvalidInputError(
                f"anti_affinity_group must be non-empty without surrounding spaces, got {group!r}"
            )
        if self.max_bundles is not None and self.max_bundles < 1:
            raise InvalidInputError(f"max_bundles must be >= 1, got {self.max_bundles}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of these policies (absent ones are null)."""
        return {
            "isolation": self.isolation.to_dict() if self.isolation else None,
            "anti_affinity_group": self.anti_affinity_group,
            "max_bundles": self.max_bundles,
        }

    @classmethod
    def from_dict(cls, data: object) -> NamespacePolicies:
        """Parse the JSON object of the policies; InvalidInputError naming the bad field."""
        obj = _object(data, "policies")
        isolation = obj.get("isolation")
        group = obj.get("anti_affinity_group")
        if group is not None and not isinstance(group, str):
            raise InvalidInputError(f"anti_affinity_group must be a string or null, got {group!r}")
        max_bundles = obj.get("max_bundles")
        return cls(
            isolation=None if isolation is None else IsolationPolicy.from_dict(isolation),
            anti_affinity_group=group,
            max_bundles=None if max_bundles is None else _int(max_bundles, "max_bundles"),
        )


@dataclass(frozen=True, slots=True)
class NamespaceRecord:
    """A namespace as stored: its name, bundle boundaries and policies."""

    name: NamespaceName
    boundaries: tuple[int, ...]
    policies: NamespacePolicies = field(default_factory=NamespacePolicies)
    _layout: NamespaceBundles = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Validated once: a lookup asks for the layout on every call.
        object.__setattr__(self, "_layout", NamespaceBundles(self.name, self.boundaries))

    @classmethod
    def create(
        cls, name: NamespaceName, bundle_count: int, policies: NamespacePolicies | None = None
    ) -> NamespaceRecord:
        """A new namespace of ``bundle_count`` equal bundles, within the policies' max bundles."""
        policies = policies or NamespacePolicies()
        if policies.max_bundles is not None and bundle_count > policies.max_bundles:
            raise InvalidInputError(
                f"namespace {name}: {bundle_count} bundles exceed its max_bundles "
                f"{policies.max_bundles}"
            )
        return cls(name, default_boundaries(bundle_count), policies)

    def bundles(self) -> NamespaceBundles:
        """The bundle layout (validated when the record was made)."""
        return self._layout

    def to_json(self) -> str:
        """The stored JSON text."""
        return json.dumps(
            {
                "name": str(self.name),
                "boundaries": [f"0x{b:08x}" for b in self.boundaries],
                "policies": self.policies.to_dict(),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> NamespaceRecord:
        """Parse stored JSON text; InvalidInputError saying which field is wrong."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidInputError(f"namespace record is not valid JSON: {e}") from None
        obj = _object(data, "namespace record")
        name = obj.get("name")
        if not isinstance(name, str):
            raise InvalidInputError(f"namespace record: name must be a string, got {name!r}")
        return cls(
            name=NamespaceName.parse(name),
            boundaries=tuple(_boundary(b) for b in _list(obj.get("boundaries"), "boundaries")),
            policies=NamespacePolicies.from_dict(obj.get("policies", {})),
        )


def _object(data: object, what: str) -> Mapping[str, Any]:
    if not isinstance(data, dict):
        raise InvalidInputError(f"{what} must be a JSON object, got {data!r}")
    return data


def _list(data: object, what: str) -> list[Any]:
    if not isinstance(data, list):
        raise InvalidInputError(f"{what} must be a JSON list, got {data!r}")
    return data


def _strings(data: object, what: str) -> tuple[str, ...]:
    items = _list(data, what)
    bad = [x for x in items if not isinstance(x, str)]
    if bad:
        raise InvalidInputError(f"{what} must hold strings only, got {bad[0]!r}")
    return tuple(items)


def _int(data: object, what: str) -> int:
    # bool is an int subclass; `true` is never a count.
    if not isinstance(data, int) or isinstance(data, bool):
        raise InvalidInputError(f"{what} must be an integer, got {data!r}")
    return data


def _boundary(data: object) -> int:
    """A boundary written as ``0x%08x`` (a plain JSON integer is accepted too)."""
    if isinstance(data, str):
        if not re.fullmatch(r"0[xX][0-9a-fA-F]{1,8}", data):
            raise InvalidInputError(f"boundary {data!r} is not a hex number like '0x40000000'")
        return int(data, 16)
    value = _int(data, "boundary")
    if not 0 <= value <= FULL_UPPER:
        raise InvalidInputError(f"boundary {value} is outside [0x00000000, 0xffffffff]")
    return value
