"""Channel values for tests, built one way: :func:`data` is a value, :func:`value` its encoding."""

from collections.abc import Mapping

from lbd.core.ids import BrokerId, BundleId
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, encode_value


def data(
    state: ServiceUnitState,
    version: int = 1,
    *,
    dst: str | None = None,
    src: str | None = None,
    force: bool = False,
    term: int | None = None,
    timestamp_ms: int = 42,
    children: Mapping[BundleId, BrokerId | None] | None = None,
) -> ServiceUnitStateData:
    """The value ``state`` at ``version`` with ``dst``/``src`` brokers (and the other fields)."""
    return ServiceUnitStateData(
        state=state,
        version_id=version,
        dst_broker=None if dst is None else BrokerId(dst),
        source_broker=None if src is None else BrokerId(src),
        split_children=children,
        force=force,
        timestamp_ms=timestamp_ms,
        leader_term=term,
    )


def value(
    state: ServiceUnitState, version: int, dst: str | None = None, src: str | None = None
) -> bytes:
    """The encoded value ``state`` at ``version`` with ``dst``/``src`` brokers."""
    return encode_value(data(state, version, dst=dst, src=src, timestamp_ms=0))
