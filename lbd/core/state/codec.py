"""A channel value as it travels: a JSON object with every field present (absent ones null);
the empty value is a tombstone. :func:`decode_value` is deliberately lenient where leniency
cannot split the cluster (unknown fields are ignored so that sidecars of different versions
agree; a null ``force`` or ``timestamp_ms`` reads as Pulsar's defaults) and strict everywhere
else."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from typing import Final

from lbd.core.bundles import bundle_id, parse_bundle_id
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.names import NamespaceName
from lbd.core.state.states import (
    LISTED_SPLIT_CHILDREN,
    MAX_SPLIT_CHILDREN,
    MAX_VALUE_BYTES,
    ServiceUnitState,
    ServiceUnitStateData,
    _check_count,
)

TOMBSTONE: Final = b""
"""The empty value: deletes the bundle's entry."""

FIELDS: Final = (
    "state",
    "dst_broker",
    "source_broker",
    "split_children",
    "force",
    "timestamp_ms",
    "version_id",
    "leader_term",
)
"""The fields of a channel value, in wire order."""


def to_json_object(data: ServiceUnitStateData) -> dict[str, object]:
    """``data`` as the JSON object of the channel: every field present, absent ones None."""
    children = data.split_children
    obj: dict[str, object] = {
        "state": data.state.value,
        "dst_broker": data.dst_broker,
        "source_broker": data.source_broker,
        "split_children": None if children is None else dict(children),
        "force": data.force,
        "timestamp_ms": data.timestamp_ms,
        "version_id": data.version_id,
        "leader_term": data.leader_term,
    }
    if children is not None and len(children) > LISTED_SPLIT_CHILDREN:
        ranges = _as_ranges(children)
        if ranges is not None:
            obj["split_children"] = None
            obj["split_ranges"] = ranges
    return obj


def _as_ranges(children: Mapping[BundleId, BrokerId | None]) -> dict[str, object] | None:
    """The children as ``{"namespace", "lo", "widths", "broker", "brokers"}``: the namespace, the
    lower bound of the first range, the width of each range in order (the next starts where one
    ends), the broker of most children (or null), and the broker (or null) of each other child by
    its index. None when the children are not adjacent ranges of one namespace (a split's always
    are)."""
    try:
        bundles = sorted(parse_bundle_id(child) for child in children)
    except InvalidInputError:
        return None
    namespace = bundles[0].namespace
    widths = []
    for i, bundle in enumerate(bundles):
        if bundle.namespace != namespace or (i and bundle.range.lo != bundles[i - 1].range.hi):
            return None
        widths.append(bundle.range.hi - bundle.range.lo)
    brokers = [children[bundle.id] for bundle in bundles]
    usual = Counter(brokers).most_common(1)[0][0]
    return {
        "namespace": str(namespace),
        "lo": bundles[0].range.lo,
        "widths": widths,
        "broker": usual,
        "brokers": {str(i): broker for i, broker in enumerate(brokers) if broker != usual},
    }


def from_json_object(obj: object) -> ServiceUnitStateData:
    """Read a channel value from its parsed JSON object.

    ``state`` and ``version_id`` are required; ``force`` and ``timestamp_ms`` read null or absent
    as False and 0; a blank broker reads as None; unknown fields are ignored (a newer writer may
    add some). Raises InvalidInputError naming the field that is wrong.
    """
    if not isinstance(obj, dict):
        raise InvalidInputError(f"value must be a JSON object, got {_json_type(obj)}")
    for name in ("state", "version_id"):
        if obj.get(name) is None:
            raise InvalidInputError(f"value is missing required field {name!r}")
    raw_state = obj["state"]
    try:
        state = ServiceUnitState(raw_state)
    except ValueError:
        known = ", ".join(s.value for s in ServiceUnitState)
        raise InvalidInputError(f"unknown state {raw_state!r} (expected one of {known})") from None
    force = obj.get("force")
    timestamp_ms = obj.get("timestamp_ms")
    return ServiceUnitStateData(
        state=state,
        version_id=obj["version_id"],
        dst_broker=_read_broker("dst_broker", obj.get("dst_broker")),
        source_broker=_read_broker("source_broker", obj.get("source_broker")),
        split_children=_read_children(obj.get("split_children"), obj.get("split_ranges")),
        force=False if force is None else force,
        timestamp_ms=0 if timestamp_ms is None else timestamp_ms,
        leader_term=obj.get("leader_term"),
    )


