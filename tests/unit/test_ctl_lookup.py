"""``lbd ctl lookup``: one topic by Lookup, several by one LookupMany (a row per topic, in order,
a failed one saying why and making the exit status 1), against a scripted LoadBalancer server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from lbd.cli.main import main
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc

BUNDLE = "public/default/0x00000000_0x40000000"
GOOD = "persistent://public/default/orders"
BAD = "persistent://public/default/"


class ScriptedLoadBalancer(lbd_pb2_grpc.LoadBalancerServicer):
    """Owned by broker-1 for any good topic; INVALID_ARGUMENT for a topic ending in '/'."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @staticmethod
    def _answer(request: lbd_pb2.LookupRequest) -> lbd_pb2.LookupResponse:
        return lbd_pb2.LookupResponse(
            bundle=BUNDLE,
            state=lbd_pb2.BUNDLE_STATE_INIT if request.read_only else lbd_pb2.BUNDLE_STATE_OWNED,
            owner_broker_id="" if request.read_only else "broker-1",
            owner=None if request.read_only else lbd_pb2.OwnerUrls(service_url="pulsar://b1:6650"),
        )

    def Lookup(self, request, context):  # type: ignore[no-untyped-def]
        self.calls.append("Lookup")
        return self._answer(request)

    def LookupMany(self, request, context):  # type: ignore[no-untyped-def]
        self.calls.append(f"LookupMany of {len(request.lookups)}")
        results = []
        for lookup in request.lookups:
            if lookup.topic.endswith("/"):
                failure = lbd_pb2.LookupFailure(
                    code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                    message=f"invalid topic name {lookup.topic!r}: [no name]",
                )
                results.append(lbd_pb2.LookupResult(failure=failure))
            else:
                results.append(lbd_pb2.LookupResult(answer=self._answer(lookup)))
        return lbd_pb2.LookupManyResponse(results=results)


@pytest.fixture
def lb() -> Iterator[tuple[ScriptedLoadBalancer, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = ScriptedLoadBalancer()
    lbd_pb2_grpc.add_LoadBalancerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def test_one_topic_is_one_lookup(
    lb: tuple[ScriptedLoadBalancer, str], capsys: pytest.CaptureFixture[str]
) -> None:
    servicer, addr = lb
    assert main(["ctl", "--server", addr, "lookup", GOOD]) == 0
    assert servicer.calls == ["Lookup"]
    out = capsys.readouterr().out
    assert BUNDLE in out and "pulsar://b1:6650" in out


def test_several_topics_are_one_lookup_many_a_row_each_and_a_failure_fails_the_command(
    lb: tuple[ScriptedLoadBalancer, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    servicer, addr = lb
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: no cell is wrapped
    other = "persistent://public/default/payments"
    assert main(["ctl", "--server", addr, "lookup", GOOD, BAD, other]) == 1
    assert servicer.calls == ["LookupMany of 3"]
    rows = [line for line in capsys.readouterr().out.splitlines() if "persistent://" in line]
    assert [GOOD in rows[0], BAD in rows[1], other in rows[2]] == [True, True, True]
    assert "broker-1" in rows[0] and "broker-1" in rows[2]
    # The message is printed as it is, brackets and all (not read as terminal markup).
    assert "INVALID_ARGUMENT: invalid topic name" in rows[1] and "[no name]" in rows[1]


def test_several_topics_all_answered_exit_zero_and_print_json(
    lb: tuple[ScriptedLoadBalancer, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, addr = lb
    other = "persistent://public/default/payments"
    code = main(["ctl", "--server", addr, "--output", "json", "lookup", "--read-only", GOOD, other])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert [r["answer"]["state"] for r in printed["results"]] == ["BUNDLE_STATE_INIT"] * 2
