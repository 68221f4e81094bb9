"""CI's share of the deterministic simulation: seeds of ten virtual minutes each, with every kind
of fault, must hold every invariant. A fixed set (seeds 1 to 500) and a moving one: 500 seeds
from a first seed derived from the commit under test, printed, so that every change meets
schedules no change before it met, and a failure names its seed (``lbd sim check --seed S``
replays it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from lbd.cli.main import main

pytestmark = pytest.mark.timeout(1800)

FIXED = 500
MOVING = 500
MOVING_FROM = 10_001
"""The moving seeds start at or above this (the fixed set and the seeds run by hand below it)."""
MOVING_SPAN = 1_000_000
ROOT = Path(__file__).resolve().parents[2]


def moving_first(commit: str | None) -> int:
    """The first moving seed for ``commit`` (a hex id; None: the commit cannot be read)."""
    if not commit:
        return MOVING_FROM
    return MOVING_FROM + int(commit[:12], 16) % MOVING_SPAN


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def test_the_moving_seeds_follow_the_commit() -> None:
    a, b = "0" * 40, "f" * 40
    assert moving_first(None) == MOVING_FROM
    assert moving_first(a) == MOVING_FROM
    assert MOVING_FROM <= moving_first(b) < MOVING_FROM + MOVING_SPAN
    assert moving_first(b) != moving_first(a)


@pytest.mark.parametrize("which", ["fixed", "moving"])
def test_seeds_hold_every_invariant(which: str, capsys: pytest.CaptureFixture[str]) -> None:
    # scripts/run_tests.py gives the seeds one core when the other runs the cluster tiers.
    jobs = os.environ.get("LBD_SIM_JOBS") or str(os.cpu_count() or 1)
    if which == "fixed":
        first, count = 1, FIXED
    else:
        first, count = moving_first(_commit()), MOVING
        with capsys.disabled():
            print(f"\nsimulation: moving seeds {first}..{first + count - 1}")
    code = main(["sim", "check", "--seeds", str(count), "--first", str(first), "--jobs", jobs])
    out = capsys.readouterr().out
    print(out)
    assert code == 0, f"seeds {first}..{first + count - 1}:\n{out}"
    assert f"{count} seeds, 0 failed" in out
