"""``lbd channel replay``: the examples, malformed files and missing files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lbd.cli.main import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "channel"
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.jsonl"))

OWNED_A = {"state": "Owned", "dst_broker": "a", "version_id": 1}


def _line(key: object, value: object) -> str:
    return json.dumps({"key": key, "value": value})


def _write(path: Path, lines: list[str | bytes]) -> Path:
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return path


def test_examples_exist() -> None:
    assert {p.name for p in EXAMPLE_FILES} >= {"assign-transfer-unload.jsonl", "conflicts.jsonl"}


@pytest.mark.parametrize("example", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_example_replays_to_its_expected_table(
    example: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = json.loads(example.with_suffix(".expected.json").read_text())
    assert main(["channel", "replay", str(example)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == expected
    assert err == ""


def test_split_parent_is_tombstoned_and_children_owned(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["channel", "replay", str(EXAMPLES / "assign-transfer-unload.jsonl")]) == 0
    table = json.loads(capsys.readouterr().out)
    assert "pub/default/0xc0000000_0xffffffff" not in table
    for child in ("pub/default/0xc0000000_0xe0000000", "pub/default/0xe0000000_0xffffffff"):
        assert table[child]["state"] == "Owned"
        assert table[child]["dst_broker"] == "broker-3:8080"


def test_output_has_every_field_and_skips_tombstones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = _write(
        tmp_path / "log.jsonl",
        [
            _line("t/n/x", OWNED_A),
            "",
            "   ",
            _line("t/n/y", {"state": "Free", "source_broker": "a", "version_id": 1}),
            _line("t/n/y", None),
        ],
    )
    assert main(["channel", "replay", str(log)]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "t/n/x": {
            "state": "Owned",
            "dst_broker": "a",
            "source_broker": None,
            "split_children": None,
            "force": False,
            "timestamp_ms": 0,
            "version_id": 1,
            "leader_term": None,
        }
    }


def test_explain_gives_each_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _write(
        tmp_path / "log.jsonl",
        [_line("t/n/x", OWNED_A), _line("t/n/x", {**OWNED_A, "dst_broker": "b"})],
    )
    assert main(["channel", "replay", "--explain", str(log)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "line 1: t/n/x: accepted: Init -> Owned",
        "line 2: t/n/x: rejected: version 1 <= current 1",
    ]


MALFORMED = [
    (b"{not json", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[1, 2]", 'expected an object {"key": bundle'),
    (_line(None, OWNED_A).encode(), '"key" must be a non-empty string'),
    (_line("", OWNED_A).encode(), '"key" must be a non-empty string'),
    (json.dumps({"key": "t/n/x"}).encode(), 'missing "value" (null for a tombstone)'),
    (_line("t/n/x", 3).encode(), "value must be a JSON object, got a number"),
    (_line("t/n/x", {**OWNED_A, "state": "Lost"}).encode(), "unknown state 'Lost'"),
    (_line("t/n/x", {"state": "Owned", "dst_broker": "a"}).encode(), "'version_id'"),
]


@pytest.mark.parametrize(("bad", "message"), MALFORMED)
def test_malformed_line_fails_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: bytes, message: str
) -> None:
    log = _write(tmp_path / "log.jsonl", [_line("t/n/y", OWNED_A), bad])
    assert main(["channel", "replay", str(log)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0].startswith(f"{log}:line 2: ")
    assert message in lines[0]
    assert lines[-1] == (
        f"lbd: error: 1 malformed line(s) in {log}; fix them or pass --skip-malformed"
    )


def test_every_malformed_line_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = _write(tmp_path / "log.jsonl", [b"{", _line("t/n/x", OWNED_A), b"[]", b"nope"])
    assert main(["channel", "replay", str(log)]) == 2
    err = capsys.readouterr().err
    for number in (1, 3, 4):
        assert f"{log}:line {number}: " in err
    assert "3 malformed line(s)" in err
    assert "line 2" not in err


def test_skip_malformed_warns_and_prints_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = _write(
        tmp_path / "log.jsonl",
        [
            _line("t/n/x", OWNED_A),
            _line("t/n/x", {"state": "Releasing", "source_broker": "a", "version_id": "2"}),
            _line("t/n/x", {"state": "Releasing", "source_broker": "a", "version_id": 2}),
        ],
    )
    assert main(["channel", "replay", "--skip-malformed", str(log)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["t/n/x"]["state"] == "Releasing"
    assert err.startswith(f"lbd: warning: {log}:line 2: version_id must be an integer")
    assert err.rstrip().endswith("(skipped)")


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.jsonl"
    assert main(["channel", "replay", str(missing)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("lbd: error: ")
    assert str(missing) in err


def test_empty_file_is_an_empty_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert main(["channel", "replay", str(empty)]) == 0
    assert json.loads(capsys.readouterr().out) == {}


def test_channel_needs_a_verb(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["channel"])
    assert info.value.code == 2
    assert "replay" in capsys.readouterr().err
