"""JSON codecs of BrokerInfo and the load-topic values; the session's core types."""

import pytest

from lbd.core.broker_info import BrokerInfo, LoadReport
from lbd.core.bundles import TopicLoad
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import (
    BrokerLoadData,
    BrokerUsage,
    BundleLoad,
    ResourceUsage,
    ResourceWeights,
    TopBundlesLoadData,
)

INFO = BrokerInfo(
    BrokerId("broker-1"),
    service_url="pulsar://h:6650",
    service_url_tls="pulsar+ssl://h:6651",
    web_service_url="http://h:8080",
    web_service_url_tls="https://h:8443",
    version="3.3.0",
    start_time_ms=1_700_000_000_000,
    sidecar_grpc_addr="h:7000",
)
B = BundleId("public/default/0x00000000_0x40000000")


def test_broker_info_round_trips_through_json() -> None:
    assert BrokerInfo.from_json(INFO.to_json()) == INFO
    assert BrokerInfo.from_json('{"broker_id": "b", "extra": 1}') == BrokerInfo(BrokerId("b"))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{", "broker info is not valid JSON"),
        (b"[]", "must be a JSON object"),
        (b"{}", "broker_id must be a string, got None"),
        (b'{"broker_id": " "}', "broker_id must be non-blank"),
        (b'{"broker_id": "b", "service_url": 5}', "service_url must be a string, got 5"),
        (b'{"broker_id": "b", "start_time_ms": -1}', "start_time_ms must be an integer >= 0"),
        (b'{"broker_id": "b", "start_time_ms": true}', "start_time_ms must be an integer >= 0"),
        (b"\xff", "not valid JSON"),
    ],
)
def test_bad_broker_info_is_rejected_with_the_reason(raw: bytes, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        BrokerInfo.from_json(raw)


def test_broker_load_data_round_trips_through_json() -> None:
    usage = BrokerUsage(
        cpu=ResourceUsage(50, 100),
        memory=ResourceUsage(1024, 4096),
        bandwidth_out=ResourceUsage(10, 1000),
        msg_throughput_in=1e6,
        msg_rate_out=300.5,
        bundle_count=4,
        topics=17,
    )
    data = BrokerLoadData(BrokerId("b1"), reported_at_ms=5).update(usage, ResourceWeights(), 99)
    assert BrokerLoadData.from_json(data.to_json()) == data
    assert BrokerLoadData.from_json(b'{"broker": "b"}') == BrokerLoadData(BrokerId("b"))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"nope", "broker load data is not valid JSON"),
        (b'{"usage": {}}', "broker must be a non-blank string"),
        (b'{"broker": "b", "weighted_max_ema": "high"}', "weighted_max_ema must be a number"),
        (b'{"broker": "b", "usage": {"cpu": 3}}', r"usage.cpu must be a JSON object"),
        (b'{"broker": "b", "usage": {"topics": -2}}', r"usage: topics must be an integer >= 0"),
        (b'{"broker": "b", "updated_at_ms": 1.5}', "updated_at_ms must be an integer"),
    ],
)
def test_bad_broker_load_data_is_rejected_with_the_reason(raw: bytes, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        BrokerLoadData.from_json(raw)


def test_top_bundles_round_trip_and_reject_bad_entries() -> None:
    data = TopBundlesLoadData(
        BrokerId("b1"),
        (BundleLoad(B, msg_throughput_in=10.5, msg_rate_out=2, topics=3, producer_count=1),),
    )
    assert TopBundlesLoadData.from_json(data.to_json()) == data
    with pytest.raises(InvalidInputError, match=r"bundles\[0\]: bundle must be a non-blank"):
        TopBundlesLoadData.from_json(b'{"broker": "b", "bundles": [{}]}')
    with pytest.raises(InvalidInputError, match="bundles must be a list"):
        TopBundlesLoadData.from_json(b'{"broker": "b", "bundles": {}}')


def test_a_load_report_holds_each_bundle_once_and_its_topics() -> None:
    report = LoadReport(bundles=(BundleLoad(B),), topics={B: (TopicLoad("persistent://p/d/t"),)})
    assert report.bundle(B) == BundleLoad(B)
    assert report.topics_of(B) == (TopicLoad("persistent://p/d/t"),)
    assert report.topics_of(BundleId("x/y/0x00000000_0xffffffff")) == ()
    with pytest.raises(InvalidInputError, match="reported twice"):
        LoadReport(bundles=(BundleLoad(B), BundleLoad(B)))
