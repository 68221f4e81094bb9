"""CI's share of the deterministic simulation: 1,000 seeds of ten virtual minutes each, with every
kind of fault, must hold every invariant (``lbd sim check --seeds 1000``)."""

from __future__ import annotations

import os

import pytest

from lbd.cli.main import main

pytestmark = pytest.mark.timeout(1800)

SEEDS = 1000


def test_a_thousand_seeds_hold_every_invariant(capsys: pytest.CaptureFixture[str]) -> None:
    jobs = str(os.cpu_count() or 1)
    code = main(["sim", "check", "--seeds", str(SEEDS), "--jobs", jobs])
    out = capsys.readouterr().out
    print(out)
    assert code == 0, out
    assert f"{SEEDS} seeds, 0 failed" in out
