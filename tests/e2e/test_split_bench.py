"""The split benchmark runs end to end (``make bench`` must not rot), on a small split."""

import math

import pytest

from bench import split_bench

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]


def test_the_split_benchmark_times_a_split_against_its_deadline() -> None:
    result = split_bench.run(children=200)
    for name, value in result.items():
        assert value > 0 and math.isfinite(value), name
    assert result["children"] == 200
    assert result["first child Owned s"] <= result["all children Owned s"]
    assert result["all children Owned s"] < result[split_bench.DEADLINE]
    (figure,) = split_bench.figures(result)
    assert figure.baseline == result[split_bench.DEADLINE]
    assert figure.ratio == pytest.approx(result["all children Owned / split deadline"])
