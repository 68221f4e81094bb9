"""``lbd analytics synth|report|replay``: the Spark pipeline over load histories.

pyspark is imported inside the verbs, so ``lbd`` works without the ``analytics`` extra; a verb
run without it fails with one line naming the extra to install.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from lbd.core.errors import InvalidInputError

_MASTER_HELP = "Spark master URL: local[*] (default), local[N], spark://HOST:PORT, yarn, ..."


def register(sub: Any) -> None:
    """Add the ``analytics`` verb group."""
    parser = sub.add_parser(
        "analytics",
        help="synthesise, report on and replay load histories (Spark)",
        description="The load-history pipeline on Spark (local mode unless --master says else).",
    )
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    synth = verbs.add_parser("synth", help="write a synthetic history")
    _spark_flags(synth)
    synth.add_argument("--out", required=True, help="directory or URI to write the history to")
    synth.add_argument(
        "--scenario", default="diurnal", choices=["diurnal", "burst", "scale-up", "churn"]
    )
    synth.add_argument("--brokers", type=int, default=10, help="brokers at full size (10)")
    synth.add_argument("--hours", type=float, default=24.0, help="length of the history (24)")
    synth.add_argument("--step-s", type=int, default=60, help="seconds between samples (60)")
    synth.add_argument("--bundles-per-broker", type=int, default=8)
    synth.add_argument("--namespaces", type=int, default=4)
    synth.add_argument(
        "--clusters", type=int, default=1, help="independent cluster histories, one Spark task each"
    )
    synth.add_argument("--cluster-name", default="synthetic")
    synth.add_argument("--seed", type=int, default=1)
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

    replay = verbs.add_parser("replay", help="replay histories under strategies and settings")
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


def run_synth(args: argparse.Namespace) -> int:
    """``lbd analytics synth``."""
    from lbd.analytics.scenarios import ScenarioName, SynthSpec
    from lbd.analytics.spark import require_pyspark
    from lbd.analytics.synth import synth

    spec = SynthSpec(
        scenario=ScenarioName(args.scenario),
        brokers=args.brokers,
        hours=args.hours,
        step_s=args.step_s,
        bundles_per_broker=args.bundles_per_broker,
        namespaces=args.namespaces,
        seed=args.seed,
    )
    require_pyspark()
    result = synth(
        _session(args, "lbd analytics synth"),
        args.out,
        spec,
        clusters=args.clusters,
        cluster_name=args.cluster_name,
    )
    print(
        f"wrote {result.rows} rows ({result.decisions} decisions) of "
        f"{len(result.clusters)} cluster(s) to {result.out} in {result.seconds:.1f} s"
    )
    return 0


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
        f"{'rank':>4}  {'strategy':<18} {'final std':>9} {'s over':>7} {'moves':>5} "
        f"{'pp':>3}  setting"
    )
    for i, r in enumerate(result.ranking[:10], 1):
        setting = " ".join(f"{k}={v}" for k, v in sorted(r.setting.items()))
        print(
            f"{i:>4}  {r.strategy:<18} {r.final_std:>9.3f} {r.seconds_over_target:>7.0f} "
            f"{r.moves:>5} {r.ping_pongs:>3}  {setting}"
        )
    print(
        f"{len(result.ranking)} runs in {result.seconds:.1f} s; "
        f"recommended: {os.path.join(result.out, 'recommended.toml')}"
    )
    return 0
