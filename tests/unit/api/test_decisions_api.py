"""``Admin/ListDecisions`` over gRPC: the leader answers from its decision log, any other sidecar
forwards the call to it."""

from __future__ import annotations

import grpc
import pytest

from lbd.core.ids import BrokerId, BundleId
from lbd.gen.v1 import lbd_pb2
from tests.unit.api.served import Api, serve_api, until
from tests.unit.services.harness import Harness

BUNDLE = BundleId("public/default/0x00000000_0x40000000")
OTHER = BundleId("public/default/0x40000000_0x80000000")


def record_three(api: Api) -> list[int]:
    """Three decisions on the leader's log, a second apart; their times."""
    log = api.sidecar.services.decisions
    clock = api.sidecar.services.clock
    times = []
    for kind, bundle, src, dst, reason, source, op in (
        ("transfer", BUNDLE, "broker-a", "broker-b", "Overloaded", "shedder", "op-1"),
        ("orphan", OTHER, "broker-c", None, "orphan: broker-c away 61s", "monitor", None),
        ("unload", BUNDLE, "broker-b", None, "Admin", "admin", "op-2"),
    ):
        decision = log.record(
            kind,
            bundle,
            reason=reason,
            source=source,
            src=BrokerId(src),
            dst=None if dst is None else BrokerId(dst),
            operation_id=op,
        )
        times.append(decision.at_ms)
        clock.advance(1.0)
    return times


async def test_the_leader_lists_its_decisions_oldest_first_with_every_field(api: Api) -> None:
    before = len(
        (await api.admin.ListDecisions(lbd_pb2.ListDecisionsRequest(), timeout=5)).decisions
    )
    times = record_three(api)
    reply = await api.admin.ListDecisions(lbd_pb2.ListDecisionsRequest(), timeout=5)
    mine = list(reply.decisions)[before:]
    assert mine[0] == lbd_pb2.Decision(
        at_ms=times[0],
        kind="transfer",
        bundle=BUNDLE,
        src_broker_id="broker-a",
        dst_broker_id="broker-b",
        reason="Overloaded",
        source="shedder",
        operation_id="op-1",
    )
    assert (mine[1].kind, mine[1].dst_broker_id, mine[1].operation_id) == ("orphan", "", "")
    assert [d.at_ms for d in mine] == times


async def test_since_and_limit_select_the_newest(api: Api) -> None:
    times = record_three(api)
    since = await api.admin.ListDecisions(
        lbd_pb2.ListDecisionsRequest(since_ms=times[1]), timeout=5
    )
    assert [d.kind for d in since.decisions] == ["orphan", "unload"]
    newest = await api.admin.ListDecisions(lbd_pb2.ListDecisionsRequest(limit=1), timeout=5)
    assert [d.kind for d in newest.decisions] == ["unload"]


@pytest.mark.parametrize(
    "request_", [lbd_pb2.ListDecisionsRequest(limit=-1), lbd_pb2.ListDecisionsRequest(since_ms=-5)]
)
async def test_negative_since_or_limit_is_invalid(
    api: Api, request_: lbd_pb2.ListDecisionsRequest
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.admin.ListDecisions(request_, timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "must be >= 0" in (caught.value.details() or "")


async def test_a_follower_forwards_to_the_leader(harness: Harness) -> None:
    a = await harness.add("broker-a")
    b = await harness.add("broker-b")
    await harness.ready()
    async with serve_api(harness, a) as api_a, serve_api(harness, b) as api_b:
        await until(lambda: api_a.elector.is_leader or api_b.elector.is_leader)
        leader, follower = (api_a, api_b) if api_a.elector.is_leader else (api_b, api_a)
        await until(lambda: follower.elector.leader is not None)
        await until(
            lambda: (
                all(
                    i.sidecar_grpc_addr.startswith("127.0.0.1:")
                    for i in follower.sidecar.registry.brokers().values()
                )
                and len(follower.sidecar.registry.brokers()) == 2
            )
        )
        times = record_three(leader)
        # The follower's own log holds nothing of the leader's: the answer comes from the leader.
        follower.sidecar.services.decisions.record("split", OTHER, reason="x", source="admin")
        reply = await follower.admin.ListDecisions(
            lbd_pb2.ListDecisionsRequest(since_ms=times[0]), timeout=5
        )
        assert [d.kind for d in reply.decisions] == ["transfer", "orphan", "unload"]
