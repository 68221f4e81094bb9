"""Channel values for tests: one encoded state-channel value per call."""

from lbd.core.ids import BrokerId
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, encode_value


def value(
    state: ServiceUnitState, version: int, dst: str | None = None, src: str | None = None
) -> bytes:
    """The encoded value ``state`` at ``version`` with ``dst``/``src`` brokers."""
    return encode_value(
        ServiceUnitStateData(
            state=state,
            version_id=version,
            dst_broker=None if dst is None else BrokerId(dst),
            source_broker=None if src is None else BrokerId(src),
        )
    )
