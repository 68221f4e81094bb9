"""Probes (lbd/core/probes.py): recorded only inside a simulated run, every name the code uses
is listed, and a run that reaches a name not listed fails."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from lbd.core import probes
from lbd.simulation.run import run_seed
from lbd.simulation.schedule import WorldSpec

LBD = Path(probes.__file__).resolve().parents[1]


def _named_in_code() -> dict[str, list[str]]:
    """Every ``probe("...")`` call in the modules of lbd that import it, by name, with where."""
    found: dict[str, list[str]] = {}
    for path in sorted(LBD.rglob("*.py")):
        text = path.read_text()
        if "from lbd.core.probes import probe" not in text:
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "probe"
            ):
                assert len(node.args) == 1 and isinstance(node.args[0], ast.Constant), (
                    f"{path}:{node.lineno}: a probe's name must be a string literal"
                )
                where = f"{path.relative_to(LBD.parent)}:{node.lineno}"
                found.setdefault(node.args[0].value, []).append(where)
    return found


def test_every_probe_in_the_code_is_listed_and_every_listed_probe_is_in_the_code() -> None:
    named = _named_in_code()
    assert sorted(set(named) - probes.PROBES.keys()) == []
    assert sorted(probes.PROBES.keys() - set(named)) == []
    assert len(probes.PROBES) >= 20


def test_required_probes_are_listed_with_a_share() -> None:
    assert set(probes.REQUIRED) <= probes.PROBES.keys()
    assert all(0 < share <= 1 for share in probes.REQUIRED.values())


def test_probes_are_recorded_only_inside_recording() -> None:
    probes.probe("fence.enter")  # nothing records: no error, nothing kept
    with probes.recording() as outer:
        probes.probe("fence.enter")
        with probes.recording() as inner:
            probes.probe("fence.exit")
        probes.probe("orphan.wait")
    probes.probe("orphan.handover")
    assert outer == {"fence.enter", "orphan.wait"}
    assert inner == {"fence.exit"}
    assert probes.unknown({"fence.enter", "no.such", "a.b"}) == ["a.b", "no.such"]


def test_a_seed_reports_the_probes_it_reached() -> None:
    outcome = run_seed(WorldSpec(1, virtual_s=120), trace=False)
    assert outcome.ok, outcome.violations
    # Every world starts its sidecars on the channel ground while they register.
    assert "fence.channel_only" in outcome.probes
    assert outcome.probes <= probes.PROBES.keys()


def test_a_seed_that_reaches_a_probe_not_listed_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    listed = dict(probes.PROBES)
    del listed["fence.channel_only"]
    monkeypatch.setattr(probes, "PROBES", listed)
    outcome = run_seed(WorldSpec(1, virtual_s=120), trace=False)
    assert any("'fence.channel_only' is not in" in v for v in outcome.violations)
    assert dataclasses.replace(outcome, violations=[]).ok