_COMPACT: Final = json.JSONEncoder(separators=(",", ":"))
"""``json.dumps(..., separators=(",", ":"))`` made once: ``dumps`` with any argument builds a
new encoder per call, a third of the cost of encoding a value."""


def encode_value(data: ServiceUnitStateData | None) -> bytes:
    """The channel message value for ``data``; None encodes as the tombstone (empty bytes).

    Raises InvalidInputError when the value would be larger than :data:`MAX_VALUE_BYTES`.
    """
    if data is None:
        return TOMBSTONE
    raw = _COMPACT.encode(to_json_object(data)).encode()
    if len(raw) > MAX_VALUE_BYTES:
        # Every reader would skip it as malformed: refused before it is ever published.
        what = f" ({len(data.split_children)} split children)" if data.split_children else ""
        raise InvalidInputError(
            f"a {data.state.value} value{what} would be {len(raw)} bytes, more than the "
            f"channel's {MAX_VALUE_BYTES}"
        )
    return raw


def decode_value(raw: bytes) -> ServiceUnitStateData | None:
    """Decode a channel message value; the empty value is a tombstone (None).

    Raises InvalidInputError saying what is wrong with a malformed value.
    """
    if not raw:
        return None
    if len(raw) > MAX_VALUE_BYTES:
        raise InvalidInputError(f"value is {len(raw)} bytes, more than {MAX_VALUE_BYTES}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInputError(f"value is not UTF-8 (byte {e.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidInputError(f"value is not JSON: {e}") from None
    return from_json_object(obj)


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _read_broker(name: str, value: object) -> BrokerId | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str):
        raise InvalidInputError(f"{name} must be a string or null, got {_json_type(value)}")
    return BrokerId(value)


def _read_children(value: object, ranges: object = None) -> dict[BundleId, BrokerId | None] | None:
    if ranges is not None:
        if value is not None:
            raise InvalidInputError("split_children and split_ranges are both set; set one")
        return _read_ranges(ranges)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidInputError(
            f"split_children must be an object or null, got {_json_type(value)}"
        )
    return {
        BundleId(child): _read_broker(f"split_children[{child!r}]", broker)
        for child, broker in value.items()
    }


def _read_ranges(value: object) -> dict[BundleId, BrokerId | None]:
    """The children of a ``split_ranges`` object (see :func:`_as_ranges`)."""
    if not isinstance(value, dict):
        raise InvalidInputError(f"split_ranges must be an object, got {_json_type(value)}")
    namespace_text, lo, widths, brokers = (
        value.get(k) for k in ("namespace", "lo", "widths", "brokers")
    )
    if not isinstance(namespace_text, str):
        raise InvalidInputError("split_ranges.namespace must be a string")
    namespace = NamespaceName.parse(namespace_text)
    if not isinstance(widths, list) or not 2 <= len(widths) <= MAX_SPLIT_CHILDREN:
        raise InvalidInputError(
            f"split_ranges.widths must be an array of 2 to {MAX_SPLIT_CHILDREN} widths"
        )
    if not isinstance(brokers, dict):
        raise InvalidInputError("split_ranges.brokers must be an object")
    _check_count("split_ranges.lo", lo)
    assert isinstance(lo, int)
    ids: list[BundleId] = []
    for i, width in enumerate(widths):
        _check_count(f"split_ranges.widths[{i}]", width)
        try:
            ids.append(bundle_id(namespace, lo, lo + width))  # validates the range
        except InvalidInputError as e:
            raise InvalidInputError(f"split_ranges.widths[{i}]: {e}") from None
        lo += width
    usual = _read_broker("split_ranges.broker", value.get("broker"))
    children: dict[BundleId, BrokerId | None] = dict.fromkeys(ids, usual)
    for index, broker in brokers.items():
        if not (isinstance(index, str) and index.isdigit() and int(index) < len(ids)):
            raise InvalidInputError(f"split_ranges.brokers: no child {index!r}")
        children[ids[int(index)]] = _read_broker(f"split_ranges.brokers[{index!r}]", broker)
    return children
