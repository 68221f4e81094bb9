"""The benchmarks run (``make bench`` must not rot): the core suite on small inputs."""

from bench import core


def test_core_benchmarks_measure_something() -> None:
    results = list(core.run(quick=True))
    names = [r.name for r in results]
    assert len(names) == len(set(names)) >= 8
    assert all(r.ops > 0 and r.seconds > 0 for r in results)
    shedders = [r for r in results if "shedder" in r.name]
    assert shedders and all(" 0 decisions" not in r.name for r in shedders)
