"""The session lease on etcd: grant, keepalive and revoke for the shared LeaseSession.

aetcd has no automatic keepalive: :class:`LeaseSession` sends one ``LeaseKeepAlive`` per keepalive
interval through this backend. etcd answers a keepalive of an unknown (expired or revoked) lease
with a TTL of 0, which is how a lost lease is told apart from an unreachable etcd.
"""

from __future__ import annotations

from lbd.adapters.etcd import EtcdConnection


class EtcdLeaseBackend:
    """:class:`~lbd.adapters.session.LeaseBackend` over an :class:`EtcdConnection`."""

    def __init__(self, conn: EtcdConnection) -> None:
        self._conn = conn

    async def grant(self, ttl_s: int) -> int:
        """Grant a lease of ``ttl_s`` seconds."""
        lease = await self._conn.call(lambda c: c.lease(ttl_s), f"grant a {ttl_s}s lease")
        lease_id: int = lease.id
        return lease_id

    async def refresh(self, lease_id: int) -> bool:
        """One keepalive; False when etcd no longer knows the lease."""
        reply = await self._conn.call(
            lambda c: c.refresh_lease(lease_id), f"renew lease {lease_id:x}"
        )
        return reply is not None and reply.TTL > 0

    async def revoke(self, lease_id: int) -> None:
        """Revoke the lease: the keys under it are deleted at once."""
        await self._conn.call(lambda c: c.revoke_lease(lease_id), f"revoke lease {lease_id:x}")
