"""``lbd analytics replay``: a history replayed under other strategies and settings.

Each history becomes a :class:`~lbd.analytics.engine.Trace` (samples grouped into steps of
``step_s``; a broker's last sample in a step stands for it). The traces are broadcast, and one
Spark task runs each history x strategy x setting through :func:`~lbd.analytics.engine.simulate`.
Settings come from a grid over the shedding keys; keys a strategy does not read are left at their
defaults for it, so no setting is replayed twice.

Ranking, best first: ending under the target std before ending over it (then lower final std);
then less time spent over target; fewer moves; fewer ping-pongs. ``DIR/ranking.csv`` holds every
run, ``DIR/recommended.toml`` the winner's ``[shedding]`` keys (DESIGN §9) with the evidence as
comments, and ``DIR/replay.md`` the comparison of the strategies.
"""

from __future__ import annotations

import csv
import itertools
import os
import time
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from lbd.analytics.engine import BrokerSample, BundleSample, Trace, TraceStep, simulate
from lbd.analytics.history_io import read_history
from lbd.analytics.progress import spark_progress
from lbd.core.balance_metrics import episodes, ping_pongs
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.settings import SheddingConfig
from lbd.core.shedding import DEFAULT_STRATEGY, STRATEGIES
from lbd.history.schema import DecisionKind

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEFAULT_GRID: Mapping[str, tuple[object, ...]] = {
    "target_std": (0.1, 0.15, 0.25),
    "hit_count_threshold": (0, 3),
    "max_brokers_per_cycle": (1, 3),
    "threshold_shedder_percentage": (5.0, 10.0, 20.0),
}
"""The settings tried when no ``--grid`` is given."""

_AVG_SHEDDER_KEYS = frozenset(
    {
        "avg_shedder_low_threshold",
        "avg_shedder_high_threshold",
        "avg_shedder_hit_count_low_threshold",
        "avg_shedder_hit_count_high_threshold",
        "avg_shedder_unload_share",
        "avg_shedder_min_unload_msg_rate",
        "avg_shedder_min_unload_throughput",
    }
)
_NOT_READ_BY: Mapping[str, frozenset[str]] = {
    "transfer_shedder": frozenset(
        {
            "threshold_shedder_percentage",
            "lower_boundary_shedding_enabled",
            "max_moves_per_broker",
            "min_throughput_threshold",
        }
    )
    | _AVG_SHEDDER_KEYS,
    "threshold_shedder": frozenset(
        {
            "target_std",
            "hit_count_threshold",
            "transfer_enabled",
            "overloaded_threshold",
            "max_moves_per_broker",
        }
    )
    | _AVG_SHEDDER_KEYS,
    "cluster_planner": frozenset(
        {
            "min_throughput_threshold",
            "threshold_shedder_percentage",
            "lower_boundary_shedding_enabled",
        }
    )
    | _AVG_SHEDDER_KEYS,
    "avg_shedder": frozenset(
        {
            "target_std",
            "hit_count_threshold",
            "overloaded_threshold",
            "min_throughput_threshold",
            "threshold_shedder_percentage",
            "lower_boundary_shedding_enabled",
            "max_moves_per_broker",
        }
    ),
}
FINAL_STEPS = 10
"""The final std is the mean std over this many last steps."""
TOML_KEYS = (
    "target_std",
    "hit_count_threshold",
    "max_brokers_per_cycle",
    "cooldown_s",
    "bundle_grace_period_s",
    "load_data_ttl_s",
    "transfer_enabled",
    "min_throughput_threshold",
    "overloaded_threshold",
)
"""The shedding keys of DESIGN §9, written to the recommended config."""


