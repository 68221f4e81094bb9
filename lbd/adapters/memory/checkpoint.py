"""An in-memory checkpoint store with the same refusal rule as the etcd one."""

from __future__ import annotations

from lbd.ports.checkpoint import StoredCheckpoint, supersedes
from lbd.ports.errors import UnavailableError


class MemoryCheckpointStore:
    """:class:`~lbd.ports.checkpoint.CheckpointStore` in memory; ``reachable`` simulates outages.

    It survives whatever the test keeps a reference to: hand the same instance to a "restarted"
    sidecar to model a checkpoint that outlives the process.
    """

    def __init__(self) -> None:
        self._stored: StoredCheckpoint | None = None
        self.reachable = True
        self.saves = 0
        """Successful saves so far (tests check how often a leader checkpoints)."""

    async def save(self, checkpoint: StoredCheckpoint) -> bool:
        """Keep ``checkpoint`` unless the stored one is as new or newer."""
        self._check()
        if self._stored is not None and not supersedes(checkpoint, self._stored):
            return False
        self._stored = checkpoint
        self.saves += 1
        return True

    async def load(self) -> StoredCheckpoint | None:
        """The newest checkpoint, or None."""
        self._check()
        return self._stored

    def _check(self) -> None:
        if not self.reachable:
            raise UnavailableError("in-memory checkpoint store: unreachable (simulated)")
