"""The broker side of the broker contract (docs/broker-contract.md), as a library to copy.

- :class:`BrokerClient` holds the ``BrokerSession``: Hello, the serving lease, the commands
  (carried out by the broker's :class:`BrokerHandler`, acked by the client), load reports, and
  stopping everything when the session ends or the lease runs out.
- :class:`OwnershipCache` answers "who owns this topic (or bundle)" from memory, fed by
  ``WatchOwnership``, within a stated staleness bound; :class:`OwnershipView` is the same without
  the I/O, fed message by message.
- :class:`LookupBatcher` takes lookups one topic at a time and sends them to the sidecar many at
  a time, in ``LookupMany`` calls, each caller getting its own answer or error.

It uses the core, the generated gRPC code and grpc, nothing of the sidecar; the simulated broker
(:mod:`lbd.devcluster.sim_broker`) runs on it.
"""

from lbd.broker.client import BrokerClient, BrokerHandler, NewOwner
from lbd.broker.lookups import LookupBatcher, LookupFailedError
from lbd.broker.ownership import Ownership, OwnershipCache, OwnershipView, StaleOwnershipError

__all__ = [
    "BrokerClient",
    "BrokerHandler",
    "LookupBatcher",
    "LookupFailedError",
    "NewOwner",
    "Ownership",
    "OwnershipCache",
    "OwnershipView",
    "StaleOwnershipError",
]
