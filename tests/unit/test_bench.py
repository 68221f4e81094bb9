"""The benchmarks run (``make bench`` must not rot): the core suite on small inputs."""

from rich.console import Console

from bench import core
from bench.outage_bench import reports_table
from lbd.devcluster.faults import OutageReport


def test_core_benchmarks_measure_something() -> None:
    results = list(core.run(quick=True))
    names = [r.name for r in results]
    assert len(names) == len(set(names)) >= 8
    assert all(r.ops > 0 and r.seconds > 0 for r in results)
    shedders = [r for r in results if "shedder" in r.name]
    assert shedders and all(" 0 decisions" not in r.name for r in shedders)


def test_the_outage_table_has_one_row_per_scenario_with_its_numbers() -> None:
    report = OutageReport(
        scenario="etcd paused",
        outage_s=60.0,
        dual_served=(),
        lost_bundles=("a/b/0x00000000_0xffffffff",),
        closed=0,
        moved=0,
        recovery_s=0.31,
        owned_lookups=180,
        owned_lookup_failures=0,
        assignment_fail_s=None,
    )
    console = Console(width=200, record=True)
    console.print(reports_table([report]))
    text = console.export_text()
    row = next(line for line in text.splitlines() if "etcd paused" in line)
    assert "0.31" in row and "0 of 180" in row
    assert [cell.strip() for cell in row.split("│")[1:-1]][1:5] == ["60", "0", "1", "0"]
