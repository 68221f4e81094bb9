"""The scenario file of ``lbd shed`` and ``lbd ctl snapshot`` (DESIGN §7), to and from JSON.

A scenario is a load snapshot plus the shedding config, the time of the snapshot and how many
cycles to run over it::

    {"config": {shedding keys}, "now_ms": int, "cycles": int (default 1),
     "brokers": {id: {"max_ema": float, "msg_throughput_ema": float, "updated_at_ms": int} | null},
     "top_bundles": {broker_id: [{"bundle": id, "msg_throughput_in": float,
                                  "msg_throughput_out": float}]},
     "owners": {bundle: broker_id}, "recently_unloaded_bundles": {bundle: ms},
     "recently_unloaded_brokers": {broker_id: ms},
     "allowed_destinations": {bundle: [broker_id, ...]}}

``now_ms`` and ``brokers`` are required, the rest optional. A broker given as ``null`` is
registered but has not reported load yet. Every broker of ``top_bundles`` must be listed in
``brokers``; ``owners`` and ``recently_unloaded_brokers`` may name brokers that have left.
``allowed_destinations`` holds the placement rules the leader evaluated (a listed bundle may move
only to those brokers).
:func:`parse_scenario` takes the already-decoded JSON value and reports the first problem with its
path, e.g. ``brokers["b1"].max_ema: expected a number, got "x"``.
"""

from __future__ import annotations

import json
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BundleLoad
from lbd.core.settings import SheddingConfig
from lbd.core.shedding.model import LoadSnapshot

_TOP_LEVEL_REQUIRED = ("now_ms", "brokers")
_TOP_LEVEL_OPTIONAL = (
    "config",
    "cycles",
    "top_bundles",
    "owners",
    "recently_unloaded_bundles",
    "recently_unloaded_brokers",
    "allowed_destinations",
)
_BROKER_KEYS = ("max_ema", "msg_throughput_ema", "updated_at_ms")
_BUNDLE_KEYS = ("bundle", "msg_throughput_in", "msg_throughput_out")

_K = TypeVar("_K", bound=str)


@dataclass(frozen=True, slots=True)
class Scenario:
    """A load snapshot and how to run the shedder over it."""

    snapshot: LoadSnapshot
    now_ms: int
    """The leader's clock when the snapshot was taken (epoch milliseconds)."""
    config: SheddingConfig = field(default_factory=SheddingConfig)
    cycles: int = 1
    """How many shedder cycles to run over the snapshot, carrying the shedder's state."""


def parse_scenario(doc: object) -> Scenario:
    """Validate a decoded scenario JSON document; raise InvalidInputError naming the bad path."""
    root = _object(doc, "scenario")
    _check_keys(root, "scenario", _TOP_LEVEL_REQUIRED, _TOP_LEVEL_OPTIONAL)
    brokers = _parse_brokers(root["brokers"])
    snapshot = LoadSnapshot(
        brokers=brokers,
        top_bundles=_parse_top_bundles(root.get("top_bundles", {}), brokers),
        owners=_parse_owners(root.get("owners", {})),
        recently_unloaded_bundles=_timestamps(root, "recently_unloaded_bundles", BundleId),
        recently_unloaded_brokers=_timestamps(root, "recently_unloaded_brokers", BrokerId),
        allowed_destinations=_parse_destinations(root.get("allowed_destinations", {})),
    )
    return Scenario(
        snapshot=snapshot,
        now_ms=_integer(root["now_ms"], "now_ms", minimum=0),
        config=_parse_config(root.get("config", {})),
        cycles=_integer(root.get("cycles", 1), "cycles", minimum=1),
    )


def scenario_to_json(scenario: Scenario) -> dict[str, object]:
    """The JSON value of ``scenario`` (keys sorted, every config key written), which
    :func:`parse_scenario` reads back."""
    snap = scenario.snapshot
    return {
        "config": {name: getattr(scenario.config, name) for name in SheddingConfig.field_names()},
        "now_ms": scenario.now_ms,
        "cycles": scenario.cycles,
        "brokers": {
            broker: None
            if data is None
            else {
                "max_ema": data.weighted_max_ema,
                "msg_throughput_ema": data.msg_throughput_ema,
                "updated_at_ms": data.updated_at_ms,
            }
            for broker, data in sorted(snap.brokers.items())
        },
        "top_bundles": {
            broker: [
                {
                    "bundle": b.bundle,
                    "msg_throughput_in": b.msg_throughput_in,
                    "msg_throughput_out": b.msg_throughput_out,
                }
                for b in bundles
            ]
            for broker, bundles in sorted(snap.top_bundles.items())
        },
        "owners": dict(sorted(snap.owners.items())),
        "recently_unloaded_bundles": dict(sorted(snap.recently_unloaded_bundles.items())),
        "recently_unloaded_brokers": dict(sorted(snap.recently_unloaded_brokers.items())),
        "allowed_destinations": {
            bundle: sorted(brokers) for bundle, brokers in sorted(snap.allowed_destinations.items())
        },
    }


# -- sections ----------------------------------------------------------------------------------


def _parse_config(value: object) -> SheddingConfig:
    obj = _object(value, "config")
    accepted = SheddingConfig.field_names()
    for key in obj:
        if key not in accepted:
            raise InvalidInputError(
                f"config: unknown key {json.dumps(key)}; accepted keys: {', '.join(accepted)}"
            )
    hints = typing.get_type_hints(SheddingConfig)
    readers: dict[type, Callable[[object, str], object]] = {
        bool: _bool,
        int: _integer,
        float: _number,
    }
    kwargs = {key: readers[hints[key]](v, f"config.{key}") for key, v in obj.items()}
    try:
        return SheddingConfig(**kwargs)  # type: ignore[arg-type]
    except InvalidInputError as e:
        raise InvalidInputError(f"config: {e}") from None


