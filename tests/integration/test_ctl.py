"""``lbd ctl`` against a scripted Admin/LoadBalancer server: output formats, errors, token, and
lookups (one topic by Lookup, several by one LookupMany)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from rich.console import Console

from lbd.cli.main import main
from lbd.ctl.client import SidecarClient
from lbd.ctl.watch import fetch, render
from lbd.devcluster import free_port
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc

BUNDLE = "public/default/0x00000000_0x40000000"
GOOD = "persistent://public/default/orders"
BAD = "persistent://public/default/"


def broker_status(broker_id: str, *, leader: bool, owned: int) -> lbd_pb2.BrokerStatus:
    info = lbd_pb2.BrokerInfo(
        broker_id=broker_id, service_url=f"pulsar://{broker_id}:6650", sidecar_grpc_addr="x:1"
    )
    return lbd_pb2.BrokerStatus(info=info, leader=leader, owned_bundles=owned)


class ScriptedAdmin(lbd_pb2_grpc.AdminServicer):
    """Fixed answers; records requests and metadata; Unload of anything but BUNDLE is NOT_FOUND."""

    def __init__(self) -> None:
        self.requests: list[object] = []
        self.metadata: list[dict[str, str]] = []

    def _seen(self, request: object, context: grpc.ServicerContext) -> None:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))

    def ListBrokers(self, request, context):
        self._seen(request, context)
        return lbd_pb2.ListBrokersResponse(
            brokers=[
                broker_status("broker-1", leader=True, owned=3),
                broker_status("broker-2", leader=False, owned=1),
            ]
        )

    def ListBundles(self, request, context):
        self._seen(request, context)
        return lbd_pb2.ListBundlesResponse(
            bundles=[
                lbd_pb2.BundleInfo(
                    bundle=BUNDLE,
                    state=lbd_pb2.BUNDLE_STATE_OWNED,
                    owner_broker_id="broker-1",
                    version_id=2,
                )
            ]
        )

    def GetLeader(self, request, context):
        self._seen(request, context)
        return lbd_pb2.GetLeaderResponse(broker_id="broker-1", term=42)

    def GetLoad(self, request, context):
        self._seen(request, context)
        context.abort(grpc.StatusCode.UNAVAILABLE, "no leader yet")

    def Unload(self, request, context):
        self._seen(request, context)
        if request.bundle != BUNDLE:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown bundle {request.bundle}")
        return lbd_pb2.UnloadResponse(bundle=request.bundle, src_broker_id="broker-1")

    def Split(self, request, context):
        self._seen(request, context)
        return lbd_pb2.SplitResponse(
            parent=request.bundle, children=["a", "b"], owner_broker_id="broker-1"
        )

    def Snapshot(self, request, context):
        self._seen(request, context)
        return lbd_pb2.SnapshotResponse(scenario_json='{"now_ms": 5, "brokers": {}}')


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


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[ScriptedAdmin, ScriptedLoadBalancer, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    admin, lb = ScriptedAdmin(), ScriptedLoadBalancer()
    lbd_pb2_grpc.add_AdminServicer_to_server(admin, server)
    lbd_pb2_grpc.add_LoadBalancerServicer_to_server(lb, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield admin, lb, f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture
def admin(
    scripted: tuple[ScriptedAdmin, ScriptedLoadBalancer, str],
) -> tuple[ScriptedAdmin, str]:
    servicer, _, addr = scripted
    return servicer, addr


@pytest.fixture
def lb(
    scripted: tuple[ScriptedAdmin, ScriptedLoadBalancer, str],
) -> tuple[ScriptedLoadBalancer, str]:
    _, servicer, addr = scripted
    servicer.calls.clear()
    return servicer, addr


def test_brokers_as_json_carries_every_field(
    admin: tuple[ScriptedAdmin, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, addr = admin
    assert main(["ctl", "--server", addr, "--output", "json", "brokers"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [b["info"]["broker_id"] for b in data["brokers"]] == ["broker-1", "broker-2"]
    assert data["brokers"][1]["leader"] is False  # defaults are printed too


def test_bundles_as_a_table_show_the_state_by_its_design_name(
    admin: tuple[ScriptedAdmin, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, addr = admin
    assert main(["ctl", "--server", addr, "bundles", "--namespace", "public/default"]) == 0
    out = capsys.readouterr().out
    assert BUNDLE in out and "Owned" in out and "broker-1" in out


def test_a_grpc_error_is_one_line_with_its_status_and_a_non_zero_exit(
    admin: tuple[ScriptedAdmin, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, addr = admin
    assert main(["ctl", "--server", addr, "unload", "public/default/0x40000000_0x80000000"]) == 1
    captured = capsys.readouterr()
    assert captured.err == (
        "lbd: error: NOT_FOUND: unknown bundle public/default/0x40000000_0x80000000\n"
    )
    assert captured.out == ""


def test_an_unreachable_sidecar_is_unavailable_naming_its_address(
    capsys: pytest.CaptureFixture[str],
) -> None:
    addr = f"127.0.0.1:{free_port()}"
    assert main(["ctl", "--server", addr, "--timeout", "2", "leader"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"lbd: error: UNAVAILABLE: cannot reach the sidecar at {addr}")
    assert "Traceback" not in err


def test_split_sends_the_parsed_boundaries_and_algorithm(admin: tuple[ScriptedAdmin, str]) -> None:
    servicer, addr = admin
    args = ["ctl", "--server", addr, "split", BUNDLE, "--algorithm"]
    args += ["specified_positions_divide", "--boundaries", "0x10000000, 536870912"]
    assert main(args) == 0
    request = servicer.requests[-1]
    assert isinstance(request, lbd_pb2.SplitRequest)
    assert list(request.boundaries) == [0x10000000, 0x20000000]
    assert request.algorithm == "specified_positions_divide"


@pytest.mark.parametrize("bad", ["0xzz", "0x100000000", "-1", ""])
def test_bad_boundaries_are_a_usage_error_before_any_call(
    admin: tuple[ScriptedAdmin, str], bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _, addr = admin
    with pytest.raises(SystemExit) as exited:
        main(["ctl", "--server", addr, "split", BUNDLE, "--boundaries", bad])
    assert exited.value.code == 2
    assert "--boundaries" in capsys.readouterr().err


def test_the_token_goes_out_as_a_bearer_header(
    admin: tuple[ScriptedAdmin, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    servicer, addr = admin
    assert main(["ctl", "--server", addr, "--token", "s3cret", "leader"]) == 0
    assert servicer.metadata[-1]["authorization"] == "Bearer s3cret"
    monkeypatch.setenv("LBD_GRPC__ADMIN_TOKEN", "from-env")
    assert main(["ctl", "--server", addr, "leader"]) == 0
    assert servicer.metadata[-1]["authorization"] == "Bearer from-env"


def test_snapshot_writes_the_scenario_as_indented_json(
    admin: tuple[ScriptedAdmin, str], tmp_path: Path
) -> None:
    _, addr = admin
    out = tmp_path / "snap.json"
    assert main(["ctl", "--server", addr, "snapshot", "--out", str(out)]) == 0
    text = out.read_text()
    assert json.loads(text) == {"now_ms": 5, "brokers": {}}
    assert "\n  " in text


def test_the_live_view_shows_what_answered_and_why_the_rest_did_not(
    admin: tuple[ScriptedAdmin, str],
) -> None:
    _, addr = admin
    with SidecarClient(addr, timeout_s=2) as client:
        view = fetch(client)
    assert view.load is None
    assert view.errors == ("load: UNAVAILABLE: no leader yet",)
    console = Console(width=140, record=True)
    console.print(render(view))
    text = console.export_text()
    assert "leader broker-1 (term 42)" in text
    assert "no load data" in text
    assert "Owned 1" in text
    assert "load: UNAVAILABLE: no leader yet" in text


# -- lookup ----------------------------------------------------------------------------------


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
