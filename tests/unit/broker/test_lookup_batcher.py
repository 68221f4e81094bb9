"""The broker library's LookupBatcher: per-topic lookups carried by LookupMany calls, each caller
answered as its own Lookup would be, against a real sidecar's API and a stub that fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from lbd.broker import LookupBatcher, LookupFailedError
from lbd.core.errors import InvalidInputError
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from tests.unit.api.served import Api, serve_api, until
from tests.unit.services.harness import Harness

TOPICS = [f"persistent://public/default/t{i}" for i in range(60)]


class CountingStub:
    """A LoadBalancer stub that records each LookupMany call's size and the calls out at once."""

    def __init__(self, stub: lbd_pb2_grpc.LoadBalancerStub) -> None:
        self._stub = stub
        self.sizes: list[int] = []
        self.out = 0
        self.most_out = 0

    async def LookupMany(
        self, request: lbd_pb2.LookupManyRequest, **kwargs: Any
    ) -> lbd_pb2.LookupManyResponse:
        self.sizes.append(len(request.lookups))
        self.out += 1
        self.most_out = max(self.most_out, self.out)
        try:
            response: lbd_pb2.LookupManyResponse = await self._stub.LookupMany(request, **kwargs)
            return response
        finally:
            self.out -= 1


@pytest.fixture
async def api() -> AsyncIterator[Api]:
    async with Harness() as h:
        sidecar = await h.add("broker-a")
        await h.ready()
        async with serve_api(h, sidecar) as served:
            await until(lambda: served.elector.is_leader)
            yield served


async def test_lookups_of_one_turn_travel_together_and_each_caller_gets_its_answer(
    api: Api,
) -> None:
    stub = CountingStub(api.lb)
    async with LookupBatcher(stub, max_per_call=16, calls_in_flight=2) as batcher:  # type: ignore[arg-type]
        answers = await asyncio.gather(*(batcher.lookup(t) for t in TOPICS))
    assert sum(stub.sizes) == len(TOPICS)
    assert max(stub.sizes) == 16 and len(stub.sizes) == batcher.calls_made < len(TOPICS)
    assert stub.most_out == 2
    for topic, answer in zip(TOPICS, answers, strict=True):
        alone = await api.lb.Lookup(lbd_pb2.LookupRequest(topic=topic), timeout=5)
        assert answer == alone, topic
        assert answer.owner_broker_id == "broker-a"


async def test_a_lone_lookup_leaves_at_once_in_a_call_of_one(api: Api) -> None:
    stub = CountingStub(api.lb)
    async with LookupBatcher(stub) as batcher:  # type: ignore[arg-type]
        first = await batcher.lookup(TOPICS[0])
        second = await batcher.lookup(TOPICS[0], read_only=True)
    assert stub.sizes == [1, 1]
    assert first == second and first.state == lbd_pb2.BUNDLE_STATE_OWNED


async def test_a_failing_lookup_fails_only_its_caller_with_its_own_status(api: Api) -> None:
    async with LookupBatcher(api.lb) as batcher:
        good, bad, missing = await asyncio.gather(
            batcher.lookup(TOPICS[0]),
            batcher.lookup("public/default/no-domain"),
            batcher.lookup("persistent://nobody/here/t"),
            return_exceptions=True,
        )
    assert isinstance(good, lbd_pb2.LookupResponse) and good.owner_broker_id == "broker-a"
    assert isinstance(bad, LookupFailedError) and bad.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "public/default/no-domain" in str(bad)
    assert isinstance(missing, LookupFailedError) and missing.code is grpc.StatusCode.NOT_FOUND
    assert "nobody/here" in missing.details


class FailingStub:
    """Every LookupMany fails as a whole with UNAVAILABLE, after ``calls`` calls answered."""

    def __init__(self) -> None:
        self.calls = 0

    async def LookupMany(self, request: lbd_pb2.LookupManyRequest, **kwargs: Any) -> Any:
        self.calls += 1
        await asyncio.sleep(0)
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details="failed to connect to all addresses",
        )


async def test_a_call_that_fails_as_a_whole_fails_each_of_its_lookups_with_its_status() -> None:
    stub = FailingStub()
    async with LookupBatcher(stub, max_per_call=4) as batcher:  # type: ignore[arg-type]
        outcomes = await asyncio.gather(
            *(batcher.lookup(t) for t in TOPICS[:10]), return_exceptions=True
        )
    assert stub.calls == 3  # 4 + 4 + 2
    for outcome in outcomes:
        assert isinstance(outcome, LookupFailedError)
        assert outcome.code is grpc.StatusCode.UNAVAILABLE
        assert "failed to connect" in str(outcome)


async def test_a_caller_that_gives_up_leaves_the_others_answered(api: Api) -> None:
    stub = CountingStub(api.lb)
    async with LookupBatcher(stub) as batcher:  # type: ignore[arg-type]
        given_up = asyncio.ensure_future(batcher.lookup(TOPICS[1]))
        kept = asyncio.ensure_future(batcher.lookup(TOPICS[2]))
        await asyncio.sleep(0)
        given_up.cancel()
        answer = await kept
    assert answer.owner_broker_id == "broker-a"
    assert given_up.cancelled()


async def test_closing_cancels_what_waits_and_refuses_more() -> None:
    never = asyncio.Event()

    class HangingStub:
        async def LookupMany(self, request: Any, **kwargs: Any) -> Any:
            await never.wait()

    batcher = LookupBatcher(HangingStub(), calls_in_flight=1)  # type: ignore[arg-type]
    out = asyncio.ensure_future(batcher.lookup(TOPICS[0]))
    await asyncio.sleep(0.01)
    waiting = asyncio.ensure_future(batcher.lookup(TOPICS[1]))
    await asyncio.sleep(0.01)
    await batcher.close()
    await batcher.close()
    with pytest.raises(asyncio.CancelledError):
        await out
    with pytest.raises(asyncio.CancelledError):
        await waiting
    with pytest.raises(RuntimeError, match="closed"):
        await batcher.lookup(TOPICS[2])


def test_bad_settings_are_refused_naming_the_setting() -> None:
    for kwargs, name in (
        ({"max_per_call": 0}, "max_per_call"),
        ({"calls_in_flight": 0}, "calls_in_flight"),
        ({"timeout_s": 0.0}, "timeout_s"),
    ):
        with pytest.raises(InvalidInputError, match=name):
            LookupBatcher(None, **kwargs)  # type: ignore[arg-type]
