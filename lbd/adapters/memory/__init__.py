"""In-memory twins of the adapters: deterministic, clock-driven, with failure injection.

They implement the same ports and pass the same contract suites (``tests/contract``) as the real
adapters; unit tests and the simulator use them instead of servers.
"""

from lbd.adapters.memory.checkpoint import MemoryCheckpointStore
from lbd.adapters.memory.metadata import MemoryMetadataCluster, MemoryMetadataStore

__all__ = ["MemoryCheckpointStore", "MemoryMetadataCluster", "MemoryMetadataStore"]
