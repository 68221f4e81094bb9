"""``lbd shed``: the example scenarios, the output contract, multi-cycle runs, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lbd.cli.main import main
from lbd.core.errors import InvalidInputError
from lbd.core.settings import SheddingConfig
from lbd.core.shedding import parse_scenario, scenario_to_json

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "scenarios"
OUTPUT_KEYS = {"cycle", "decisions", "skip_reason", "avg", "std", "notes"}
NOW = 1_700_000_060_000


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[dict[str, object]], str]:
    code = main(["shed", *args])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def example(name: str) -> str:
    return str(EXAMPLES / name)


def write(tmp_path: Path, doc: object) -> str:
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(doc))
    return str(path)


def small_doc(**changes: object) -> dict[str, object]:
    """Two brokers far apart, two bundles each; sheds on the first cycle."""
    doc: dict[str, object] = {
        "config": {"hit_count_threshold": 0, "min_throughput_threshold": 0},
        "now_ms": NOW,
        "brokers": {
            "b1": {"max_ema": 0.1, "msg_throughput_ema": 2e6, "updated_at_ms": NOW},
            "b2": {"max_ema": 0.9, "msg_throughput_ema": 9e6, "updated_at_ms": NOW},
        },
        "top_bundles": {
            "b1": [
                {"bundle": "t/n/0x0_0x1", "msg_throughput_in": 5e5, "msg_throughput_out": 5e5},
                {"bundle": "t/n/0x1_0x2", "msg_throughput_in": 5e5, "msg_throughput_out": 5e5},
            ],
            "b2": [
                {"bundle": "t/n/0x2_0x3", "msg_throughput_in": 1e6, "msg_throughput_out": 1e6},
                {"bundle": "t/n/0x3_0x4", "msg_throughput_in": 3e6, "msg_throughput_out": 4e6},
            ],
        },
    }
    doc.update(changes)
    return doc


# -- the examples ----------------------------------------------------------------------------


def test_balanced_example_decides_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, err = run(capsys, "--scenario", example("balanced.json"))
    assert (code, err) == (0, "")
    [line] = lines
    assert set(line) == OUTPUT_KEYS
    assert line["cycle"] == 1
    assert line["decisions"] == []
    assert line["skip_reason"] == "HitCount"
    assert line["avg"] == pytest.approx(0.45)


def test_overloaded_example_transfers_off_the_hot_broker(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ("--scenario", example("overloaded.json"), "--strategy", "transfer_shedder")
    code, [line], _ = run(capsys, *args)
    assert code == 0
    assert line["skip_reason"] is None
    assert isinstance(line["std"], float)
    assert line["std"] < 0.25  # the overloaded rule, not the std, makes it shed
    assert line["decisions"] == [
        {
            "bundle": "tenant-a/orders/0x00000000_0x40000000",
            "src": "broker-1:8080",
            "dst": "broker-4:8080",
            "reason": "Overloaded",
        }
    ]


def test_threshold_strategy_unloads_without_destination(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ("--scenario", example("overloaded.json"), "--strategy", "threshold_shedder")
    code, [line], _ = run(capsys, *args)
    assert code == 0
    decisions = line["decisions"]
    assert isinstance(decisions, list) and decisions
    assert all(d["dst"] is None and d["src"] == "broker-1:8080" for d in decisions)


def test_skewed_hitcount_example_decides_on_the_third_cycle(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ("--scenario", example("skewed-hitcount.json"), "--strategy", "transfer_shedder")
    code, lines, _ = run(capsys, *args)
    assert code == 0
    assert [line["cycle"] for line in lines] == [1, 2, 3]
    assert [line["skip_reason"] for line in lines] == ["HitCount", "HitCount", None]
    assert [bool(line["decisions"]) for line in lines] == [False, False, True]


def test_the_planner_acts_at_once_on_a_skew_the_emas_show(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, lines, _ = run(capsys, "--scenario", example("skewed-hitcount.json"))
    assert code == 0
    assert lines[0]["skip_reason"] is None and lines[0]["decisions"]
    notes = lines[0]["notes"]
    assert isinstance(notes, list)
    assert any("report only their EMAs" in n for n in notes)
    assert any(n.startswith("lasting: the EMAs") for n in notes)


def test_the_100_broker_example_pairs_at_most_max_brokers_per_cycle(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = json.loads((EXAMPLES / "skew-100-brokers.json").read_text())
    assert len(doc["brokers"]) == 100
    args = ("--scenario", example("skew-100-brokers.json"), "--strategy", "transfer_shedder")
    code, [line], _ = run(capsys, *args)
    assert code == 0
    decisions = line["decisions"]
    assert isinstance(decisions, list)
    pairs = {frozenset((d["src"], d["dst"])) for d in decisions}
    assert 1 <= len(pairs) <= SheddingConfig().max_brokers_per_cycle
    assert {d["reason"] for d in decisions} == {"Underloaded", "Overloaded"}


def test_the_seed_makes_runs_reproducible(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--scenario", example("skew-100-brokers.json"), "--seed", "5")
    assert run(capsys, *args)[1] == run(capsys, *args)[1]


def test_the_console_script_runs_an_example() -> None:
    script = Path(sys.executable).with_name("lbd")
    assert script.exists(), f"console script not installed next to {sys.executable}"
    proc = subprocess.run(
        [str(script), "shed", "--scenario", example("overloaded.json")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    [line] = [json.loads(x) for x in proc.stdout.splitlines()]
    assert line["decisions"][0]["dst"] == "broker-4:8080"


def test_the_console_script_reports_bad_input_on_stderr(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("lbd")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    proc = subprocess.run(
        [str(script), "shed", "--scenario", str(bad)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("lbd: error: ")
    assert "Traceback" not in proc.stderr


# -- cycles ----------------------------------------------------------------------------------


def test_later_cycles_see_the_unloads_of_earlier_ones(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ("--scenario", write(tmp_path, small_doc(cycles=2)), "--strategy", "transfer_shedder")
    code, lines, _ = run(capsys, *args)
    assert code == 0
    first, second = lines
    assert first["decisions"] == [
        {"bundle": "t/n/0x2_0x3", "src": "b2", "dst": "b1", "reason": "Overloaded"}
    ]
    # b2's load report predates the unload just made: it cools down until it reports again.
    assert second["skip_reason"] == "CoolDown"


def test_a_broker_without_load_data_stops_the_cycle(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    doc = small_doc()
    doc["brokers"] = {**doc["brokers"], "b3": None}  # type: ignore[dict-item]
    _, [line], _ = run(capsys, "--scenario", write(tmp_path, doc))
    assert line["skip_reason"] == "NoLoadData"


# -- bad input -------------------------------------------------------------------------------


def error_of(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code, lines, err = run(capsys, *args)
    assert code == 2
    assert lines == []
    assert err.startswith("lbd: error: ")
    assert err.count("\n") == 1
    return err


def test_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = error_of(capsys, "--scenario", str(tmp_path / "nope.json"))
    assert "cannot read scenario" in err and "nope.json" in err


def test_malformed_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text('{"now_ms": 1,\n  "brokers": }')
    err = error_of(capsys, "--scenario", str(path))
    assert "invalid JSON" in err and "line 2" in err


def test_nan_is_not_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(
        '{"now_ms": 1, "brokers": {"b1": {"max_ema": NaN, "msg_throughput_ema": 1,'
        ' "updated_at_ms": 1}}}'
    )
    assert "NaN is not a number" in error_of(capsys, "--scenario", str(path))


def test_bad_field_names_its_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    doc = small_doc()
    doc["brokers"]["b1"]["max_ema"] = "x"  # type: ignore[index]
    err = error_of(capsys, "--scenario", write(tmp_path, doc))
    assert 'brokers["b1"].max_ema: expected a number, got "x"' in err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"now_ms": "soon"}, 'now_ms: expected an integer, got "soon"'),
        ({"now_ms": 1.5}, "now_ms: expected an integer, got 1.5"),
        ({"cycles": 0}, "cycles: must be >= 1, got 0"),
        ({"brokers": []}, "brokers: expected an object, got an array"),
        (
            {"brokers": {"b1": {"max_ema": True, "msg_throughput_ema": 1, "updated_at_ms": 1}}},
            'brokers["b1"].max_ema: expected a number, got true',
        ),
        (
            {"brokers": {"b1": {"max_ema": -0.1, "msg_throughput_ema": 1, "updated_at_ms": 1}}},
            'brokers["b1"].max_ema: must be >= 0, got -0.1',
        ),
        (
            {"brokers": {"b1": {"max_ema": 0.1, "updated_at_ms": 1}}},
            'brokers["b1"]: missing key "msg_throughput_ema"',
        ),
        ({"extra": 1}, 'scenario: unknown key "extra"'),
        ({"top_bundles": {"b9": []}}, 'top_bundles["b9"]: unknown broker "b9" (not in brokers)'),
        (
            {
                "top_bundles": {
                    "b1": [{"bundle": "", "msg_throughput_in": 0, "msg_throughput_out": 0}]
                }
            },
            'top_bundles["b1"][0].bundle: expected a non-empty string, got ""',
        ),
        (
            {"owners": {"t/n/0x0_0x1": 3}},
            'owners["t/n/0x0_0x1"]: expected a non-empty string, got 3',
        ),
        ({"recently_unloaded_bundles": {"x": "then"}}, 'recently_unloaded_bundles["x"]: expected'),
        ({"config": {"target_std": 0}}, "config: invalid shedding config: target_std must be > 0"),
        (
            {"config": {"transfer_enabled": 1}},
            "config.transfer_enabled: expected true or false, got 1",
        ),
        (
            {"config": {"max_brokers_per_cycle": 2.5}},
            "config.max_brokers_per_cycle: expected an integer",
        ),
    ],
)
def test_invalid_scenarios(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    change: dict[str, object],
    message: str,
) -> None:
    assert message in error_of(capsys, "--scenario", write(tmp_path, small_doc(**change)))


def test_unknown_config_key_lists_the_accepted_ones(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    doc = small_doc(config={"target_stdev": 0.1})
    err = error_of(capsys, "--scenario", write(tmp_path, doc))
    assert 'config: unknown key "target_stdev"' in err
    assert "accepted keys: " + ", ".join(SheddingConfig.field_names()) in err


def test_root_must_be_an_object() -> None:
    with pytest.raises(InvalidInputError, match="scenario: expected an object, got an array"):
        parse_scenario([])


# -- serialisation ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.json")))
def test_scenarios_round_trip_through_json(name: str) -> None:
    scenario = parse_scenario(json.loads((EXAMPLES / name).read_text()))
    doc = json.loads(json.dumps(scenario_to_json(scenario)))
    assert parse_scenario(doc) == scenario
    assert set(doc["config"]) == set(SheddingConfig.field_names())


def test_serialised_null_broker_and_recent_unloads_survive() -> None:
    doc = small_doc(
        owners={"t/n/0x0_0x1": "b1"},
        recently_unloaded_bundles={"t/n/0x1_0x2": NOW - 5},
        recently_unloaded_brokers={"gone": NOW - 9},
    )
    doc["brokers"] = {**doc["brokers"], "b3": None}  # type: ignore[dict-item]
    scenario = parse_scenario(doc)
    out = scenario_to_json(scenario)
    assert out["brokers"]["b3"] is None  # type: ignore[index]
    assert out["recently_unloaded_brokers"] == {"gone": NOW - 9}
    assert parse_scenario(out) == scenario


# -- Pulsar's TransferShedderTest scenarios, through `lbd shed` -------------------------------

PULSAR = EXAMPLES / "pulsar-transfer-shedder"
PULSAR_SCENARIOS = sorted(
    p.name.removesuffix(".expected.json") for p in PULSAR.glob("*.expected.json")
)


def test_every_pulsar_scenario_has_its_expected_output() -> None:
    scenarios = {p.stem for p in PULSAR.glob("*.json") if not p.name.endswith(".expected.json")}
    assert scenarios == set(PULSAR_SCENARIOS)
    assert len(PULSAR_SCENARIOS) >= 30


@pytest.mark.parametrize("name", PULSAR_SCENARIOS)
def test_lbd_shed_reproduces_pulsar_transfer_shedder_test(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = json.loads((PULSAR / f"{name}.expected.json").read_text())
    seed = str(expected.get("seed", 0))
    args = ("--scenario", str(PULSAR / f"{name}.json"), "--strategy", "transfer_shedder")
    code, lines, err = run(capsys, *args, "--seed", seed)
    assert (code, err) == (0, "")
    assert [line["cycle"] for line in lines] == list(range(1, len(expected["cycles"]) + 1))
    for line, want in zip(lines, expected["cycles"], strict=True):
        decisions = line["decisions"]
        assert isinstance(decisions, list)
        got = sorted((d["bundle"], d["src"], d["dst"], d["reason"]) for d in decisions)
        assert got == sorted(tuple(d) for d in want["decisions"])  # Pulsar returns a set
        assert line["skip_reason"] == want["skip_reason"]
        for key in ("avg", "std"):  # only where Pulsar's test checks them
            if key in want:
                # Pulsar's figures carry its float CPU usage's rounding (testTargetStd).
                assert line[key] == pytest.approx(want[key], rel=1e-6), key


@pytest.mark.parametrize("name", PULSAR_SCENARIOS)
def test_pulsar_scenarios_round_trip_through_json(name: str) -> None:
    scenario = parse_scenario(json.loads((PULSAR / f"{name}.json").read_text()))
    assert parse_scenario(json.loads(json.dumps(scenario_to_json(scenario)))) == scenario
