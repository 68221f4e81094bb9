"""``lbd analytics synth|report|replay``: the Spark pipeline over load histories.

pyspark is imported inside the verbs, so ``lbd`` works without the ``analytics`` extra; a verb
run without it fails with one line naming the extra to install.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, TypeVar

from lbd.core.errors import InvalidInputError

_T = TypeVar("_T")
_MASTER_HELP = "Spark master URL: local[*] (default), local[N], spark://HOST:PORT, yarn, ..."


def register(sub: Any) -> None:
    """Add the ``analytics`` verb group."""
    parser = sub.add_parser(
        "analytics",
        help="synthesise, report on and replay load histories (Spark)",
        description="The load-history pipeline on Spark (local mode unless --master says else).",
    )
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    synth = verbs.add_parser(
        "synth",
        help="write synthetic histories",
        description="Write synthetic cluster histories, one Spark task per cluster: a "
        "hand-written --scenario, or --generated N clusters of the generator (those of "
        "lbd bench balance --generated N: brokers of mixed sizes, joins, leaves, restarts, hot "
        "namespaces, brokers reporting only EMAs or late), each under the default strategy.",
    )
    _spark_flags(synth)
    synth.add_argument("--out", required=True, help="directory or URI to write the history to")
    synth.add_argument(
        "--generated",
        type=int,
        metavar="N",
        help="write the N generated clusters of seeds SEED..SEED+N-1, named generated-SEED, "
        "instead of a scenario",
    )
    synth.add_argument(
        "--scenario", choices=["diurnal", "burst", "scale-up", "churn"], help="(diurnal)"
    )
    synth.add_argument("--brokers", type=int, help="brokers at full size (10)")
    synth.add_argument("--hours", type=float, help="length of the history (24)")
    synth.add_argument("--step-s", type=int, help="seconds between samples (60)")
    synth.add_argument("--bundles-per-broker", type=int, help="bundles per broker (8)")
    synth.add_argument("--namespaces", type=int, help="namespaces (4)")
    synth.add_argument(
        "--clusters", type=int, help="independent cluster histories, one Spark task each (1)"
    )
    synth.add_argument("--cluster-name", help="the cluster's name (synthetic)")
    synth.add_argument(
        "--seed", type=int, default=1, help="the seed (the first one with --generated) (1)"
    )
    synth.set_defaults(func=run_synth)

    report = verbs.add_parser("report", help="analyse a history into DIR/report.html")
    _spark_flags(report)
    report.add_argument("--history", required=True, help="the history directory or URI")
    report.add_argument("--out", required=True, help="local directory for the report")
    report.add_argument("--target-std", type=float, default=0.25)
    report.add_argument("--bucket-s", type=int, default=60, help="time bucket of the series")
    report.add_argument("--ping-pong-window-s", type=int, default=3600)
    report.add_argument("--top", type=int, default=20, help="hot bundles listed")
    report.set_defaults(func=run_report)

    replay = verbs.add_parser(
        "replay",
        help="replay histories under strategies and settings",
        description="Replay every history (and every cluster in it) under every strategy x "
        "setting, one Spark task each; rank each strategy and setting over all of them (histories "
        "ended under --target-std, then time over it, moves, ping-pongs) and write "
        "ranking.csv, runs.csv, recommended.toml (the winner's [shedding] keys with the "
        "evidence) and replay.md to --out.",
    )
    _spark_flags(replay)
    replay.add_argument(
        "--history", required=True, action="append", help="a history (repeat for several)"
    )
    replay.add_argument("--out", required=True, help="local directory for the results")
    replay.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a shedding key and the values to try (repeat); default: a built-in grid",
    )
    replay.add_argument(
        "--strategy", action="append", default=[], help="strategies to replay (default: all)"
    )
    replay.add_argument("--target-std", type=float, default=0.25)
    replay.add_argument("--step-s", type=int, default=60)
    replay.add_argument("--ping-pong-window-s", type=int, default=3600)
    replay.add_argument("--seed", type=int, default=1)
    replay.set_defaults(func=run_replay)


def _spark_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master", default="local[*]", help=_MASTER_HELP)
    parser.add_argument(
        "--spark-conf", action="append", default=[], metavar="KEY=VALUE", help="Spark setting"
    )


def _session(args: argparse.Namespace, app: str) -> Any:
    from lbd.analytics.spark import parse_conf, spark_session

    return spark_session(args.master, app_name=app, conf=parse_conf(args.spark_conf))


def _require_history(path: str) -> None:
    if "://" not in path and not os.path.isdir(path):
        raise InvalidInputError(f"history {path}: no such directory")


_SCENARIO_FLAGS = (
    "scenario",
    "brokers",
    "hours",
    "step_s",
    "bundles_per_broker",
    "namespaces",
    "clusters",
    "cluster_name",
)
"""``synth`` flags that describe a scenario's clusters (a generated cluster draws its own)."""


