"""The assignment and recovery benchmarks run end to end (``make bench`` must not rot), small."""

import math

import pytest

from bench import assign_bench, recovery_bench

pytestmark = [pytest.mark.servers, pytest.mark.timeout(240)]


def test_the_assignment_benchmark_assigns_both_ways_and_gives_its_figures() -> None:
    result = assign_bench.run(bundles=600, sequential=40, per_call=64, calls_in_flight=2)
    for name, value in result.items():
        assert value > 0 and math.isfinite(value), name
    assert result["in bulk: bundles each way"] == 280
    singly = "in bulk (64 Lookups in flight): assignments/s"
    many = "in bulk (LookupMany of 64, 2 in flight): assignments/s"
    p99, *rates = assign_bench.figures(result)
    assert p99.value == result["one at a time: p99 ms"]
    assert [(f.value, f.goal) for f in rates] == [(result[singly], ">= 1"), (result[many], ">= 1")]


def test_the_recovery_benchmark_times_every_phase_of_a_repair() -> None:
    result = recovery_bench.run(bundles=200)
    phases = [
        "first announcement (s after kill)",
        "last announcement (s after kill)",
        "first hand-over (s after kill)",
        "last hand-over (s after kill)",
        "all Owned again (s after kill)",
    ]
    times = [result[p] for p in phases]
    assert times == sorted(times)
    (figure,) = recovery_bench.figures(result)
    assert figure.value == result["first hand-over to all Owned (s)"] > 0
