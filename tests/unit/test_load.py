"""Broker load: the max resource usage (memory left out), the weighted max and its EMA, as
Pulsar's BrokerLoadDataTest has them."""

import pytest

from lbd.core.ids import BrokerId
from lbd.core.load import (
    BrokerLoadData,
    BrokerUsage,
    ResourceUsage,
    ResourceWeights,
    max_resource_usage,
    weighted_max_usage,
)

HALF = ResourceWeights(cpu=0.5, memory=0.5, direct_memory=0.5, bandwidth_in=0.5, bandwidth_out=0.5)


def test_pulsar_update_by_system_resource_usage() -> None:
    """BrokerLoadDataTest.testUpdateBySystemResourceUsage: weights of 0.5 and a history of 0.75;
    the max usage skips memory, the weighted max does not."""
    first = BrokerUsage(
        cpu=ResourceUsage(1.0, 100.0),
        memory=ResourceUsage(800.0, 200.0),
        direct_memory=ResourceUsage(2.0, 100.0),
        bandwidth_in=ResourceUsage(3.0, 100.0),
        bandwidth_out=ResourceUsage(4.0, 100.0),
        msg_throughput_in=1,
        msg_throughput_out=2,
        msg_rate_in=3,
        msg_rate_out=4,
        bundle_count=5,
    )
    data = BrokerLoadData(BrokerId("b")).update(first, HALF, 1000, history=0.75)
    assert data.usage == first
    assert data.max_resource_usage == pytest.approx(0.04)  # memory's 400% left out
    assert data.weighted_max_ema == pytest.approx(2.0)  # 400% * 0.5, the first sample as is
    assert data.updated_at_ms == 1000

    second = BrokerUsage(
        cpu=ResourceUsage(300.0, 100.0),
        memory=ResourceUsage(200.0, 200.0),
        direct_memory=ResourceUsage(2.0, 100.0),
        bandwidth_in=ResourceUsage(3.0, 100.0),
        bandwidth_out=ResourceUsage(4.0, 100.0),
        msg_throughput_in=5,
        msg_throughput_out=6,
        msg_rate_in=7,
        msg_rate_out=8,
        bundle_count=9,
    )
    data = data.update(second, HALF, 2000, history=0.75)
    assert data.usage == second
    assert data.max_resource_usage == pytest.approx(3.0)
    assert data.weighted_max_ema == pytest.approx(1.875)  # 2.0 * 0.75 + 1.5 * 0.25
    assert (data.updated_at_ms, data.reported_at_ms) == (2000, 0)


def test_max_resource_usage_leaves_memory_out() -> None:
    usage = BrokerUsage(cpu=ResourceUsage(10, 100), memory=ResourceUsage(95, 100))
    assert max_resource_usage(usage) == pytest.approx(0.10)
    assert weighted_max_usage(usage, ResourceWeights()) == pytest.approx(0.95)


def test_the_default_history_is_pulsars() -> None:
    busy = BrokerUsage(cpu=ResourceUsage(100, 100), msg_throughput_in=1000)
    idle = BrokerUsage(cpu=ResourceUsage(0, 100))
    data = BrokerLoadData(BrokerId("b")).update(busy, ResourceWeights(), 1)
    data = data.update(idle, ResourceWeights(), 2)
    assert data.weighted_max_ema == pytest.approx(0.9)
    assert data.msg_throughput_ema == pytest.approx(900.0)
