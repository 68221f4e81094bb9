"""``lbd sim broker`` refuses bad arguments with one clear line, before connecting anywhere."""

import pytest

from lbd.cli.main import main
from lbd.simulation.run import run_seed
from lbd.simulation.schedule import search_spec


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


def test_sim_check_runs_seeds_and_says_how_fast(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "check", "--seeds", "2", "--jobs", "1", "--virtual-s", "120"]) == 0
    out = capsys.readouterr().out
    assert "2 seeds, 0 failed" in out and "seeds/s" in out


@pytest.mark.slow
def test_sim_check_prints_a_failing_seed_shrunk_with_its_replay(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seed = next(s for s in range(1, 61) if not run_seed(search_spec("lease-off", s)).ok)
    args = ["--seed", str(seed), "--mutation", "lease-off"]
    assert main(["sim", "check", *args]) == 1
    out = capsys.readouterr().out
    assert f"seed {seed}: FAILED" in out and "serves it" in out
    replay = next(line for line in out.splitlines() if "replay:" in line).split("replay: ")[1]
    shrunk = next(line for line in out.splitlines() if "still fails with" in line)
    assert int(shrunk.split("still fails with ")[1].split()[0]) < int(out.split(", ")[1].split()[0])
    # The printed replay runs exactly those faults, and fails again.
    capsys.readouterr()
    assert main(replay.split()[1:]) == 1
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seeds", "2", "--faults", "meteor"], "--faults: unknown ['meteor']"),
        (["--seeds", "0"], "--seeds and --jobs must be >= 1"),
        (["--seed", "1", "--keep", "99"], "--keep: indices of the seed's"),
        (["--seeds", "1", "--virtual-s", "10"], "--virtual-s must be >= 60"),
    ],
)
def test_sim_check_refuses_bad_arguments(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sim", "check", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lbd: error: ") and message in err


def test_sim_check_prints_the_probes_each_seed_reached(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "check", "--seeds", "2", "--jobs", "1", "--virtual-s", "120"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "fence.channel_only" in line)
    assert line.split()[1:3] == ["2", "100.0%"]
    assert "judged only for at least 500 seeds" in out


@pytest.mark.parametrize(
    ("required", "code"), [({"fence.channel_only": 0.5}, 0), ({"orphan.returned": 0.5}, 1)]
)
def test_sim_check_fails_when_a_required_probe_is_reached_by_too_few_seeds(
    required: dict[str, float],
    code: int,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lbd.cli import sim_check

    monkeypatch.setattr(sim_check, "REQUIRED", required)
    monkeypatch.setattr(sim_check, "REQUIRED_FROM_SEEDS", 2)
    assert main(["sim", "check", "--seeds", "2", "--jobs", "1"]) == code
    out = capsys.readouterr().out
    assert "2 seeds, 0 failed" in out
    assert ("TOO FEW" in out) == bool(code)
    if code:
        assert "1 required probe(s) reached by too few seeds: orphan.returned" in out
