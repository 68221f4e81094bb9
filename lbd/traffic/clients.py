"""Producers and consumers of the official Pulsar client, driven at a steady rate, recorded.

:class:`ClientTraffic` opens one producer (``send_async``, the client's defaults: a 30 s send
timeout, no batching) and ``consumers_per_topic`` consumers (a message listener that
acknowledges each message) per topic, through one ``pulsar.Client`` whose service URL may name
several brokers. A driver thread sends each topic's messages at its rate; the client's own
threads report receipts and deliveries into a :class:`~lbd.traffic.records.TrafficRecord`.

Used by ``lbd load`` (``lbd dev up --traffic``), the end-to-end suite with real clients and the
``clients`` benchmark. It runs in its caller's process: the Pulsar client's threads are its own.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulsar

from lbd.core.errors import InvalidInputError
from lbd.core.names import TopicName
from lbd.traffic.records import TrafficRecord, payload

_log = logging.getLogger(__name__)

_LOG_LEVELS = {
    "error": pulsar.LoggerLevel.Error,
    "warn": pulsar.LoggerLevel.Warn,
    "info": pulsar.LoggerLevel.Info,
}

SUBSCRIPTION_TYPES = {
    "exclusive": pulsar.ConsumerType.Exclusive,
    "failover": pulsar.ConsumerType.Failover,
    "shared": pulsar.ConsumerType.Shared,
    "key_shared": pulsar.ConsumerType.KeyShared,
}


@dataclass(frozen=True, slots=True)
class ClientTls:
    """TLS to the brokers: the CA they chain to, and the client's certificate (mutual TLS)."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None


@dataclass(frozen=True, slots=True)
class TrafficSpec:
    """What to produce and consume."""

    service_url: str
    topics: tuple[str, ...]
    rate: float = 20.0
    """Messages per second per topic (before the hot topics' factor)."""
    size: int = 256
    """Bytes per message."""
    subscription: str = "lbd-load"
    subscription_type: str = "failover"
    consumers_per_topic: int = 1
    hot_fraction: float = 0.0
    """Share of the topics that get ``hot_factor`` times the rate."""
    hot_factor: float = 5.0
    seed: int = 0
    tls: ClientTls | None = None
    token: str | None = None
    """A bearer token the client authenticates with (an http:// service URL's lookups)."""
    send_timeout_ms: int = 30_000
    """The client's default: a send not receipted within this fails."""
    log_level: str = "error"
    """The client's own log: "error", "warn" or "info"."""
    log_file: str | None = None
    """Where the client's own log goes; standard output when unset."""
    operation_timeout_s: int = 30

    def __post_init__(self) -> None:
        if not self.topics:
            raise InvalidInputError("traffic needs at least one topic")
        for topic in self.topics:
            TopicName.parse(topic)
        if self.rate <= 0:
            raise InvalidInputError(f"rate must be > 0 messages/s, got {self.rate}")
        if not 16 <= self.size <= 5 * 1024 * 1024:
            raise InvalidInputError(f"size must be 16 bytes to 5 MiB, got {self.size}")
        if self.subscription_type not in SUBSCRIPTION_TYPES:
            raise InvalidInputError(
                f"subscription type must be one of {', '.join(SUBSCRIPTION_TYPES)}, got "
                f"{self.subscription_type!r}"
            )
        if self.consumers_per_topic < 0:
            raise InvalidInputError("consumers per topic must be >= 0")
        if not 0 <= self.hot_fraction <= 1:
            raise InvalidInputError(f"hot fraction must be in [0, 1], got {self.hot_fraction}")

    def rates(self) -> list[float]:
        """Each topic's rate: a seeded ``hot_fraction`` of them get ``hot_factor`` times."""
        hot = round(self.hot_fraction * len(self.topics))
        chosen = set(random.Random(self.seed).sample(range(len(self.topics)), hot))
        return [
            self.rate * (self.hot_factor if i in chosen else 1.0) for i in range(len(self.topics))
        ]


def topics_for(namespaces: Sequence[str], count: int, prefix: str = "load") -> tuple[str, ...]:
    """``count`` topic names spread round-robin over ``namespaces``."""
    if count < 1:
        raise InvalidInputError(f"topic count must be >= 1, got {count}")
    return tuple(
        f"persistent://{namespaces[i % len(namespaces)]}/{prefix}-{i}" for i in range(count)
    )


