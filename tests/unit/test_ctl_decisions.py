"""``lbd ctl decisions``: ``--since`` parsing, the history's decisions read back with pyarrow, the
merge of both, and the verb against a scripted Admin server."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from lbd.cli.main import main
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.ctl.decisions import HISTORY_SOURCE, SAME_DECISION_MS, merge, parse_since
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from lbd.history.reader import HistoryDecision, read_decisions

NOW_MS = 1_714_561_200_000
"""2024-05-01T11:00:00Z."""
BUNDLE = BundleId("public/default/0x00000000_0x40000000")
OTHER = BundleId("public/default/0x40000000_0x80000000")


# -- --since -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "back_ms"),
    [("30s", 30_000), ("10m", 600_000), ("2h", 7_200_000), ("1d", 86_400_000), ("1.5m", 90_000)],
)
def test_since_takes_a_duration_back_from_now(text: str, back_ms: int) -> None:
    assert parse_since(text, NOW_MS) == NOW_MS - back_ms


@pytest.mark.parametrize(
    "text",
    [
        "2024-05-01T10:00:00Z",
        "2024-05-01T10:00:00+00:00",
        "2024-05-01T12:00:00+02:00",
        "2024-05-01T10:00",
    ],
)
def test_since_takes_an_iso_time_utc_unless_it_has_an_offset(text: str) -> None:
    assert parse_since(text, NOW_MS) == NOW_MS - 3_600_000


@pytest.mark.parametrize("text", ["10", "10 minutes", "-5m", "5y", "yesterday", "", "2024-13-01"])
def test_bad_since_names_the_value_and_what_is_accepted(text: str) -> None:
    with pytest.raises(InvalidInputError) as caught:
        parse_since(text, NOW_MS)
    assert repr(text.strip()) in str(caught.value)
    assert "duration" in str(caught.value) and "ISO-8601" in str(caught.value)


# -- the history -------------------------------------------------------------------------------


@pytest.fixture
def history(tmp_path: Path) -> str:
    """A history written by the sidecars' own writer: decisions an hour and a day apart."""
    pytest.importorskip("pyarrow", reason="the analytics extra (pyarrow) is not installed")
    from lbd.history.sink import HistorySink

    uri = str(tmp_path / "history")
    clock = [NOW_MS - 86_400_000]
    sink = HistorySink(uri, cluster="c1", recorder="broker-1", clock_ms=lambda: clock[0])
    with sink:
        sink.record_decision("assign", BUNDLE, reason="Lookup", dst=BrokerId("broker-2"))
        clock[0] = NOW_MS - 3_600_000
        sink.record_decision(
            "transfer",
            BUNDLE,
            reason="Overloaded",
            src=BrokerId("broker-2"),
            dst=BrokerId("broker-3"),
            strategy="transfer_shedder",
        )
        clock[0] = NOW_MS - 60_000
        sink.record_decision("unload", OTHER, reason="Admin", src=BrokerId("broker-1"))
    return uri


def test_the_history_decisions_come_back_oldest_first_from_since_on(history: str) -> None:
    every = read_decisions(history)
    assert [(d.kind, d.ts_ms) for d in every] == [
        ("assign", NOW_MS - 86_400_000),
        ("transfer", NOW_MS - 3_600_000),
        ("unload", NOW_MS - 60_000),
    ]
    assert every[1] == HistoryDecision(
        NOW_MS - 3_600_000,
        "transfer",
        BUNDLE,
        "broker-2",
        "broker-3",
        "Overloaded",
        "transfer_shedder",
        "broker-1",
    )
    recent = read_decisions(history, since_ms=NOW_MS - 3_600_000)
    assert [d.kind for d in recent] == ["transfer", "unload"]


def test_a_history_without_decisions_has_none_and_a_missing_one_is_an_error(
    tmp_path: Path,
) -> None:
    pytest.importorskip("pyarrow", reason="the analytics extra (pyarrow) is not installed")
    (tmp_path / "empty").mkdir()
    assert read_decisions(str(tmp_path / "empty")) == []
    with pytest.raises(InvalidInputError, match="no such directory"):
        read_decisions(str(tmp_path / "missing"))


