"""The live-balance benchmark's arithmetic: carried load, time and cycles to target, latencies."""

from __future__ import annotations

import dataclasses
import math

import pytest
from rich.console import Console

from bench.balance_live_bench import (
    SETTINGS,
    BalanceLiveResult,
    Latencies,
    Sample,
    carried_loads,
    cycles,
    figures,
    latencies,
    samples_table,
    seconds_to_target,
    table,
)
from lbd.traffic.records import TrafficRecord

idle = {f"idle-{i}": 0.0 for i in range(9)}


def test_carried_load_is_the_brokers_bytes_over_its_capacity_in_and_out() -> None:
    # 100 messages/s in + 100 out of 250 bytes: 0.4 Mbit/s over 0.5 + 0.5 Mbit/s.
    loads = carried_loads({"a": 200.0, "b": 0.0}, 250, 1.0)
    assert loads == {"a": pytest.approx(0.4), "b": 0.0}


def test_time_to_target_is_the_first_sample_under_it_from_the_join_on() -> None:
    samples = [(-20.0, 0.01), (0.0, 0.30), (10.0, 0.12), (20.0, 0.09), (30.0, 0.05)]
    assert seconds_to_target(samples, 0.10) == 20.0
    assert seconds_to_target(samples, 0.01) is None
    assert seconds_to_target([(0.0, 0.05)], 0.10) == 0.0


@pytest.mark.parametrize(
    ("seconds", "expected"), [(0.0, 1), (11.9, 1), (12.0, 1), (12.1, 2), (60.0, 5)]
)
def test_cycles_count_the_intervals_begun_within_the_time(seconds: float, expected: int) -> None:
    assert cycles(seconds, 12.0) == expected


def test_latencies_take_the_receipted_sends_of_the_producers_in_the_window() -> None:
    record = TrafficRecord()
    a, b = record.add_producer("persistent://t/n/a"), record.add_producer("persistent://t/n/b")
    for i in range(100):
        send = record.sent(a, sent_ns=1_000_000_000 + i)
        send.ended_ns = send.sent_ns + (i + 1) * 1_000_000  # 1..100 ms
    late = record.sent(a, sent_ns=5_000_000_000)
    late.ended_ns = late.sent_ns + 999_000_000
    failed = record.sent(b, sent_ns=1_000_000_000)
    failed.ended_ns, failed.error = failed.sent_ns + 1, "Timeout"
    got = latencies(record, [a, b], 0, 2_000_000_000)
    assert got == Latencies(100, 50.0, 99.0, 100.0)
    assert latencies(record, [b], 0, 2_000_000_000).sends == 0


def result(stds: list[float]) -> BalanceLiveResult:
    # Nine brokers idle and one carrying a load L: their carried std is 0.3 L.
    per_load = 2 * 0.33 * 1e6 / 8 / 256
    samples = [
        Sample(10.0 * (i - 1), {**idle, "hot": s / 0.3 * per_load}, {"hot": 0.3})
        for i, s in enumerate(stds)
    ]
    none = Latencies(0, 0.0, 0.0, 0.0)
    return BalanceLiveResult(samples, 9.0, 3, 7, 6, none, none, 0.0, 100, 0, 0, dict(SETTINGS))


def test_the_result_reads_cycles_from_its_samples_and_sets_them_beside_pulsars() -> None:
    r = result([0.05, 0.30, 0.20, 0.08, 0.06])
    assert [round(s.carried_std, 6) for s in r.samples] == [0.05, 0.3, 0.2, 0.08, 0.06]
    assert r.seconds_to_target == 20.0
    assert r.cycles_to_target == 2
    # Samples taken before every joining broker registered do not count.
    early = dataclasses.replace(r, samples=[Sample(0.0, {"a": 0.0}, {}), *r.samples[2:]])
    assert early.seconds_to_target == 20.0
    cycles_figure, harm = figures(r)
    assert cycles_figure.value == 2 and cycles_figure.baseline == 5 and cycles_figure.met
    assert harm.value == 0 and harm.met
    never = figures(result([0.3, 0.3]))[0]
    assert never.value == math.inf and not never.met


def test_the_tables_render() -> None:
    console = Console(width=200, record=True)
    r = result([0.05, 0.30, 0.08])
    console.print(table(r))
    console.print(samples_table(r))
    text = console.export_text()
    assert "moves before the join / after it" in text and "3 / 7" in text
