"""The simulated cluster behind ``lbd demo``: the core converges it, through the channel."""

import json

import pytest

from lbd.cli.main import main
from lbd.core.state import ServiceUnitState
from lbd.workload.demo import CoreCluster, SimSpec


def run_cycles(spec: SimSpec, n: int) -> tuple[CoreCluster, list]:
    cluster = CoreCluster(spec)
    return cluster, [cluster.step() for _ in range(n)]


@pytest.mark.parametrize("strategy", ["cluster_planner", "transfer_shedder"])
def test_a_scale_up_and_a_hot_namespace_end_under_the_target_std(strategy: str) -> None:
    spec = SimSpec(strategy=strategy)
    _, reports = run_cycles(spec, 100)
    joined = next(r for r in reports if r.events)
    assert joined.cycle == spec.join_at_cycle
    after_join = reports[joined.cycle - 1 :]
    assert any(r.decisions for r in after_join), "the scale-up moved nothing"
    assert max(r.std for r in after_join) > spec.shedding.target_std
    hot = next(r for r in reports if any("traffic" in e for e in r.events))
    assert any(r.std < spec.shedding.target_std for r in reports[hot.cycle - 1 : hot.cycle + 30])
    assert reports[-1].std < spec.shedding.target_std
    assert all(row.bundles > 0 for row in reports[-1].brokers), "a broker was left empty"


def test_every_bundle_is_owned_by_exactly_one_live_broker_after_every_cycle() -> None:
    spec = SimSpec(seed=7)
    cluster = CoreCluster(spec)
    bundles = spec.namespaces * spec.bundles_per_namespace
    for _ in range(70):
        report = cluster.step()
        values = dict(cluster.table.items())
        assert len(values) == bundles
        assert all(v.state is ServiceUnitState.Owned for v in values.values())
        live = {row.broker for row in report.brokers}
        assert set(cluster.owners().values()) <= live
        assert sum(row.bundles for row in report.brokers) == bundles
        for d in report.decisions:
            assert d.src != d.dst


def test_the_same_seed_gives_the_same_run() -> None:
    _, a = run_cycles(SimSpec(seed=3), 30)
    _, b = run_cycles(SimSpec(seed=3), 30)
    assert [(r.decisions, r.std) for r in a] == [(r.decisions, r.std) for r in b]


def test_threshold_shedder_runs_too() -> None:
    _, reports = run_cycles(SimSpec(strategy="threshold_shedder"), 30)
    assert any(r.decisions for r in reports)
    assert all(d.dst is None for r in reports for d in r.decisions)


def test_demo_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--cycles", "6", "--output", "json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["cycle"] for r in lines] == [1, 2, 3, 4, 5, 6]
    assert set(lines[-1]["brokers"]) == {f"broker-{i}" for i in range(1, 6)}
    assert all(isinstance(r["notes"], list) for r in lines)


def test_the_demo_says_why_the_planner_acts_at_once_after_the_scale_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["demo", "--brokers", "10", "--initial-brokers", "5", "--output", "json"]
    assert main([*argv, "--cycles", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    acted = [r for r in lines if r["decisions"]]
    assert acted and all(any("lasting" in n for n in r["notes"]) for r in acted)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--output", "json"], "--output json needs --cycles"),
        (["demo", "--cycles", "-1"], "--cycles must be >= 0"),
        (["demo", "--initial-brokers", "9", "--cycles", "1"], "initial_brokers must be"),
    ],
)
def test_demo_bad_arguments(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("lbd: error: ") and message in err