class ClientTraffic:
    """Runs a :class:`TrafficSpec` until :meth:`stop`; the record is :attr:`record`."""

    def __init__(self, spec: TrafficSpec, record: TrafficRecord | None = None) -> None:
        self.spec = spec
        self.record = record if record is not None else TrafficRecord()
        self._client: Any = None
        self._producers: list[tuple[int, Any, float]] = []
        self._consumers: list[Any] = []
        self._stop = threading.Event()
        self._driver: threading.Thread | None = None
        self.errors: list[str] = []
        """Errors of the driver (a send call that raised)."""

    def start(self) -> None:
        """Create the client, the consumers, then the producers; start sending."""
        spec = self.spec
        kwargs: dict[str, Any] = {
            "operation_timeout_seconds": spec.operation_timeout_s,
            # The client's own log, native and errors only: through Python's logging it would
            # hand every debug line to the interpreter, and cost more than the traffic.
            "logger": (
                pulsar.FileLogger(_LOG_LEVELS[spec.log_level], spec.log_file)
                if spec.log_file
                else pulsar.ConsoleLogger(_LOG_LEVELS[spec.log_level])
            ),
        }
        if spec.tls is not None:
            kwargs["tls_trust_certs_file_path"] = spec.tls.ca_file
            if spec.tls.cert_file and spec.tls.key_file and spec.token:
                # The certificate for TLS, the token to authenticate (an HTTP lookup's).
                kwargs["tls_certificate_file_path"] = spec.tls.cert_file
                kwargs["tls_private_key_file_path"] = spec.tls.key_file
            elif spec.tls.cert_file and spec.tls.key_file:
                kwargs["authentication"] = pulsar.AuthenticationTLS(
                    spec.tls.cert_file, spec.tls.key_file
                )
        if spec.token:
            kwargs["authentication"] = pulsar.AuthenticationToken(spec.token)
        self._client = pulsar.Client(spec.service_url, **kwargs)
        kind = SUBSCRIPTION_TYPES[spec.subscription_type]
        for topic in spec.topics:
            for _ in range(spec.consumers_per_topic):
                index = self.record.add_consumer(topic)
                self._consumers.append(
                    self._client.subscribe(
                        topic,
                        spec.subscription,
                        consumer_type=kind,
                        initial_position=pulsar.InitialPosition.Earliest,
                        message_listener=self._listener(index),
                    )
                )
        for topic, rate in zip(spec.topics, spec.rates(), strict=True):
            producer = self._client.create_producer(
                topic, batching_enabled=False, send_timeout_millis=spec.send_timeout_ms
            )
            self._producers.append((self.record.add_producer(topic), producer, rate))
        self._driver = threading.Thread(target=self._drive, name="lbd-traffic", daemon=True)
        self._driver.start()

    def stop(self, drain_s: float = 10.0) -> None:
        """Stop sending, wait (at most ``drain_s``) for pending sends and for consumers to
        receive what was acknowledged, then close everything."""
        self._stop.set()
        if self._driver is not None:
            self._driver.join()
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline and not self._settled():
            time.sleep(0.05)
        if self._client is not None:
            self._client.close()

    def _settled(self) -> bool:
        acked: set[tuple[int, int]] = set()
        for p, producer in enumerate(self.record.producers):
            for seq, send in enumerate(list(producer.sends)):
                if send.ended_ns is None:
                    return False
                if send.error is None:
                    acked.add((p, seq))
        if not self._consumers:
            return True
        received = {(d.producer, d.seq) for d in list(self.record.deliveries)}
        return acked <= received

    def _listener(self, index: int) -> Any:
        record = self.record

        def on_message(consumer: Any, message: Any) -> None:
            record.delivered(
                index,
                message.data(),
                time.monotonic_ns(),
                message.redelivery_count(),
                str(message.message_id()),
            )
            consumer.acknowledge(message)

        return on_message

    def _drive(self) -> None:
        """Send each producer's messages on its schedule until stopped."""
        size = self.spec.size
        start = time.monotonic()
        due = [
            start + random.Random(i).random() / rate
            for i, (_, _, rate) in enumerate(self._producers)
        ]
        while not self._stop.is_set():
            now = time.monotonic()
            for i, (index, producer, rate) in enumerate(self._producers):
                while due[i] <= now:
                    self._send(index, producer, size)
                    due[i] += 1.0 / rate
            self._stop.wait(max(min(due) - time.monotonic(), 0.0005))

    def _send(self, index: int, producer: Any, size: int) -> None:
        record = self.record
        seq = len(record.producers[index].sends)
        send = record.sent(index, time.monotonic_ns())

        def done(result: Any, message_id: Any) -> None:
            send.ended_ns = time.monotonic_ns()
            if result != pulsar.Result.Ok:
                send.error = str(result)
            else:
                send.message_id = str(message_id)

        try:
            producer.send_async(payload(index, seq, size), done)
        except Exception as e:  # the client refuses at once: a full queue, a closed producer
            send.ended_ns = time.monotonic_ns()
            send.error = type(e).__name__