@dataclass(frozen=True, slots=True)
class RunResult:
    """How one strategy and setting did on one history."""

    history: str
    strategy: str
    setting: Mapping[str, object]
    """The grid keys of this run (other keys at their defaults)."""
    final_std: float
    seconds_over_target: float
    episodes: int
    recovered: int
    moves: int
    ping_pongs: int
    ends_under_target: bool

    def rank_key(self) -> tuple[object, ...]:
        """Sort key, best first (see the module docstring)."""
        return (
            not self.ends_under_target,
            0.0 if self.ends_under_target else round(self.final_std, 3),
            self.seconds_over_target,
            self.moves,
            self.ping_pongs,
            self.final_std,
        )


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Every run, ranked, and the files written."""

    ranking: tuple[RunResult, ...]
    out: str
    seconds: float


def parse_grid(items: Sequence[str]) -> dict[str, tuple[object, ...]]:
    """``KEY=V1,V2`` flags over the shedding keys; InvalidInputError names a bad one."""
    hints = typing.get_type_hints(SheddingConfig)
    grid: dict[str, tuple[object, ...]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or key not in hints:
            accepted = ", ".join(SheddingConfig.field_names())
            raise InvalidInputError(
                f"--grid {item!r}: expected KEY=V1,V2 with KEY one of {accepted}"
            )
        parsed: list[object] = []
        for text in values.split(","):
            text = text.strip()
            try:
                if hints[key] is bool:
                    if text.lower() not in ("true", "false"):
                        raise ValueError(text)
                    parsed.append(text.lower() == "true")
                else:
                    parsed.append(hints[key](text))
            except ValueError:
                raise InvalidInputError(
                    f"--grid {key}: {text!r} is not a valid {hints[key].__name__}"
                ) from None
        grid[key] = tuple(parsed)
    for tried in grid.values():
        if not tried:
            raise InvalidInputError("--grid: every key needs at least one value")
    return grid


def settings_for(strategy: str, grid: Mapping[str, Sequence[object]]) -> list[dict[str, object]]:
    """The distinct settings of ``grid`` that matter to ``strategy``, each a valid config."""
    keys = sorted(k for k in grid if k not in _NOT_READ_BY.get(strategy, frozenset()))
    out: list[dict[str, object]] = []
    for values in itertools.product(*(grid[k] for k in keys)):
        setting = dict(zip(keys, values, strict=True))
        replace(SheddingConfig(), **setting)  # type: ignore[arg-type]  # validates
        out.append(setting)
    return out


def load_traces(spark: SparkSession, history: str, step_s: int) -> list[Trace]:
    """The history at ``history`` as one trace per cluster, in steps of ``step_s``."""
    from pyspark.sql import functions as F

    h = read_history(spark, history)
    step_ms = step_s * 1000
    bucket = (F.floor(F.col("ts_ms") / step_ms) * step_ms).cast("long").alias("step")
    brokers = (
        h.broker_load.groupBy("cluster", bucket, "broker")
        .agg(
            F.max_by("max_usage", "ts_ms").alias("max_usage"),
            F.max_by(F.col("msg_throughput_in") + F.col("msg_throughput_out"), "ts_ms").alias(
                "throughput"
            ),
        )
        .collect()
    )
    bundles = (
        h.bundle_load.groupBy("cluster", bucket, "bundle")
        .agg(
            F.max_by("broker", "ts_ms").alias("broker"),
            F.max_by("msg_throughput_in", "ts_ms").alias("tin"),
            F.max_by("msg_throughput_out", "ts_ms").alias("tout"),
        )
        .collect()
    )
    steps: dict[tuple[str, int], tuple[dict[BrokerId, BrokerSample], dict[BundleId, BundleSample]]]
    steps = {}
    for r in brokers:
        entry = steps.setdefault((r["cluster"], r["step"]), ({}, {}))
        entry[0][BrokerId(r["broker"])] = BrokerSample(r["max_usage"], r["throughput"])
    for r in bundles:
        found = steps.get((r["cluster"], r["step"]))
        # A bundle whose reporter has no load sample in the step cannot be placed: left out.
        if found is not None and r["broker"] in found[0]:
            found[1][BundleId(r["bundle"])] = BundleSample(
                BrokerId(r["broker"]), r["tin"], r["tout"]
            )
    traces = []
    for cluster in sorted({c for c, _ in steps}):
        keys = sorted(k for k in steps if k[0] == cluster)
        trace_steps = tuple(TraceStep(k[1], *steps[k]) for k in keys)
        name = history if len({c for c, _ in steps}) == 1 else f"{history}#{cluster}"
        traces.append(Trace(name, cluster, trace_steps))
    if not any(t.steps and t.steps[0].bundles for t in traces):
        raise InvalidInputError(f"history {history}: no bundle load samples to replay")
    return traces


def evaluate(
    trace: Trace,
    strategy: str,
    setting: Mapping[str, object],
    *,
    target_std: float,
    ping_pong_window_s: int,
    seed: int,
) -> RunResult:
    """Replay ``trace`` under one strategy and setting and measure the outcome."""
    config = replace(SheddingConfig(), **setting)  # type: ignore[arg-type]
    series: list[tuple[int, float]] = []
    moves: list[tuple[int, str, str | None, str | None]] = []
    shed = 0
    for o in simulate(trace.steps, strategy, config, seed=seed):
        series.append((o.ts_ms, o.std))
        for d in o.decisions:
            moves.append((d.ts_ms, d.bundle, d.src, d.dst))
            shed += d.kind in (DecisionKind.TRANSFER, DecisionKind.UNLOAD)
    eps = episodes(series, target_std)
    end_ms = series[-1][0] if series else 0
    over = sum(((e.end_ms or end_ms) - e.start_ms) / 1000 for e in eps)
    tail = [s for _, s in series[-FINAL_STEPS:]] or [0.0]
    final = sum(tail) / len(tail)
    return RunResult(
        history=trace.name,
        strategy=strategy,
        setting=dict(setting),
        final_std=final,
        seconds_over_target=over,
        episodes=len(eps),
        recovered=sum(1 for e in eps if e.end_ms is not None),
        moves=shed,
        ping_pongs=ping_pongs(moves, ping_pong_window_s * 1000),
        ends_under_target=final <= target_std,
    )


def run_replay(
    spark: SparkSession,
    histories: Sequence[str],
    out: str,
    *,
    grid: Mapping[str, Sequence[object]] | None = None,
    strategies: Sequence[str] = tuple(STRATEGIES),
    target_std: float = SheddingConfig().target_std,
    step_s: int = 60,
    ping_pong_window_s: int = 3600,
    seed: int = 1,
) -> ReplayResult:
    """Replay every history under every strategy and setting; write the ranking and the
    recommended config under the local directory ``out``."""
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise InvalidInputError(
            f"unknown strategy {', '.join(unknown)}; known: {', '.join(STRATEGIES)}"
        )
    if target_std <= 0:
        raise InvalidInputError(f"--target-std must be > 0, got {target_std:g}")
    started = time.monotonic()
    chosen = DEFAULT_GRID if grid is None else grid
    with spark_progress(spark, "replay"):
        traces = [t for h in histories for t in load_traces(spark, h, step_s)]
        jobs = [
            (i, strategy, setting)
            for i in range(len(traces))
            for strategy in strategies
            for setting in settings_for(strategy, chosen)
        ]
        shared = spark.sparkContext.broadcast(traces)

        def run(job: tuple[int, str, dict[str, object]]) -> RunResult:
            index, strategy, setting = job
            return evaluate(
                shared.value[index],
                strategy,
                setting,
                target_std=target_std,
                ping_pong_window_s=ping_pong_window_s,
                seed=seed,
            )

        results = spark.sparkContext.parallelize(jobs, len(jobs)).map(run).collect()
        shared.unpersist()
    ranking = tuple(sorted(results, key=RunResult.rank_key))
    os.makedirs(out, exist_ok=True)
    _write_ranking(os.path.join(out, "ranking.csv"), ranking)
    _write_recommendation(out, ranking, target_std)
    return ReplayResult(ranking=ranking, out=out, seconds=time.monotonic() - started)


def _describe(setting: Mapping[str, object]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(setting.items())) or "defaults"


def _write_ranking(path: str, ranking: Sequence[RunResult]) -> None:
    names = [f.name for f in fields(RunResult)]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["rank", *names])
        for i, r in enumerate(ranking, 1):
            values = [getattr(r, n) for n in names]
            writer.writerow([i, *(_describe(v) if isinstance(v, dict) else v for v in values)])


def _strategy_comparison(ranking: Sequence[RunResult]) -> list[str]:
    """Per history: each strategy's best run, and why the moves compare as they do."""
    lines = []
    for history in sorted({r.history for r in ranking}):
        best = {}
        for r in ranking:
            if r.history == history and r.strategy not in best:
                best[r.strategy] = r
        lines.append(f"History {history}:")
        for s, r in best.items():
            lines.append(
                f"- best {s}: {_describe(r.setting)}: final std {r.final_std:.3f}, "
                f"{r.seconds_over_target:.0f} s over target, {r.moves} moves, "
                f"{r.ping_pongs} ping-pongs"
            )
        t, h = best.get("transfer_shedder"), best.get("threshold_shedder")
        if t is not None and h is not None:
            if t.moves < h.moves:
                lines.append(
                    f"- transfer_shedder needed fewer moves ({t.moves} < {h.moves}): it moves "
                    "only while the std is over target or a broker is under- or overloaded, "
                    "for hit_count_threshold cycles in a row, and straight to the least loaded "
                    "broker; threshold_shedder sheds any broker its threshold above the average "
                    "and lets the next lookup place the bundles."
                )
            else:
                lines.append(
                    f"- transfer_shedder made {t.moves} moves, threshold_shedder {h.moves}: "
                    "threshold_shedder only sheds brokers above the average plus its threshold, "
                    f"so it leaves more imbalance (final std {h.final_std:.3f} vs "
                    f"{t.final_std:.3f}, {h.seconds_over_target:.0f} s vs "
                    f"{t.seconds_over_target:.0f} s over target); transfer_shedder also fills "
                    "underloaded (new) brokers, which takes moves."
                )
    return lines