def run_synth(args: argparse.Namespace) -> int:
    """``lbd analytics synth``."""
    from lbd.analytics.scenarios import ScenarioName, SynthSpec
    from lbd.analytics.spark import require_pyspark
    from lbd.analytics.synth import generated_jobs, synth, synth_generated

    if args.generated is not None:
        given = [
            f"--{k.replace('_', '-')}" for k in _SCENARIO_FLAGS if getattr(args, k) is not None
        ]
        if given:
            raise InvalidInputError(
                f"--generated draws each cluster from its seed; {', '.join(given)} "
                f"cannot be given with it"
            )
        generated_jobs(args.generated, args.seed)  # bad input is named before Spark starts
        require_pyspark()
        result = synth_generated(
            _session(args, "lbd analytics synth"), args.out, args.generated, args.seed
        )
    else:
        spec = SynthSpec(
            scenario=ScenarioName(args.scenario or "diurnal"),
            brokers=_given(args.brokers, 10),
            hours=_given(args.hours, 24.0),
            step_s=_given(args.step_s, 60),
            bundles_per_broker=_given(args.bundles_per_broker, 8),
            namespaces=_given(args.namespaces, 4),
            seed=args.seed,
        )
        require_pyspark()
        result = synth(
            _session(args, "lbd analytics synth"),
            args.out,
            spec,
            clusters=_given(args.clusters, 1),
            cluster_name=args.cluster_name or "synthetic",
        )
    print(
        f"wrote {result.rows} rows ({result.decisions} decisions) of "
        f"{len(result.clusters)} cluster(s) to {result.out} in {result.seconds:.1f} s"
    )
    return 0


def _given(value: _T | None, default: _T) -> _T:
    return default if value is None else value


def run_report(args: argparse.Namespace) -> int:
    """``lbd analytics report``."""
    from lbd.analytics.report import ReportOptions, build_report
    from lbd.analytics.spark import require_pyspark

    options = ReportOptions(
        target_std=args.target_std,
        bucket_s=args.bucket_s,
        ping_pong_window_s=args.ping_pong_window_s,
        top_bundles=args.top,
    )
    _require_history(args.history)
    require_pyspark()
    s = build_report(_session(args, "lbd analytics report"), args.history, args.out, options)
    recovered = [e.episode.seconds for e in s.episodes if e.episode.seconds is not None]
    slowest = f", slowest back under target in {max(recovered):.0f} s" if recovered else ""
    print(
        f"{s.html}: {s.rows} rows in {s.seconds:.1f} s ({s.rows_per_second:,.0f} rows/s); "
        f"{len(s.episodes)} episode(s) over std {args.target_std:g}{slowest}; "
        f"{s.moves} move(s), {s.ping_pongs} ping-pong(s)"
    )
    return 0


def run_replay(args: argparse.Namespace) -> int:
    """``lbd analytics replay``."""
    from lbd.analytics.replay import parse_grid
    from lbd.analytics.replay import run_replay as replay
    from lbd.analytics.spark import require_pyspark
    from lbd.core.shedding import STRATEGIES

    grid = parse_grid(args.grid) if args.grid else None
    for path in args.history:
        _require_history(path)
    require_pyspark()
    result = replay(
        _session(args, "lbd analytics replay"),
        args.history,
        args.out,
        grid=grid,
        strategies=args.strategy or tuple(STRATEGIES),
        target_std=args.target_std,
        step_s=args.step_s,
        ping_pong_window_s=args.ping_pong_window_s,
        seed=args.seed,
    )
    print(
        f"{'rank':>4}  {'strategy':<18} {'under':>7} {'s over':>8} {'moves':>6} {'pp':>4} "
        f"{'std':>6}  setting"
    )
    for i, r in enumerate(result.standings[:10], 1):
        setting = " ".join(f"{k}={v}" for k, v in sorted(r.setting.items()))
        print(
            f"{i:>4}  {r.strategy:<18} {f'{r.under_target}/{r.histories}':>7} "
            f"{r.seconds_over_target:>8.0f} {r.moves:>6} {r.ping_pongs:>4} "
            f"{r.mean_final_std:>6.3f}  {setting}"
        )
    print(
        f"{len(result.ranking)} runs in {result.seconds:.1f} s; "
        f"recommended: {os.path.join(result.out, 'recommended.toml')}"
    )
    return 0
