"""The checks of an ownership request, before anything is written: one home for every caller.

An assignment and a split (on any sidecar) and an admin Transfer or Unload (on the leader) check
the request against the table, the registry, the namespace layout and the maintenance records
here, so a bad request changes nothing and says what is wrong: InvalidInputError (malformed),
NotFoundError (unknown bundle or broker), PreconditionError (the bundle's state, or a cordon,
does not allow it), UnavailableError (the metadata store cannot be reached, for what needs it).
"""

from __future__ import annotations

from lbd.core.bundles import parse_bundle_id
from lbd.core.errors import InvalidInputError, NotFoundError, PreconditionError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, state_of
from lbd.ports.errors import UnavailableError
from lbd.services.channel.follower import ChannelFollower
from lbd.services.cluster.maintenance_view import MaintenanceView
from lbd.services.cluster.namespaces import NamespaceService
from lbd.services.cluster.registry import BrokerRegistry

_S = ServiceUnitState


class RequestChecks:
    """Checks of ownership requests against this sidecar's view of the cluster."""

    def __init__(
        self,
        *,
        follower: ChannelFollower,
        registry: BrokerRegistry,
        namespaces: NamespaceService,
        maintenance: MaintenanceView,
    ) -> None:
        self._follower = follower
        self._registry = registry
        self._namespaces = namespaces
        self._maintenance = maintenance

    async def transfer(self, bundle: BundleId, dst: BrokerId) -> BrokerId:
        """The owner of ``bundle``, if it may be transferred to ``dst`` now."""
        value = await self.known(bundle)
        self.registered(dst)
        owner = self.owner(bundle, value)
        if dst == owner:
            raise PreconditionError(f"bundle {bundle} is already owned by {dst}")
        self._maintenance.refuse_cordoned(dst, f"transfer of {bundle} to {dst}")
        self.reachable(f"transfer {bundle}")
        return owner

    async def unload(self, bundle: BundleId) -> BrokerId:
        """The owner of ``bundle``, if it may be unloaded now."""
        return self.owner(bundle, await self.known(bundle))

    async def known(self, bundle: BundleId) -> ServiceUnitStateData | None:
        """The bundle's value; NotFoundError unless it has one or its namespace layout holds it."""
        parsed = parse_bundle_id(bundle)
        if parsed.id != bundle:
            raise InvalidInputError(f"bundle id {bundle!r} is not canonical; use {parsed.id!r}")
        value = self._follower.get(bundle)
        if value is not None:
            if value.state is _S.Deleted:
                raise NotFoundError(f"bundle {bundle} no longer exists: it was split")
            return value
        record = await self._namespaces.refresh(parsed.namespace)
        try:
            record.bundles().index(parsed.range)
        except NotFoundError:
            raise NotFoundError(
                f"bundle {bundle} is not a bundle of namespace {parsed.namespace}"
            ) from None
        return None

    def registered(self, broker: BrokerId) -> None:
        """NotFoundError unless ``broker`` is registered."""
        if self._registry.get(broker) is None:
            raise NotFoundError(f"broker {broker} is not registered")

    def reachable(self, what: str) -> None:
        """UnavailableError, saying it cannot ``what``, while the metadata store is out of reach."""
        if not self._registry.reachable:
            raise UnavailableError(f"metadata store unreachable (safe mode): cannot {what}")

    def refuse_cordoned(self, broker: BrokerId, what: str) -> None:
        """PreconditionError naming the cordon when ``broker`` takes no new bundles."""
        self._maintenance.refuse_cordoned(broker, what)

    @staticmethod
    def not_in_flight(bundle: BundleId, value: ServiceUnitStateData | None) -> None:
        """PreconditionError while the bundle is moving (or splitting)."""
        if value is not None and value.state.is_in_flight:
            raise PreconditionError(f"bundle {bundle} is in flight ({value.state.value})")

    @staticmethod
    def owner(bundle: BundleId, value: ServiceUnitStateData | None) -> BrokerId:
        """The broker owning ``bundle`` (its value ``value``); PreconditionError unless Owned."""
        RequestChecks.not_in_flight(bundle, value)
        if value is None or value.state is not _S.Owned or value.dst_broker is None:
            raise PreconditionError(f"bundle {bundle} is not owned ({state_of(value).value})")
        return value.dst_broker
