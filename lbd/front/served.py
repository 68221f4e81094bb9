"""Which of the bundles this broker was told to own holds a topic.

The broker client (:class:`lbd.broker.BrokerClient`) says whether a bundle may be served now;
this index says which bundle a topic falls in among those the front was given. The two are kept
apart on purpose: the index changes only when the front's handler runs (Own, Release, Close,
stopping everything), while ``may_serve`` also turns false the instant a Release or Close
arrives or the lease runs out, before any handler has run. The front serves a topic only when
both agree.

During a split the front owns the parent and its children at once (the sidecar sends Own for the
children first, then Close for the parent), so a topic may fall in two owned bundles: every one
is returned, and a handle of the parent stays open on the child when the parent is closed.
"""

from __future__ import annotations

from dataclasses import dataclass

from lbd.core.bundles import FULL_UPPER, parse_bundle_id, topic_hash
from lbd.core.ids import BundleId
from lbd.core.names import TopicName


@dataclass(frozen=True, slots=True)
class Topic:
    """A topic name, parsed once: what the index needs to place it."""

    name: str
    namespace: str
    hash: int

    @classmethod
    def parse(cls, text: str) -> Topic:
        """InvalidInputError (saying why) for a name that is not a full topic name."""
        parsed = TopicName.parse(text)
        return cls(str(parsed), str(parsed.namespace), topic_hash(parsed))


@dataclass(frozen=True, slots=True)
class _Span:
    bundle: BundleId
    lo: int
    end: int
    """Exclusive; 2**32 for the last bundle of a namespace (its range includes 0xffffffff)."""


class ServedBundles:
    """The bundles the front was given, by namespace; a few dozen per broker, so a topic is
    placed by a scan of its namespace's bundles."""

    def __init__(self) -> None:
        self._by_namespace: dict[str, list[_Span]] = {}
        self._namespace_of: dict[BundleId, str] = {}

    def __len__(self) -> int:
        return len(self._namespace_of)

    def __contains__(self, bundle: object) -> bool:
        return bundle in self._namespace_of

    def bundles(self) -> list[BundleId]:
        """Every bundle held, sorted."""
        return sorted(self._namespace_of)

    def add(self, bundle: BundleId) -> None:
        """Hold ``bundle`` (idempotent)."""
        if bundle in self._namespace_of:
            return
        parsed = parse_bundle_id(bundle)
        hi = parsed.range.hi
        span = _Span(bundle, parsed.range.lo, hi + 1 if hi == FULL_UPPER else hi)
        namespace = str(parsed.namespace)
        self._by_namespace.setdefault(namespace, []).append(span)
        self._namespace_of[bundle] = namespace

    def remove(self, bundle: BundleId) -> None:
        """Stop holding ``bundle`` (idempotent)."""
        namespace = self._namespace_of.pop(bundle, None)
        if namespace is None:
            return
        spans = [s for s in self._by_namespace[namespace] if s.bundle != bundle]
        if spans:
            self._by_namespace[namespace] = spans
        else:
            del self._by_namespace[namespace]

    def clear(self) -> list[BundleId]:
        """Hold nothing; what was held, sorted."""
        held = self.bundles()
        self._by_namespace.clear()
        self._namespace_of.clear()
        return held

    def containing(self, topic: Topic) -> list[BundleId]:
        """The held bundles whose range holds ``topic`` (two during a split, else at most one)."""
        return [
            s.bundle
            for s in self._by_namespace.get(topic.namespace, ())
            if s.lo <= topic.hash < s.end
        ]

    def holds(self, bundle: BundleId, topic: Topic) -> bool:
        """Whether ``topic`` falls in ``bundle`` (held or not)."""
        parsed = parse_bundle_id(bundle)
        return str(parsed.namespace) == topic.namespace and topic.hash in parsed.range
