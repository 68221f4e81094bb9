"""What ``lbd analytics replay`` concludes: each run's result, the standing of each strategy and
setting over every history, and the files that say so.

A run is one history replayed under one strategy and setting (:class:`RunResult`). A standing
(:class:`Standing`) is one strategy and setting over every history: on how many it ended under
the target std, how long it spent over it in all, its moves and ping-pongs. Standings rank, best
first: more histories ended under target; then less time over target; fewer moves; fewer
ping-pongs; a lower mean final std. On a single history that is the runs' own order.

Files, under the replay's output directory:

- ``ranking.csv``: every strategy and setting, ranked; the first is the winner;
- ``runs.csv``: every run, ranked by :meth:`RunResult.rank_key`;
- ``recommended.toml``: the winner's ``[shedding]`` keys (DESIGN §9), the evidence as comments:
  its standing, the best setting of each other strategy, and the current defaults';
- ``replay.md``: the best setting of each strategy as a table, then each history's runs compared.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

from lbd.core.settings import SheddingConfig
from lbd.core.shedding import DEFAULT_STRATEGY

AVG_SHEDDER_KEYS = frozenset(
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
"""The keys only ``avg_shedder`` reads."""

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
class Standing:
    """How one strategy and setting did over every history replayed."""

    strategy: str
    setting: Mapping[str, object]
    histories: int
    under_target: int
    """Histories it ended under the target std."""
    seconds_over_target: float
    """Over every history."""
    moves: int
    ping_pongs: int
    mean_final_std: float

    def rank_key(self) -> tuple[object, ...]:
        """Sort key, best first (see the module docstring)."""
        return (
            -self.under_target,
            self.seconds_over_target,
            self.moves,
            self.ping_pongs,
            self.mean_final_std,
        )


def standings(runs: Sequence[RunResult]) -> tuple[Standing, ...]:
    """Each strategy and setting of ``runs`` over every history, best first."""
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for r in runs:
        groups.setdefault((r.strategy, _describe(r.setting)), []).append(r)
    out = [
        Standing(
            strategy=mine[0].strategy,
            setting=mine[0].setting,
            histories=len(mine),
            under_target=sum(r.ends_under_target for r in mine),
            seconds_over_target=sum(r.seconds_over_target for r in mine),
            moves=sum(r.moves for r in mine),
            ping_pongs=sum(r.ping_pongs for r in mine),
            mean_final_std=sum(r.final_std for r in mine) / len(mine),
        )
        for mine in groups.values()
    ]
    return tuple(sorted(out, key=Standing.rank_key))


def write_results(
    out: str, runs: Sequence[RunResult], ranked: Sequence[Standing], target_std: float
) -> None:
    """Write the files of the module docstring under the local directory ``out``."""
    os.makedirs(out, exist_ok=True)
    _write_csv(os.path.join(out, "ranking.csv"), Standing, ranked)
    _write_csv(os.path.join(out, "runs.csv"), RunResult, runs)
    evidence = _evidence(runs, ranked, target_std)
    with open(os.path.join(out, "recommended.toml"), "w", encoding="utf-8") as f:
        f.write("\n".join([*(f"# {e}" for e in evidence), "", *_shedding(ranked[0])]) + "\n")
    report = [
        "# lbd replay",
        "",
        *evidence[:2],
        "",
        *standings_table(ranked),
        "",
        *_strategy_comparison(runs),
        "",
    ]
    with open(os.path.join(out, "replay.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(report))


def describe(s: Standing) -> str:
    """A standing in one line: histories under target, time over target, moves, ping-pongs."""
    return (
        f"under target at the end of {s.under_target} of {s.histories} history(ies), "
        f"{s.seconds_over_target:.0f} s over target in all, {s.moves} moves, "
        f"{s.ping_pongs} ping-pongs, mean final std {s.mean_final_std:.3f}"
    )


def best_of_each(ranked: Sequence[Standing]) -> list[tuple[int, Standing]]:
    """Each strategy's best setting with its rank (1-based), best first."""
    seen: set[str] = set()
    out = []
    for rank, s in enumerate(ranked, 1):
        if s.strategy not in seen:
            seen.add(s.strategy)
            out.append((rank, s))
    return out