def _parse_brokers(value: object) -> dict[BrokerId, BrokerLoadData | None]:
    brokers: dict[BrokerId, BrokerLoadData | None] = {}
    for key, entry in _object(value, "brokers").items():
        path = _at("brokers", key)
        _nonempty_key(key, path)
        if entry is None:
            brokers[BrokerId(key)] = None
            continue
        obj = _object(entry, path)
        _check_keys(obj, path, _BROKER_KEYS, ())
        brokers[BrokerId(key)] = BrokerLoadData(
            broker=BrokerId(key),
            weighted_max_ema=_number(obj["max_ema"], f"{path}.max_ema", minimum=0),
            msg_throughput_ema=_number(
                obj["msg_throughput_ema"], f"{path}.msg_throughput_ema", minimum=0
            ),
            updated_at_ms=_integer(obj["updated_at_ms"], f"{path}.updated_at_ms", minimum=0),
        )
    return brokers


def _parse_top_bundles(
    value: object, brokers: Mapping[BrokerId, object]
) -> dict[BrokerId, tuple[BundleLoad, ...]]:
    out: dict[BrokerId, tuple[BundleLoad, ...]] = {}
    for key, entries in _object(value, "top_bundles").items():
        path = _at("top_bundles", key)
        if key not in brokers:
            raise InvalidInputError(f"{path}: unknown broker {json.dumps(key)} (not in brokers)")
        if not isinstance(entries, list):
            _fail(path, "an array", entries)
        loads: list[BundleLoad] = []
        seen: set[str] = set()
        for i, entry in enumerate(entries):
            item_path = f"{path}[{i}]"
            obj = _object(entry, item_path)
            _check_keys(obj, item_path, _BUNDLE_KEYS, ())
            bundle = _string(obj["bundle"], f"{item_path}.bundle")
            if bundle in seen:
                raise InvalidInputError(f"{item_path}.bundle: {json.dumps(bundle)} listed twice")
            seen.add(bundle)
            loads.append(
                BundleLoad(
                    bundle=BundleId(bundle),
                    msg_throughput_in=_number(
                        obj["msg_throughput_in"], f"{item_path}.msg_throughput_in", minimum=0
                    ),
                    msg_throughput_out=_number(
                        obj["msg_throughput_out"], f"{item_path}.msg_throughput_out", minimum=0
                    ),
                )
            )
        out[BrokerId(key)] = tuple(loads)
    return out


def _parse_owners(value: object) -> dict[BundleId, BrokerId]:
    owners: dict[BundleId, BrokerId] = {}
    for key, owner in _object(value, "owners").items():
        path = _at("owners", key)
        _nonempty_key(key, path)
        owners[BundleId(key)] = BrokerId(_string(owner, path))
    return owners


def _parse_destinations(value: object) -> dict[BundleId, frozenset[BrokerId]]:
    out: dict[BundleId, frozenset[BrokerId]] = {}
    for key, brokers in _object(value, "allowed_destinations").items():
        path = _at("allowed_destinations", key)
        _nonempty_key(key, path)
        if not isinstance(brokers, list):
            _fail(path, "an array of broker ids", brokers)
        out[BundleId(key)] = frozenset(
            BrokerId(_string(b, f"{path}[{i}]")) for i, b in enumerate(brokers)
        )
    return out


def _timestamps(
    root: Mapping[str, object], name: str, key_type: Callable[[str], _K]
) -> dict[_K, int]:
    out: dict[_K, int] = {}
    for key, value in _object(root.get(name, {}), name).items():
        path = _at(name, key)
        _nonempty_key(key, path)
        out[key_type(key)] = _integer(value, path, minimum=0)
    return out


# -- primitives --------------------------------------------------------------------------------


def _at(path: str, key: str) -> str:
    return f"{path}[{json.dumps(key)}]"


def _describe(value: object) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _fail(path: str, expected: str, value: object) -> NoReturn:
    raise InvalidInputError(f"{path}: expected {expected}, got {_describe(value)}")


def _check_keys(
    obj: Mapping[str, object], path: str, required: tuple[str, ...], optional: tuple[str, ...]
) -> None:
    for key in obj:
        if key not in required and key not in optional:
            accepted = ", ".join(required + optional)
            raise InvalidInputError(
                f"{path}: unknown key {json.dumps(key)}; accepted keys: {accepted}"
            )
    for key in required:
        if key not in obj:
            raise InvalidInputError(f"{path}: missing key {json.dumps(key)}")


def _nonempty_key(key: str, path: str) -> None:
    if not key:
        raise InvalidInputError(f"{path}: an id must not be empty")


def _object(value: object, path: str) -> dict[str, object]:
    if not isinstance(value, dict):
        _fail(path, "an object", value)
    return value


def _string(value: object, path: str) -> str:
    if not isinstance(value, str) or not value:
        _fail(path, "a non-empty string", value)
    return value


def _bool(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        _fail(path, "true or false", value)
    return value


def _number(value: object, path: str, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        _fail(path, "a number", value)
    if minimum is not None and value < minimum:
        raise InvalidInputError(f"{path}: must be >= {minimum:g}, got {_describe(value)}")
    return float(value)


def _integer(value: object, path: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(path, "an integer", value)
    if minimum is not None and value < minimum:
        raise InvalidInputError(f"{path}: must be >= {minimum}, got {value}")
    return value
