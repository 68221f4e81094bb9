"""Real etcd and pulsar-lite servers started on loopback ports, for tests and local clusters.

:class:`EtcdServer` and :class:`PulsarLiteServer` start, probe, stop, freeze, thaw, kill and
restart one server each, so that tests (and ``lbd dev up``) run against the real systems and can
inject the outages the sidecar must survive.
"""

from lbd.devcluster.ports import free_port, free_ports
from lbd.devcluster.servers import (
    EtcdServer,
    ManagedServer,
    PulsarLiteServer,
    ServerError,
    find_etcd,
    find_pulsar_lite,
)

__all__ = [
    "EtcdServer",
    "ManagedServer",
    "PulsarLiteServer",
    "ServerError",
    "find_etcd",
    "find_pulsar_lite",
    "free_port",
    "free_ports",
]