def standings_table(ranked: Sequence[Standing]) -> list[str]:
    """The best setting of each strategy as a Markdown table."""
    lines = [
        "| rank | strategy | setting | under target | s over target | moves | ping-pongs "
        "| mean final std |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for rank, s in best_of_each(ranked):
        lines.append(
            f"| {rank} | {s.strategy} | {_describe(s.setting)} | {s.under_target}/{s.histories} "
            f"| {s.seconds_over_target:.0f} | {s.moves} | {s.ping_pongs} "
            f"| {s.mean_final_std:.3f} |"
        )
    return lines


def _describe(setting: Mapping[str, object]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(setting.items())) or "defaults"


def _write_csv(path: str, kind: type, rows: Sequence[object]) -> None:
    names = [f.name for f in fields(kind)]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["rank", *names])
        for i, r in enumerate(rows, 1):
            values = [getattr(r, n) for n in names]
            writer.writerow([i, *(_describe(v) if isinstance(v, dict) else v for v in values)])


def _evidence(
    runs: Sequence[RunResult], ranked: Sequence[Standing], target_std: float
) -> list[str]:
    best = ranked[0]
    lines = [
        f"Recommended by lbd analytics replay over {len({r.history for r in runs})} "
        f"history(ies), {len(runs)} runs, target std {target_std:g}.",
        f"Winner: {best.strategy} with {_describe(best.setting)}: {describe(best)}.",
        "Best setting of each strategy:",
    ]
    lines += [
        f"  {rank}. {s.strategy} with {_describe(s.setting)}: {describe(s)}."
        for rank, s in best_of_each(ranked)
    ]
    default = next(
        (
            (rank, s)
            for rank, s in enumerate(ranked, 1)
            if s.strategy == DEFAULT_STRATEGY and _is_default(s.setting)
        ),
        None,
    )
    if default is not None:
        lines.append(
            f"Current defaults ({DEFAULT_STRATEGY}, rank {default[0]}): {describe(default[1])}."
        )
    lines.append("Full ranking: ranking.csv; every run: runs.csv; strategies compared: replay.md.")
    return lines


def _shedding(best: Standing) -> list[str]:
    """The winner's ``[shedding]`` table."""
    config = replace(SheddingConfig(), **best.setting)  # type: ignore[arg-type]
    lines = ["[shedding]", f'strategy = "{best.strategy}"']
    for key in TOML_KEYS:
        value = getattr(config, key)
        text = str(value).lower() if isinstance(value, bool) else repr(value)
        lines.append(f"{key} = {text}")
    if best.strategy == "threshold_shedder":
        lines.append(f"threshold_shedder_percentage = {config.threshold_shedder_percentage!r}")
    if best.strategy == "cluster_planner":
        lines.append(f"max_moves_per_broker = {config.max_moves_per_broker!r}")
    if best.strategy == "avg_shedder":
        keys = [k for k in SheddingConfig.field_names() if k in AVG_SHEDDER_KEYS]
        lines += [f"{key} = {getattr(config, key)!r}" for key in keys]
    return lines


def _is_default(setting: Mapping[str, object]) -> bool:
    defaults = SheddingConfig()
    return all(getattr(defaults, k) == v for k, v in setting.items())


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
                leaves = (
                    "so it leaves more imbalance"
                    if h.final_std > t.final_std
                    else "yet here it ends no more imbalanced"
                )
                lines.append(
                    f"- transfer_shedder made {t.moves} moves, threshold_shedder {h.moves}: "
                    "threshold_shedder only sheds brokers above the average plus its threshold, "
                    f"{leaves} (final std {h.final_std:.3f} vs "
                    f"{t.final_std:.3f}, {h.seconds_over_target:.0f} s vs "
                    f"{t.seconds_over_target:.0f} s over target); transfer_shedder also fills "
                    "underloaded (new) brokers, which takes moves."
                )
    return lines