def test_rows_of_another_schema_version_are_refused(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow", reason="the analytics extra (pyarrow) is not installed")
    from lbd.history.parquet import open_target, write_rows
    from lbd.history.rows import common, decision_row
    from lbd.history.schema import DECISIONS, DecisionKind

    head = {**common(NOW_MS, "c1", "test"), "schema_version": 99}
    row = decision_row(head, DecisionKind.UNLOAD, BUNDLE, reason="Admin")
    fs, base = open_target(str(tmp_path))
    write_rows(fs, base, DECISIONS, [row], "test")
    with pytest.raises(InvalidInputError, match="schema version 99; this lbd reads version 1"):
        read_decisions(str(tmp_path))


# -- merging -----------------------------------------------------------------------------------


def leader_decision(at_ms: int, kind: str, bundle: str, **fields: str) -> lbd_pb2.Decision:
    return lbd_pb2.Decision(at_ms=at_ms, kind=kind, bundle=bundle, **fields)


def row(
    ts_ms: int, kind: str, bundle: str, src: str | None, dst: str | None, reason: str
) -> HistoryDecision:
    return HistoryDecision(ts_ms, kind, bundle, src, dst, reason, None, "broker-1")


def test_merge_orders_by_time_keeps_the_leaders_copy_of_a_repeat_and_limits_to_the_newest() -> None:
    shed = leader_decision(
        NOW_MS,
        "transfer",
        BUNDLE,
        src_broker_id="b1",
        dst_broker_id="b2",
        reason="Overloaded",
        source="shedder",
        operation_id="op-1",
    )
    older = row(NOW_MS - 60_000, "unload", OTHER, "b3", None, "Admin")
    repeat = row(NOW_MS + SAME_DECISION_MS, "transfer", BUNDLE, "b1", "b2", "Overloaded")
    later_again = row(NOW_MS + 10 * SAME_DECISION_MS, "transfer", BUNDLE, "b1", "b2", "Overloaded")
    merged = merge([shed], [older, repeat, later_again])
    assert [(d.at_ms, d.source) for d in merged.decisions] == [
        (NOW_MS - 60_000, HISTORY_SOURCE),
        (NOW_MS, "shedder"),
        (NOW_MS + 10 * SAME_DECISION_MS, HISTORY_SOURCE),
    ]
    assert merged.decisions[0].dst_broker_id == ""
    assert merged.decisions[1].operation_id == "op-1"
    newest = merge([shed], [older, repeat, later_again], limit=2)
    assert [d.at_ms for d in newest.decisions] == [NOW_MS, NOW_MS + 10 * SAME_DECISION_MS]


# -- the verb ----------------------------------------------------------------------------------


class ScriptedAdmin(lbd_pb2_grpc.AdminServicer):
    """Answers ListDecisions with two fixed decisions, at or after the request's since_ms."""

    def __init__(self) -> None:
        self.requests: list[lbd_pb2.ListDecisionsRequest] = []

    def ListDecisions(self, request, context):  # type: ignore[no-untyped-def]
        self.requests.append(request)
        kept = [
            leader_decision(
                NOW_MS - 30_000,
                "transfer",
                BUNDLE,
                src_broker_id="broker-2",
                dst_broker_id="broker-3",
                reason="Overloaded",
                source="shedder",
            ),
            leader_decision(
                NOW_MS - 1_000,
                "orphan",
                OTHER,
                src_broker_id="broker-1",
                reason="orphan: broker-1 away 61s",
                source="monitor",
            ),
        ]
        return lbd_pb2.ListDecisionsResponse(
            decisions=[d for d in kept if d.at_ms >= request.since_ms]
        )


@pytest.fixture(scope="module")
def admin() -> Iterator[tuple[ScriptedAdmin, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = ScriptedAdmin()
    lbd_pb2_grpc.add_AdminServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def test_decisions_as_a_table_with_utc_times_and_reasons(
    admin: tuple[ScriptedAdmin, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    servicer, addr = admin
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: no cell is wrapped
    assert main(["ctl", "--server", addr, "decisions", "--since", "2024-05-01T10:00:00Z"]) == 0
    out = capsys.readouterr().out
    assert "2024-05-01T10:59:30.000Z" in out and "Overloaded" in out and "shedder" in out
    assert "broker-1 away 61s" in out
    assert servicer.requests[-1] == lbd_pb2.ListDecisionsRequest(since_ms=NOW_MS - 3_600_000)


def test_decisions_with_the_history_merged_as_json(
    admin: tuple[ScriptedAdmin, str], history: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _, addr = admin
    since = dt.datetime.fromtimestamp((NOW_MS - 7_200_000) / 1000, tz=dt.UTC).isoformat()
    args = ["ctl", "--server", addr, "--output", "json", "decisions", "--since", since]
    assert main([*args, "--history", history, "--limit", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    # The history's transfer an hour ago, its unload a minute ago, and the leader's two; the
    # newest three.
    assert [(d["kind"], d["source"]) for d in data["decisions"]] == [
        ("unload", HISTORY_SOURCE),
        ("transfer", "shedder"),
        ("orphan", "monitor"),
    ]
    assert data["decisions"][0]["operation_id"] == ""  # every field, for jq


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--since", "10 minutes"], "argument --since: '10 minutes' is neither a duration"),
        (["--limit", "-1"], "--limit must be >= 0"),
    ],
)
def test_bad_flags_are_refused_before_any_call(
    admin: tuple[ScriptedAdmin, str],
    args: list[str],
    complaint: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    servicer, addr = admin
    before = len(servicer.requests)
    try:
        code = main(["ctl", "--server", addr, "decisions", *args])
    except SystemExit as exited:  # argparse's usage error
        code = exited.code
    assert code != 0
    assert complaint in capsys.readouterr().err
    assert len(servicer.requests) == before
