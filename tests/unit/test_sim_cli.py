"""``lbd sim broker`` refuses bad arguments with one clear line, before connecting anywhere."""

import pytest

from lbd.cli.main import main


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sidecar", "nohost", "--broker-id", "b1"], "sidecar address must be HOST:PORT"),
        (["--sidecar", "127.0.0.1:1", "--broker-id", ""], "broker id must not be empty"),
        (
            ["--sidecar", "127.0.0.1:1", "--broker-id", "b1", "--msg-rate", "-5"],
            "message rate must be >= 0",
        ),
        (
            ["--sidecar", "127.0.0.1:1", "--broker-id", "b1", "--report-interval", "0"],
            "report interval must be > 0",
        ),
    ],
)
def test_bad_arguments_are_one_line_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sim", "broker", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lbd: error: ") and message in err
    assert "Traceback" not in err
