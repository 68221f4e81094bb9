"""History rows built from the core's types: one function per table of :mod:`lbd.history.schema`.

Used by the live sink and by ``lbd analytics synth``, so both write exactly the same columns.
"""

from __future__ import annotations

from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BundleLoad
from lbd.history.parquet import Row
from lbd.history.schema import SCHEMA_VERSION, DecisionKind


def common(ts_ms: int, cluster: str, recorder: str) -> dict[str, object]:
    """The columns every table starts with."""
    return {
        "schema_version": SCHEMA_VERSION,
        "ts_ms": ts_ms,
        "cluster": cluster,
        "recorder": recorder,
    }


def broker_load_row(data: BrokerLoadData, head: dict[str, object]) -> Row:
    """A ``broker_load`` row of one load report; ``head`` from :func:`common`."""
    u = data.usage
    return {
        **head,
        "broker": data.broker,
        "load": data.weighted_max_ema,
        "max_usage": data.max_resource_usage,
        "cpu_pct": u.cpu.percent(),
        "memory_pct": u.memory.percent(),
        "direct_memory_pct": u.direct_memory.percent(),
        "bandwidth_in_pct": u.bandwidth_in.percent(),
        "bandwidth_out_pct": u.bandwidth_out.percent(),
        "msg_throughput_in": u.msg_throughput_in,
        "msg_throughput_out": u.msg_throughput_out,
        "msg_throughput_ema": data.msg_throughput_ema,
        "msg_rate_in": u.msg_rate_in,
        "msg_rate_out": u.msg_rate_out,
        "bundle_count": u.bundle_count,
        "topics": u.topics,
    }


def bundle_load_row(broker: BrokerId, b: BundleLoad, head: dict[str, object]) -> Row:
    """A ``bundle_load`` row of one bundle ``broker`` reported."""
    return {
        **head,
        "broker": broker,
        "bundle": b.bundle,
        "msg_throughput_in": b.msg_throughput_in,
        "msg_throughput_out": b.msg_throughput_out,
        "msg_rate_in": b.msg_rate_in,
        "msg_rate_out": b.msg_rate_out,
        "topics": b.topics,
        "sessions": b.sessions,
    }


def decision_row(
    head: dict[str, object],
    kind: DecisionKind,
    bundle: BundleId,
    *,
    reason: str,
    src: BrokerId | None = None,
    dst: BrokerId | None = None,
    strategy: str | None = None,
    cluster_avg: float | None = None,
    cluster_std: float | None = None,
    src_load: float | None = None,
    dst_load: float | None = None,
    bundle_throughput: float | None = None,
) -> Row:
    """A ``decisions`` row."""
    return {
        **head,
        "kind": str(kind),
        "bundle": bundle,
        "src": src,
        "dst": dst,
        "reason": reason,
        "strategy": strategy,
        "cluster_avg": cluster_avg,
        "cluster_std": cluster_std,
        "src_load": src_load,
        "dst_load": dst_load,
        "bundle_throughput": bundle_throughput,
    }
