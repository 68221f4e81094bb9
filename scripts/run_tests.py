"""Run the whole suite on both cores: two lanes of pytest side by side, then a table of the time.

``make test`` calls this. The suite's tiers split into two lanes that share nothing but the
machine, so the wall time is the longer lane's instead of the sum:

- **pure**: the tiers that keep one core busy (unit, contract, the seeded simulation on one
  job, analytics with Spark, the integration tests of one server at a time), at the lowest CPU
  priority (``nice 19``): the cluster tiers run on real time (leases, timeouts, clients' send
  latencies), so they get the cores whenever they want them and this lane takes what is left;
- **clusters**: the tiers that run whole dev clusters: end-to-end, both end-to-end and chaos on
  ``--secure`` clusters, then chaos.

Each run of pytest starts its own servers on free loopback ports and writes its output to a log,
printed whole when the run ends (interleaved output of two runs would be unreadable). A test
folder that no lane names is an error here, so no tier is left out by accident. The exit status
is non-zero when any run fails; ``--junit-dir`` keeps one JUnit report per run for CI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


@dataclass(frozen=True)
class Run:
    """One pytest run: its name, its arguments and the environment it adds."""

    name: str
    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    nice: int = 0
    """Its CPU priority (``nice``): the pure lane yields the cores to the clusters, whose
    processes run on real time (leases, timeouts), and takes what they leave idle."""


# The simulation runs its seeds on one job in the pure lane: the other core is the clusters'.
LANES: dict[str, tuple[Run, ...]] = {
    "pure": (
        Run(
            "unit+contract+sim+analytics+integration",
            (
                "tests/unit",
                "tests/contract",
                "tests/sim",
                "tests/analytics",
                "tests/integration",
            ),
            {"LBD_SIM_JOBS": "1"},
            nice=19,
        ),
    ),
    # The chaos tier (plain) runs last: its partition scenarios judge what clients see to the
    # message, so it starts once the pure lane has most likely ended.
    "clusters": (
        Run("e2e", ("tests/e2e",)),
        # The benchmarks start plain clusters of their own: on secure clusters they would only
        # repeat themselves (about 4 minutes).
        Run(
            "secure e2e+chaos",
            ("tests/e2e", "tests/chaos", "--ignore=tests/e2e/test_bench.py"),
            {"LBD_TEST_SECURE": "1"},
        ),
        Run("chaos", ("tests/chaos",)),
    ),
}


def test_folders() -> set[str]:
    """Every folder under tests/ that holds a test module."""
    return {
        f"tests/{path.parent.relative_to(TESTS).parts[0]}"
        for path in TESTS.rglob("test_*.py")
        if path.parent != TESTS
    }


def check_coverage(lanes: dict[str, tuple[Run, ...]]) -> None:
    """Refuse to run when a folder of tests is in no lane, or a lane names a missing folder."""
    named = {arg for runs in lanes.values() for run in runs for arg in run.args if arg[0] != "-"}
    missing = test_folders() - named
    if missing:
        raise SystemExit(f"run_tests: no lane runs {', '.join(sorted(missing))}: add it to LANES")
    if top := sorted(p.name for p in TESTS.glob("test_*.py")):
        raise SystemExit(f"run_tests: test modules at the top of tests/ ({', '.join(top)})")
    unknown = sorted(arg for arg in named if not (ROOT / arg).is_dir())
    if unknown:
        raise SystemExit(f"run_tests: LANES names folders that do not exist: {', '.join(unknown)}")


@dataclass
class Outcome:
    lane: str
    run: Run
    code: int
    seconds: float
    tiers: dict[str, dict[str, float]]


def run_lane(
    lane: str, runs: tuple[Run, ...], logs: Path, junit: Path | None, out: list[Outcome]
) -> None:
    """Run a lane's runs one after the other; print each run's log whole when it ends."""
    for index, run in enumerate(runs):
        stem = f"{lane}-{index + 1}"
        log, tiers_file = logs / f"{stem}.log", logs / f"{stem}.tiers.json"
        args = [sys.executable, "-m", "pytest", *run.args]
        if run.nice:
            args = ["nice", "-n", str(run.nice), *args]
        if junit is not None:
            args.append(f"--junitxml={junit / f'{stem}.xml'}")
        env = {**os.environ, **run.env, "LBD_TIER_FILE": str(tiers_file)}
        _say(f"[{lane}] {run.name}: started")
        started = time.monotonic()
        with log.open("wb") as sink:
            code = subprocess.call(args, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        seconds = time.monotonic() - started
        tiers = json.loads(tiers_file.read_text()) if tiers_file.exists() else {}
        out.append(Outcome(lane, run, code, seconds, tiers))
        with _PRINT:
            print(f"\n===== [{lane}] {run.name}: exit {code} after {seconds:.0f} s =====")
            sys.stdout.flush()
            sys.stdout.buffer.write(log.read_bytes())
            sys.stdout.flush()


_PRINT = threading.Lock()


def _say(line: str) -> None:
    with _PRINT:
        print(time.strftime("%H:%M:%S ") + line, flush=True)


def summary(outcomes: list[Outcome], wall: float) -> str:
    """The table of where the time went: each run's wall time, then each tier's test time."""
    lines = ["", "===== time per run and per tier =====", f"{'run':<48} {'exit':>4} {'wall s':>8}"]
    for o in outcomes:
        lines.append(f"{f'[{o.lane}] {o.run.name}':<48} {o.code:>4} {o.seconds:8.0f}")
    lines.append(f"{'all, side by side':<48} {'':>4} {wall:8.0f}")
    lines.append("")
    lines.append(f"{'tier':<24} {'tests':>6} {'test s':>8}")
    for o in outcomes:
        secure = " (secure)" if o.run.env.get("LBD_TEST_SECURE") else ""
        for tier, row in sorted(o.tiers.items(), key=lambda item: -item[1]["seconds"]):
            lines.append(f"{tier + secure:<24} {int(row['tests']):>6} {row['seconds']:8.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--junit-dir", type=Path, help="write one JUnit report per run here")
    parser.add_argument("--lane", choices=sorted(LANES), action="append", help="only this lane")
    parser.add_argument(
        "--count", action="store_true", help="print how many pytest runs the lanes hold, and exit"
    )
    args = parser.parse_args(argv)
    check_coverage(LANES)
    if args.count:
        print(sum(len(LANES[name]) for name in (args.lane or LANES)))
        return 0
    lanes = {name: LANES[name] for name in (args.lane or LANES)}
    if args.junit_dir is not None:
        args.junit_dir.mkdir(parents=True, exist_ok=True)
    outcomes: list[Outcome] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lbd-tests-") as logs:
        threads = [
            threading.Thread(
                target=run_lane, args=(lane, runs, Path(logs), args.junit_dir, outcomes)
            )
            for lane, runs in lanes.items()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    print(summary(outcomes, time.monotonic() - started), flush=True)
    failed = [o for o in outcomes if o.code != 0]
    for o in failed:
        print(f"FAILED: [{o.lane}] {o.run.name} exited {o.code}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
