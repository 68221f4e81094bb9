"""The ``lbd`` console script exits at once after a verb that used a Pulsar client."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from lbd.cli import main as cli


class Exited(Exception):
    def __init__(self, how: str, code: int) -> None:
        super().__init__(how, code)
        self.how, self.code = how, code


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> None:
    def at_once(code: int) -> None:
        raise Exited("os._exit", code)

    def as_usual(code: int) -> None:
        raise Exited("sys.exit", code)

    monkeypatch.setattr(cli.os, "_exit", at_once)
    monkeypatch.setattr(cli.sys, "exit", as_usual)


def test_channel_dump_is_such_a_verb() -> None:
    args = cli.build_parser().parse_args(["channel", "dump", "--out", "-"])
    assert args.exit_at_once is True


@pytest.mark.usefixtures("exits")
def test_a_verb_that_used_a_pulsar_client_ends_the_process_at_once_with_its_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser(prog="lbd")

    def verb(args: argparse.Namespace) -> int:
        print("the whole output")
        return 3

    parser.set_defaults(func=verb, exit_at_once=True)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setattr(sys, "argv", ["lbd"])
    with pytest.raises(Exited) as exited:
        cli.entry()
    assert (exited.value.how, exited.value.code) == ("os._exit", 3)
    assert capsys.readouterr().out == "the whole output\n"


@pytest.mark.usefixtures("exits")
def test_any_other_verb_exits_as_usual(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.jsonl"
    monkeypatch.setattr(sys, "argv", ["lbd", "channel", "replay", str(missing)])
    with pytest.raises(Exited) as exited:
        cli.entry()
    assert (exited.value.how, exited.value.code) == ("sys.exit", cli.EXIT_FAILURE)
    assert str(missing) in capsys.readouterr().err
