"""A broker as the sidecars know it, and the messages of its session with its sidecar.

:class:`BrokerInfo` is the value of ``brokers/<broker_id>`` in the metadata store (JSON). The
rest are the core types of the ``BrokerSession`` stream (DESIGN §5): what a broker sends
(:class:`Hello`, :class:`LoadReport`, :class:`CommandAck`) and what its sidecar sends (a
:class:`SidecarMessage` carrying an :class:`OwnCommand`, :class:`ReleaseCommand` or
:class:`CloseCommand`). The API layer converts protobuf to and from these; the services never
see protobuf.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from lbd.core.bundles import TopicLoad
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerUsage, BundleLoad

_URL_FIELDS = (
    "service_url",
    "service_url_tls",
    "web_service_url",
    "web_service_url_tls",
    "version",
    "sidecar_grpc_addr",
)


@dataclass(frozen=True, slots=True)
class BrokerInfo:
    """What a broker tells about itself; stored under ``brokers/<broker_id>`` as JSON.

    Every field but the id may be empty ("not known"); ``sidecar_grpc_addr`` is filled in by the
    sidecar, which is where admin requests for this broker are forwarded.
    """

    broker_id: BrokerId
    service_url: str = ""
    service_url_tls: str = ""
    web_service_url: str = ""
    version: str = ""
    start_time_ms: int = 0
    sidecar_grpc_addr: str = ""
    web_service_url_tls: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.broker_id, str) or not self.broker_id.strip():
            raise InvalidInputError(
                f"broker info: broker_id must be non-blank, got {self.broker_id!r}"
            )
        if self.broker_id != self.broker_id.strip():
            raise InvalidInputError(
                f"broker info: broker_id {self.broker_id!r} has surrounding spaces"
            )
        for name in _URL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str):
                raise InvalidInputError(f"broker info: {name} must be a string, got {value!r}")
        start = self.start_time_ms
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise InvalidInputError(
                f"broker info: start_time_ms must be an integer >= 0, got {start!r}"
            )

    def to_json(self) -> bytes:
        """The stored JSON value (every field present)."""
        return json.dumps(
            {
                "broker_id": self.broker_id,
                "service_url": self.service_url,
                "service_url_tls": self.service_url_tls,
                "web_service_url": self.web_service_url,
                "web_service_url_tls": self.web_service_url_tls,
                "version": self.version,
                "start_time_ms": self.start_time_ms,
                "sidecar_grpc_addr": self.sidecar_grpc_addr,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> BrokerInfo:
        """Read a stored value; InvalidInputError naming what is wrong.

        ``broker_id`` is required; absent or null text fields read as empty and an absent
        ``start_time_ms`` as 0; unknown fields are ignored (a newer sidecar may add some).
        """
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidInputError(f"broker info is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise InvalidInputError(f"broker info must be a JSON object, got {obj!r}")
        broker = obj.get("broker_id")
        if not isinstance(broker, str):
            raise InvalidInputError(f"broker info: broker_id must be a string, got {broker!r}")
        texts: dict[str, Any] = {}
        for name in _URL_FIELDS:
            value = obj.get(name)
            texts[name] = "" if value is None else value
        start = obj.get("start_time_ms")
        return cls(
            broker_id=BrokerId(broker),
            start_time_ms=0 if start is None else start,
            **texts,
        )


@dataclass(frozen=True, slots=True)
class Hello:
    """The first message of a broker's session: who the broker is, and whether it takes an
    :class:`OwnCommand` of several bundles."""

    info: BrokerInfo
    takes_own_batches: bool = False


class LazyTopics(Mapping[BundleId, tuple[TopicLoad, ...]]):
    """Read-only topic stats per bundle, each bundle's made on first access from what the
    report carried (``convert`` of its raw entry), then kept.

    A broker reports every bundle's busiest topics every interval, while only a split looks at
    them, one bundle at a time: a report of ten thousand bundles is not turned into fifty thousand
    objects nobody reads.
    """

    __slots__ = ("_convert", "_made", "_raw")

    def __init__(
        self, raw: Mapping[BundleId, Any], convert: Callable[[Any], tuple[TopicLoad, ...]]
    ) -> None:
        self._raw = dict(raw)
        self._convert = convert
        self._made: dict[BundleId, tuple[TopicLoad, ...]] = {}

    def __getitem__(self, bundle: BundleId) -> tuple[TopicLoad, ...]:
        made = self._made.get(bundle)
        if made is None:
            made = self._made[bundle] = self._convert(self._raw[bundle])
        return made

    def __iter__(self) -> Iterator[BundleId]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """A broker's load: its resource usage, per-bundle stats and, optionally, per-topic stats.

    ``topics`` maps a bundle to its busiest topics (the input of the topic_count and flow_or_qps
    split algorithms); a bundle without topic stats is absent.
    """

    usage: BrokerUsage = field(default_factory=BrokerUsage)
    bundles: tuple[BundleLoad, ...] = ()
    topics: Mapping[BundleId, tuple[TopicLoad, ...]] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        seen: set[BundleId] = set()
        for load in self.bundles:
            if load.bundle in seen:
                raise InvalidInputError(f"load report: bundle {load.bundle} is reported twice")
            seen.add(load.bundle)
        if not isinstance(self.topics, LazyTopics):  # read-only already
            object.__setattr__(self, "topics", MappingProxyType(dict(self.topics)))

    def bundle(self, bundle: BundleId) -> BundleLoad | None:
        """The stats of one bundle, or None when the report has none."""
        return next((b for b in self.bundles if b.bundle == bundle), None)

    def topics_of(self, bundle: BundleId) -> tuple[TopicLoad, ...]:
        """The topic stats of one bundle (empty when the broker sent none)."""
        return self.topics.get(bundle, ())


@dataclass(frozen=True, slots=True)
class CommandAck:
    """A broker's answer to the command ``command_id``: done (``ok``) or not, and why not.

    For an Own of several bundles, ``failed`` names each bundle not taken, with why; every other
    bundle of it was taken."""

    command_id: int
    ok: bool = True
    error: str = ""
    failed: Mapping[BundleId, str] = field(default_factory=dict)

    def of(self, bundle: BundleId) -> CommandAck:
        """This answer as it concerns ``bundle`` alone (of an Own of several bundles)."""
        if bundle in self.failed:
            return CommandAck(self.command_id, ok=False, error=self.failed[bundle])
        if self.failed:  # the others were taken
            return CommandAck(self.command_id)
        return self


@dataclass(frozen=True, slots=True)
class OwnCommand:
    """Start serving ``bundle``, then each of ``more`` in order (an Own batch, only to a broker
    that said it takes them)."""

    bundle: BundleId
    more: tuple[BundleId, ...] = ()

    @property
    def bundles(self) -> tuple[BundleId, ...]:
        """Every bundle to serve, in order."""
        return (self.bundle, *self.more)


@dataclass(frozen=True, slots=True)
class ReleaseCommand:
    """Stop serving ``bundle``; clients go to ``new_owner`` (None for a plain unload)."""

    bundle: BundleId
    new_owner: BrokerInfo | None = None


@dataclass(frozen=True, slots=True)
class CloseCommand:
    """Stop serving ``bundle`` at once (split parent, reconcile, self-fencing), and why."""

    bundle: BundleId
    reason: str = ""


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    """The broker asks for its serving lease (:mod:`lbd.core.lease`): request ``sequence``
    (increasing within a session), and how often its lease ran out so far in this session."""

    sequence: int
    lapses: int = 0

    def __post_init__(self) -> None:
        if self.sequence < 1 or self.lapses < 0:
            raise InvalidInputError(
                f"lease request: sequence must be >= 1 and lapses >= 0, got {self.sequence} "
                f"and {self.lapses}"
            )


@dataclass(frozen=True, slots=True)
class ServingLease:
    """The sidecar vouches for its broker's ownership for ``duration_ms``, counted from when the
    broker sent request ``sequence``. Not a command: it has no command id and no ack."""

    sequence: int
    duration_ms: int


@dataclass(frozen=True, slots=True)
class Leave:
    """The broker is shutting down gracefully: its bundles should go to other brokers."""

    reason: str = ""


Command = OwnCommand | ReleaseCommand | CloseCommand
"""What a sidecar tells its broker to do."""

BrokerMessage = Hello | LoadReport | CommandAck | LeaseRequest | Leave
"""What a broker sends its sidecar."""


@dataclass(frozen=True, slots=True)
class SidecarMessage:
    """One command to the broker; the broker echoes ``command_id`` in its :class:`CommandAck`."""

    command_id: int
    command: Command | ServingLease
    """A command to ack, or a lease (``command_id`` 0, not acked)."""
