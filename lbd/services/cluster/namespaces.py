"""Namespace records (bundle layout and policies) in the metadata store, cached.

Every change is a compare-and-swap on the record's mod revision, so two sidecars changing one
namespace at once cannot lose each other's change: the loser reads again and retries (a split) or
is told (a create). Reads are cached: a lookup needs the layout of its topic's namespace on every
call, and every assignment needs every record (isolation and anti-affinity span namespaces).

Once started, the service lists the records and follows the store's watch, like the registry: the
cache then holds every record as of the watch's last event, and :meth:`NamespaceService.list`
answers from it without a request to the store; each record is parsed once per change. Before
the start (and after :meth:`close`) it reads the store. A cached layout may lag another sidecar's
split by the watch's delay; callers notice it (the bundle they found is Deleted) and
:meth:`NamespaceService.refresh`. The one thing a lagging layout must never cause, an assignment
of a split parent whose Deleted value was tombstoned, needs a lag longer than
``monitor.tombstone_after_s`` (docs/safety.md).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from lbd.core.bundles import BundleRange
from lbd.core.errors import InvalidInputError, NotFoundError, PreconditionError
from lbd.core.names import NamespaceName
from lbd.core.namespace import NamespacePolicies, NamespaceRecord
from lbd.ports.errors import CasConflictError
from lbd.ports.metadata import MetadataStore, NamespaceEvent
from lbd.tasks import Component, Tasks

_log = logging.getLogger(__name__)

_Change = Callable[[NamespaceRecord], NamespaceRecord | None]
"""A record change: the new record, or None when there is nothing to change."""

CAS_ATTEMPTS = 10
"""Read-modify-write attempts of one change before giving up (each loses only to a real change)."""


class NamespaceService(Component):
    """Reads and changes namespace records; caches what it read or wrote."""

    def __init__(self, metadata: MetadataStore, default_bundles: int = 4) -> None:
        if default_bundles < 1:
            raise InvalidInputError(f"default_bundles must be >= 1, got {default_bundles}")
        self._metadata = metadata
        self._default_bundles = default_bundles
        self._cache: dict[NamespaceName, tuple[NamespaceRecord, int]] = {}
        self._tasks = Tasks("the namespace service")

    async def start(self) -> None:
        """List every record and start following the store's watch (UnavailableError when the
        store cannot be reached). Idempotent."""
        if self._tasks:
            return
        found, revision = await self._metadata.list_namespaces()
        self._cache.clear()
        for name, versioned in found.items():
            self._note(name, versioned.value, versioned.mod_revision)
        self._tasks.spawn(self._follow(revision), name="namespace-records")

    async def close(self) -> None:
        """Stop following the watch (reads go to the store again). Idempotent."""
        await self._tasks.close()

    async def _follow(self, revision: int) -> None:
        async for event in self._metadata.watch_namespaces(revision):
            self._apply(event)

    def _apply(self, event: NamespaceEvent) -> None:
        if event.value is None:
            with contextlib.suppress(InvalidInputError):
                self._cache.pop(NamespaceName.parse(event.namespace), None)
            return
        self._note(event.namespace, event.value, event.revision)

    def _note(self, name: str, raw: bytes, revision: int) -> NamespaceRecord | None:
        """Cache the record read as ``name`` at ``revision`` unless the cache has a newer one;
        None (logged) when it is unreadable."""
        try:
            ns = NamespaceName.parse(name)
        except InvalidInputError as e:
            _log.warning("ignoring the namespace record stored as %r: %s", name, e)
            return None
        cached = self._cache.get(ns)
        if cached is not None and cached[1] >= revision:
            return cached[0]  # known already (this sidecar wrote it, or read it since)
        try:
            record = NamespaceRecord.from_json(raw)
        except InvalidInputError as e:
            _log.warning("ignoring the unreadable record of namespace %s: %s", name, e)
            return None
        self._keep(ns, record, revision)
        return record

    def _keep(self, ns: NamespaceName, record: NamespaceRecord, revision: int) -> None:
        """Cache ``record`` as of ``revision`` unless the watch brought a newer one meanwhile."""
        cached = self._cache.get(ns)
        if cached is None or cached[1] <= revision:
            self._cache[ns] = (record, revision)

    @property
    def default_bundles(self) -> int:
        """Bundles of a namespace created without a count."""
        return self._default_bundles

    def cached(self, ns: NamespaceName) -> NamespaceRecord | None:
        """The cached record, without asking the store (None when not cached)."""
        entry = self._cache.get(ns)
        return None if entry is None else entry[0]

    async def get(self, ns: NamespaceName) -> NamespaceRecord:
        """The record of ``ns`` (cached); NotFoundError when the namespace does not exist."""
        entry = self._cache.get(ns)
        if entry is not None:
            return entry[0]
        return await self.refresh(ns)

    async def refresh(self, ns: NamespaceName) -> NamespaceRecord:
        """The record of ``ns`` as stored now; NotFoundError when it does not exist."""
        record, _ = await self._read(ns)
        return record

    async def create(
        self,
        ns: NamespaceName,
        bundles: int | None = None,
        policies: NamespacePolicies | None = None,
    ) -> NamespaceRecord:
        """Create ``ns`` with ``bundles`` equal bundles (default: the service's default).

        Raises PreconditionError when it exists, InvalidInputError for a bad count or policies.
        """
        record = NamespaceRecord.create(ns, bundles or self._default_bundles, policies)
        try:
            revision = await self._metadata.put_namespace(str(ns), record.to_json().encode(), 0)
        except CasConflictError:
            raise PreconditionError(f"namespace {ns} already exists") from None
        self._keep(ns, record, revision)
        _log.info("created namespace %s with %d bundles", ns, len(record.bundles()))
        return record

    async def ensure(self, ns: NamespaceName, bundles: int | None = None) -> NamespaceRecord:
        """The record of ``ns``, created with ``bundles`` bundles when it does not exist."""
        try:
            return await self.refresh(ns)
        except NotFoundError:
            pass
        try:
            return await self.create(ns, bundles)
        except PreconditionError:
            return await self.refresh(ns)  # created by another sidecar meanwhile

    async def set_policies(self, ns: NamespaceName, policies: NamespacePolicies) -> NamespaceRecord:
        """Replace the policies of ``ns`` (NotFoundError; InvalidInputError when the layout
        already has more bundles than the new ``max_bundles``)."""

        def change(record: NamespaceRecord) -> NamespaceRecord:
            count = len(record.bundles())
            if policies.max_bundles is not None and count > policies.max_bundles:
                raise InvalidInputError(
                    f"namespace {ns}: max_bundles {policies.max_bundles} is below its current "
                    f"{count} bundles"
                )
            return NamespaceRecord(record.name, record.boundaries, policies)

        return await self._swap(ns, change, "set policies of")

    async def split(self, ns: NamespaceName, parent: BundleRange, at: list[int]) -> NamespaceRecord:
        """Cut ``parent`` at the points ``at`` in the layout of ``ns`` (CAS, retried).

        Idempotent: when the layout already holds exactly that cut, it is returned unchanged.
        NotFoundError when ``parent`` is neither in the layout nor already cut that way;
        InvalidInputError for points not strictly inside it.
        """
        wanted = (parent.lo, *sorted(set(at)), parent.hi)

        def change(record: NamespaceRecord) -> NamespaceRecord | None:
            layout = record.bundles()
            if _holds(record.boundaries, wanted):
                return None
            return NamespaceRecord(
                record.name, layout.split(parent, at).boundaries, record.policies
            )

        return await self._swap(ns, change, f"split {parent} of")

    async def list(self, *, fresh: bool = False) -> list[NamespaceRecord]:
        """Every namespace record, sorted by name: from the watched cache once started (unless
        ``fresh``), else read from the store (and cached)."""
        if not self._tasks or fresh:
            found, _ = await self._metadata.list_namespaces()
            records = (self._note(n, v.value, v.mod_revision) for n, v in found.items())
            return sorted((r for r in records if r is not None), key=lambda r: r.name)
        return sorted((record for record, _ in self._cache.values()), key=lambda r: r.name)

    async def _read(self, ns: NamespaceName) -> tuple[NamespaceRecord, int]:
        versioned = await self._metadata.get_namespace(str(ns))
        if versioned is None:
            self._cache.pop(ns, None)
            raise NotFoundError(f"namespace {ns} does not exist")
        try:
            record = NamespaceRecord.from_json(versioned.value)
        except InvalidInputError as e:
            raise InvalidInputError(
                f"the stored record of namespace {ns} is unreadable: {e}"
            ) from e
        self._keep(ns, record, versioned.mod_revision)
        return record, versioned.mod_revision

    async def _swap(self, ns: NamespaceName, change: _Change, what: str) -> NamespaceRecord:
        for _ in range(CAS_ATTEMPTS):
            record, revision = await self._read(ns)
            new = change(record)
            if new is None:
                return record
            try:
                new_revision = await self._metadata.put_namespace(
                    str(ns), new.to_json().encode(), revision
                )
            except CasConflictError:
                _log.info("%s namespace %s: lost a compare-and-swap, retrying", what, ns)
                continue
            self._keep(ns, new, new_revision)
            _log.info("%s namespace %s: done", what, ns)
            return new
        raise PreconditionError(
            f"could not {what} namespace {ns}: it kept changing ({CAS_ATTEMPTS} attempts)"
        )


def _holds(boundaries: tuple[int, ...], cut: tuple[int, ...]) -> bool:
    """Whether ``cut`` (a run of consecutive boundaries) appears in ``boundaries``."""
    try:
        i = boundaries.index(cut[0])
    except ValueError:
        return False
    return boundaries[i : i + len(cut)] == cut