def _write_recommendation(out: str, ranking: Sequence[RunResult], target_std: float) -> None:
    best = ranking[0]
    config = replace(SheddingConfig(), **best.setting)  # type: ignore[arg-type]
    default = next(
        (r for r in ranking if r.strategy == DEFAULT_STRATEGY and _is_default(r.setting)), None
    )
    evidence = [
        f"Recommended by lbd analytics replay over {len({r.history for r in ranking})} "
        f"history(ies), {len(ranking)} runs, target std {target_std:g}.",
        f"Winner: {best.strategy} with {_describe(best.setting)}: final std "
        f"{best.final_std:.3f}, {best.seconds_over_target:.0f} s over target, "
        f"{best.moves} moves, {best.ping_pongs} ping-pongs.",
    ]
    if default is not None:
        evidence.append(
            f"Current defaults ({DEFAULT_STRATEGY}): final std {default.final_std:.3f}, "
            f"{default.seconds_over_target:.0f} s over target, {default.moves} moves, "
            f"{default.ping_pongs} ping-pongs (rank {ranking.index(default) + 1})."
        )
    evidence.append("Full ranking: ranking.csv; strategies compared: replay.md.")
    lines = [f"# {e}" for e in evidence] + ["", "[shedding]", f'strategy = "{best.strategy}"']
    for key in TOML_KEYS:
        value = getattr(config, key)
        text = str(value).lower() if isinstance(value, bool) else repr(value)
        lines.append(f"{key} = {text}")
    if best.strategy == "threshold_shedder":
        lines.append(f"threshold_shedder_percentage = {config.threshold_shedder_percentage!r}")
    if best.strategy == "cluster_planner":
        lines.append(f"max_moves_per_broker = {config.max_moves_per_broker!r}")
    if best.strategy == "avg_shedder":
        keys = [k for k in SheddingConfig.field_names() if k in _AVG_SHEDDER_KEYS]
        lines += [f"{key} = {getattr(config, key)!r}" for key in keys]
    with open(os.path.join(out, "recommended.toml"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    report = ["# lbd replay", "", *evidence, "", *_strategy_comparison(ranking), ""]
    with open(os.path.join(out, "replay.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(report))


def _is_default(setting: Mapping[str, object]) -> bool:
    defaults = SheddingConfig()
    return all(getattr(defaults, k) == v for k, v in setting.items())
