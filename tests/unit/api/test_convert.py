"""Protobuf <-> core conversions: every field crosses, bad input names its proto field."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest

from lbd.api import convert
from lbd.core.broker_info import (
    BrokerInfo,
    CloseCommand,
    CommandAck,
    Hello,
    LoadReport,
    OwnCommand,
    ReleaseCommand,
    SidecarMessage,
)
from lbd.core.bundles import TopicLoad
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData
from lbd.core.namespace import IsolationPolicy, NamespacePolicies
from lbd.core.shedding import DecisionReason, SheddingResult, SkipReason, UnloadDecision
from lbd.core.state import ServiceUnitState, ServiceUnitStateData
from lbd.gen.v1 import lbd_pb2
from lbd.services.sidecar.lookup import LookupResult

BUNDLE = BundleId("public/default/0x00000000_0x40000000")
INFO = BrokerInfo(
    broker_id=BrokerId("b1"),
    service_url="pulsar://h:6650",
    service_url_tls="pulsar+ssl://h:6651",
    web_service_url="http://h:8080",
    version="4.0",
    start_time_ms=123,
    sidecar_grpc_addr="h:7000",
)


def test_every_state_has_its_own_proto_value() -> None:
    values = {convert.state_to_proto(s) for s in ServiceUnitState}
    assert len(values) == len(ServiceUnitState)
    assert lbd_pb2.BUNDLE_STATE_UNSPECIFIED not in values
    assert convert.state_to_proto(ServiceUnitState.Owned) == lbd_pb2.BUNDLE_STATE_OWNED


def test_broker_info_round_trips() -> None:
    assert convert.broker_info_from_proto(convert.broker_info_to_proto(INFO)) == INFO


def test_hello_without_broker_id_is_rejected() -> None:
    message = lbd_pb2.BrokerMessage(hello=lbd_pb2.BrokerInfo(service_url="pulsar://h:1"))
    with pytest.raises(InvalidInputError, match=r"hello\.broker_id"):
        convert.broker_message_from_proto(message)


def test_empty_broker_message_is_rejected() -> None:
    with pytest.raises(InvalidInputError, match="hello, load, ack, lease_request or leave"):
        convert.broker_message_from_proto(lbd_pb2.BrokerMessage())


def test_broker_messages_convert_by_kind() -> None:
    hello = convert.broker_message_from_proto(
        lbd_pb2.BrokerMessage(hello=convert.broker_info_to_proto(INFO))
    )
    ack = convert.broker_message_from_proto(
        lbd_pb2.BrokerMessage(ack=lbd_pb2.CommandAck(command_id=7, ok=False, error="busy"))
    )
    assert hello == Hello(INFO)
    assert ack == CommandAck(command_id=7, ok=False, error="busy")


def test_load_report_sums_bundles_and_keeps_topics() -> None:
    report = lbd_pb2.LoadReport(
        cpu=lbd_pb2.ResourceUsage(usage=50, limit=100),
        memory=lbd_pb2.ResourceUsage(usage=1024, limit=4096),
        bundles=[
            lbd_pb2.BundleStats(
                bundle=BUNDLE,
                msg_rate_in=10,
                msg_rate_out=20,
                msg_throughput_in=1000,
                msg_throughput_out=2000,
                topics=3,
                producer_count=1,
                consumer_count=2,
                topic_stats=[
                    lbd_pb2.TopicStats(
                        topic="persistent://public/default/t", msg_rate=30, msg_throughput=3000
                    )
                ],
            ),
            lbd_pb2.BundleStats(
                bundle="public/default/0x40000000_0x80000000", msg_throughput_in=500, topics=1
            ),
        ],
    )
    core = convert.broker_message_from_proto(lbd_pb2.BrokerMessage(load=report))
    assert isinstance(core, LoadReport)
    assert core.usage.cpu.percent() == 50
    assert core.usage.msg_throughput_in == 1500
    assert core.usage.msg_rate_out == 20
    assert core.usage.bundle_count == 2 and core.usage.topics == 4
    first = core.bundle(BUNDLE)
    assert first is not None and first.sessions == 3 and first.msg_throughput == 3000
    assert core.topics_of(BUNDLE) == (TopicLoad("persistent://public/default/t", 30, 3000),)
    assert core.topics_of(BundleId("public/default/0x40000000_0x80000000")) == ()


def test_a_load_report_s_topic_stats_are_checked_at_once_and_made_when_asked() -> None:
    stats = lbd_pb2.TopicStats(topic="persistent://public/default/t", msg_rate=5)
    report = lbd_pb2.LoadReport(
        bundles=[lbd_pb2.BundleStats(bundle=BUNDLE, topics=1, topic_stats=[stats])]
    )
    core = convert.load_report_from_proto(report)
    assert dict(core.topics) == {BUNDLE: (TopicLoad("persistent://public/default/t", 5, 0),)}
    assert core.topics_of(BUNDLE) is core.topics_of(BUNDLE)  # made once
    stats.msg_throughput = -1
    bad = lbd_pb2.LoadReport(
        bundles=[lbd_pb2.BundleStats(bundle=BUNDLE, topics=1, topic_stats=[stats])]
    )
    with pytest.raises(InvalidInputError, match="msg_rate and msg_throughput must be >= 0"):
        convert.load_report_from_proto(bad)


async def test_a_broker_s_stream_converts_a_large_report_a_slice_at_a_time() -> None:
    # A report of a broker with thousands of bundles must not hold up the sidecar's lookups:
    # the event loop runs between slices, and the report is the one converted at once.
    count = 3 * convert.LOAD_SLICE
    stats = [
        lbd_pb2.BundleStats(
            bundle=f"public/big/0x{i:08x}_0x{i + 1:08x}",
            msg_rate_in=i,
            topics=1,
            topic_stats=[lbd_pb2.TopicStats(topic=f"persistent://public/big/t{i}", msg_rate=i)],
        )
        for i in range(count)
    ]
    report = lbd_pb2.LoadReport(bundles=stats)
    hello = lbd_pb2.BrokerMessage(hello=lbd_pb2.BrokerInfo(broker_id="b1"))

    async def stream(*messages: lbd_pb2.BrokerMessage) -> AsyncIterator[lbd_pb2.BrokerMessage]:
        for message in messages:
            yield message

    turns = 0
    done = False

    async def count_turns() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    counting = asyncio.ensure_future(count_turns())
    await asyncio.sleep(0)
    converted = [
        m
        async for m in convert.broker_messages_from_proto(
            stream(hello, lbd_pb2.BrokerMessage(load=report))
        )
    ]
    done = True
    await counting
    assert turns >= 3
    assert isinstance(converted[0], Hello)
    assert converted[1] == convert.load_report_from_proto(report)
    stats[-1].topic_stats[0].msg_rate = -1  # in the last slice: the report is refused still
    bad = lbd_pb2.BrokerMessage(load=lbd_pb2.LoadReport(bundles=stats))
    with pytest.raises(InvalidInputError, match="msg_rate and msg_throughput must be >= 0"):
        [m async for m in convert.broker_messages_from_proto(stream(bad))]


def test_load_report_with_a_bad_bundle_names_the_field() -> None:
    report = lbd_pb2.LoadReport(bundles=[lbd_pb2.BundleStats(bundle="nope")])
    with pytest.raises(InvalidInputError, match="invalid bundle id 'nope'"):
        convert.load_report_from_proto(report)


def test_negative_usage_is_rejected() -> None:
    report = lbd_pb2.LoadReport(cpu=lbd_pb2.ResourceUsage(usage=-1, limit=100))
    with pytest.raises(InvalidInputError, match=r"load\.cpu"):
        convert.load_report_from_proto(report)


def test_commands_convert_to_proto() -> None:
    own = convert.sidecar_message_to_proto(SidecarMessage(1, OwnCommand(BUNDLE)))
    release = convert.sidecar_message_to_proto(SidecarMessage(2, ReleaseCommand(BUNDLE, INFO)))
    unload = convert.sidecar_message_to_proto(SidecarMessage(3, ReleaseCommand(BUNDLE)))
    close = convert.sidecar_message_to_proto(SidecarMessage(4, CloseCommand(BUNDLE, "split")))
    assert own.command_id == 1 and own.own.bundle == BUNDLE
    assert release.release.new_owner_broker_id == "b1"
    assert release.release.new_owner.service_url_tls == "pulsar+ssl://h:6651"
    assert unload.WhichOneof("kind") == "release" and not unload.release.HasField("new_owner")
    assert close.close.reason == "split"


def test_an_own_batch_and_its_ack_convert_both_ways() -> None:
    other = BundleId("public/default/0x40000000_0x80000000")
    batch = convert.sidecar_message_to_proto(SidecarMessage(5, OwnCommand(BUNDLE, (other,))))
    assert (batch.own.bundle, list(batch.own.more_bundles)) == (BUNDLE, [other])
    ack = lbd_pb2.CommandAck(command_id=5, ok=False, error="1 not taken")
    ack.failed.add(bundle=other, error="full")
    got = convert.broker_message_from_proto(lbd_pb2.BrokerMessage(ack=ack))
    assert got == CommandAck(5, ok=False, error="1 not taken", failed={other: "full"})
    assert got.of(BUNDLE) == CommandAck(5) and got.of(other) == CommandAck(5, False, "full")
    hello = lbd_pb2.BrokerInfo(broker_id="b1", takes_own_batches=True)
    said = convert.broker_message_from_proto(lbd_pb2.BrokerMessage(hello=hello))
    assert isinstance(said, Hello) and said.takes_own_batches


def test_an_ack_that_is_ok_yet_names_bundles_not_taken_is_refused() -> None:
    ack = lbd_pb2.CommandAck(command_id=5, ok=True)
    ack.failed.add(bundle=BUNDLE, error="full")
    with pytest.raises(InvalidInputError, match="ok is true but failed"):
        convert.broker_message_from_proto(lbd_pb2.BrokerMessage(ack=ack))


def test_bundle_info_of_init_and_of_a_value() -> None:
    init = convert.bundle_info(BUNDLE, None)
    owned = convert.bundle_info(
        BUNDLE,
        ServiceUnitStateData(
            state=ServiceUnitState.Releasing,
            version_id=4,
            dst_broker=BrokerId("b2"),
            source_broker=BrokerId("b1"),
        ),
    )
    assert init.state == lbd_pb2.BUNDLE_STATE_INIT and init.owner_broker_id == ""
    assert (owned.state, owned.owner_broker_id, owned.source_broker_id, owned.version_id) == (
        lbd_pb2.BUNDLE_STATE_RELEASING,
        "b2",
        "b1",
        4,
    )
    assert convert.ownership_change(BUNDLE, None).state == lbd_pb2.BUNDLE_STATE_INIT


def test_bundle_ids_are_canonical_and_required() -> None:
    assert convert.bundle_id("public/default/0X00000000_0X40000000") == BUNDLE
    with pytest.raises(InvalidInputError, match="bundle is required"):
        convert.bundle_id("")
    with pytest.raises(InvalidInputError, match="dst_broker_id is required"):
        convert.broker_id("  ", "dst_broker_id")


def test_policies_keep_presence_of_optional_numbers() -> None:
    unset = convert.policies_from_proto(lbd_pb2.NamespacePolicies(isolation_primary=["b.*"]))
    zero = convert.policies_from_proto(
        lbd_pb2.NamespacePolicies(
            isolation_primary=["b.*"],
            isolation_min_primaries=0,
            anti_affinity_group="g",
            max_bundles=8,
        )
    )
    assert unset == NamespacePolicies(isolation=IsolationPolicy(primary=("b.*",)))
    assert zero.isolation is not None and zero.isolation.min_available_primaries == 0
    assert (zero.anti_affinity_group, zero.max_bundles) == ("g", 8)
    assert convert.policies_from_proto(lbd_pb2.NamespacePolicies()) == NamespacePolicies()


def test_secondary_isolation_without_primary_is_rejected() -> None:
    with pytest.raises(InvalidInputError, match="need isolation_primary"):
        convert.policies_from_proto(lbd_pb2.NamespacePolicies(isolation_secondary=["x"]))


def test_bad_policies_are_invalid_input() -> None:
    with pytest.raises(InvalidInputError, match="max_bundles"):
        convert.policies_from_proto(lbd_pb2.NamespacePolicies(max_bundles=0))


def test_load_response_is_sorted_by_broker() -> None:
    loads = [
        BrokerLoadData(BrokerId("b2"), weighted_max_ema=0.5, updated_at_ms=2),
        BrokerLoadData(BrokerId("b1"), weighted_max_ema=0.25, msg_throughput_ema=10.0),
    ]
    response = convert.load_response(loads, 0.375, 0.125)
    assert [b.broker_id for b in response.brokers] == ["b1", "b2"]
    assert response.brokers[0].msg_throughput == 10.0 and response.brokers[1].updated_at_ms == 2
    assert (response.avg, response.std) == (0.375, 0.125)


def test_rebalance_response_of_decisions_and_of_a_skip() -> None:
    moved = convert.rebalance_response(
        SheddingResult(
            decisions=(UnloadDecision(BUNDLE, BrokerId("b1"), None, DecisionReason.OVERLOADED),),
            skip_reason=None,
            avg=0.5,
            std=0.3,
        )
    )
    skipped = convert.rebalance_response(
        SheddingResult(decisions=(), skip_reason=SkipReason.HIT_COUNT, avg=0.1, std=0.0)
    )
    assert [(d.bundle, d.src_broker_id, d.dst_broker_id, d.reason) for d in moved.decisions] == [
        (BUNDLE, "b1", "", "Overloaded")
    ]
    assert moved.skip_reason == "" and skipped.skip_reason == "HitCount"


def test_lookup_responses_are_made_once_per_bundle_and_owner_registration() -> None:
    responses = convert.LookupResponses()
    owned = LookupResult(BUNDLE, ServiceUnitState.Owned, INFO, INFO.broker_id)
    first = responses.of(owned)
    assert first == convert.lookup_response(owned)
    # The same state, owner and registration object: the very same message.
    assert responses.of(LookupResult(BUNDLE, ServiceUnitState.Owned, INFO, INFO.broker_id)) is first
    # A new registration of the owner (an equal one too), another owner, another state, an
    # owner no longer registered: each a new answer, equal to what conversion makes.
    moved = dataclasses.replace(INFO, service_url="pulsar://elsewhere:6650")
    other = dataclasses.replace(INFO, broker_id=BrokerId("b2"))
    for result in (
        LookupResult(BUNDLE, ServiceUnitState.Owned, moved, INFO.broker_id),
        LookupResult(BUNDLE, ServiceUnitState.Owned, dataclasses.replace(moved), INFO.broker_id),
        LookupResult(BUNDLE, ServiceUnitState.Owned, other, other.broker_id),
        LookupResult(BUNDLE, ServiceUnitState.Owned, None, other.broker_id),
        LookupResult(BUNDLE, ServiceUnitState.Free),
    ):
        answer = responses.of(result)
        assert answer is not first
        assert answer == convert.lookup_response(result), result
        first = answer


def test_lookup_responses_keep_a_bounded_number_of_bundles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(convert, "LOOKUP_RESPONSES_KEPT", 3)
    responses = convert.LookupResponses()
    results = [
        LookupResult(
            BundleId(f"public/default/0x0000000{i}_0x0000000{i + 1}"), ServiceUnitState.Free
        )
        for i in range(4)
    ]
    made = [responses.of(r) for r in results]
    assert len(responses._kept) == 1  # emptied at the bound, then the fourth kept
    assert responses.of(results[3]) is made[3]
    assert responses.of(results[0]) is not made[0]
    assert responses.of(results[0]) == made[0]
