"""``lbd analytics report``: what a cluster's history says about its balance.

A Spark job over the history computes, per cluster:

- ``broker_load``: each broker's mean load per time bucket;
- ``cluster_std``: the mean and population std of broker loads per bucket;
- ``episodes``: each time the std went over the target, how long it took to get back under it
  (:mod:`lbd.core.balance_metrics` has the definition), and what happened just before (brokers
  joining or leaving);
- ``moves_by_reason``: assignments, transfers, unloads and splits by reason and strategy;
- ``hot_bundles``: the bundles with the highest mean throughput, with their peak and moves;
- ``ping_pong``: bundles that came back to a broker they had left within the window.

``DIR/report.html`` shows them with PNG plots; every table is also written under
``DIR/tables/<name>/`` as Parquet (by Spark, so the big series scale) and the small ones as
``DIR/tables/<name>.csv``.
"""

from __future__ import annotations

import csv
import html
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lbd.analytics.history_io import HistoryFrames, read_history
from lbd.analytics.progress import spark_progress
from lbd.core.balance_metrics import Episode
from lbd.core.errors import InvalidInputError
from lbd.core.settings import SheddingConfig

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

MAX_PLOT_POINTS = 600
"""Points per line in the plots; longer series are averaged into wider buckets."""
MAX_PLOT_CLUSTERS = 3
EVENT_LOOKBACK_S = 300
"""A broker joining or leaving this long before an episode starts is named as its cause."""


@dataclass(frozen=True, slots=True)
class ReportOptions:
    """Knobs of the report."""

    target_std: float = SheddingConfig().target_std
    bucket_s: int = 60
    ping_pong_window_s: int = 3600
    top_bundles: int = 20

    def __post_init__(self) -> None:
        if self.target_std <= 0:
            raise InvalidInputError(f"--target-std must be > 0, got {self.target_std:g}")
        if self.bucket_s < 1:
            raise InvalidInputError(f"--bucket-s must be >= 1, got {self.bucket_s}")
        if self.ping_pong_window_s < 0:
            raise InvalidInputError("--ping-pong-window-s must be >= 0")
        if self.top_bundles < 1:
            raise InvalidInputError(f"--top must be >= 1, got {self.top_bundles}")


@dataclass(frozen=True, slots=True)
class ClusterEpisode:
    """An episode of one cluster, with its likely cause."""

    cluster: str
    episode: Episode
    cause: str


@dataclass(frozen=True, slots=True)
class ReportSummary:
    """The headline numbers of a report, and where it went."""

    html: str
    rows: int
    """Rows of the history read (all three tables)."""
    seconds: float
    clusters: tuple[str, ...]
    episodes: tuple[ClusterEpisode, ...]
    moves: int
    ping_pongs: int

    @property
    def rows_per_second(self) -> float:
        """History rows analysed per second, end to end."""
        return self.rows / self.seconds if self.seconds > 0 else 0.0


def build_report(
    spark: SparkSession, history: str, out: str, options: ReportOptions | None = None
) -> ReportSummary:
    """Analyse the history at ``history`` and write the report under the local directory
    ``out``."""
    opts = options or ReportOptions()
    started = time.monotonic()
    with spark_progress(spark, "report"):
        h = read_history(spark, history)
        tables = _compute(spark, h, opts)
        os.makedirs(os.path.join(out, "tables"), exist_ok=True)
        for name, df in tables.items():
            df.coalesce(1).write.mode("overwrite").parquet(_file_uri(out, "tables", name))
        small = {
            name: _collect(tables[name])
            for name in ("moves_by_reason", "hot_bundles", "ping_pong", "membership")
        }
        std_rows = _plot_series(tables["cluster_std"], ("avg", "std"), opts)
        broker_rows = _plot_series(tables["broker_load"], ("load",), opts, key="broker")
        rows = h.broker_load.count() + h.bundle_load.count() + h.decisions.count()
    episodes = _episodes(_collect(tables["episodes"]), small["membership"], opts.bucket_s * 1000)
    small_tables: dict[str, Sequence[Mapping[str, Any]]] = {
        **small,
        "episodes": _episode_rows(episodes),
    }
    for name, table_rows in small_tables.items():
        _write_csv(os.path.join(out, "tables", f"{name}.csv"), table_rows)
    clusters = tuple(sorted({r["cluster"] for r in std_rows}))
    from lbd.analytics.plots import draw_all

    images = draw_all(
        out, clusters[:MAX_PLOT_CLUSTERS], std_rows, broker_rows, small, episodes, opts.target_std
    )
    moves = sum(r["count"] for r in small["moves_by_reason"] if r["kind"] != "assign")
    ping = sum(r["ping_pongs"] for r in small["ping_pong"])
    path = os.path.join(out, "report.html")
    summary = ReportSummary(
        html=path,
        rows=rows,
        seconds=time.monotonic() - started,
        clusters=clusters,
        episodes=tuple(episodes),
        moves=moves,
        ping_pongs=ping,
    )
    _write_html(path, history, opts, summary, images, small_tables)
    return summary


def _file_uri(*parts: str) -> str:
    return "file://" + os.path.abspath(os.path.join(*parts))


def _compute(spark: SparkSession, h: HistoryFrames, opts: ReportOptions) -> dict[str, DataFrame]:
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    bucket_ms = opts.bucket_s * 1000
    bucket = (F.floor(F.col("ts_ms") / bucket_ms) * bucket_ms).cast("long").alias("ts_ms")
    broker_load = (
        h.broker_load.groupBy("cluster", bucket, "broker")
        .agg(F.avg("load").alias("load"), F.avg("msg_throughput_ema").alias("throughput"))
        .cache()
    )
    cluster_std = broker_load.groupBy("cluster", "ts_ms").agg(
        F.avg("load").alias("avg"),
        F.stddev_pop("load").alias("std"),
        F.count("broker").alias("brokers"),
    )
    w = Window.partitionBy("cluster").orderBy("ts_ms")
    marked = (
        cluster_std.withColumn("over", F.col("std") > F.lit(opts.target_std))
        .withColumn("next_ts", F.lead("ts_ms").over(w))
        .withColumn("starts", F.col("over") & ~F.coalesce(F.lag("over").over(w), F.lit(False)))
        .withColumn("episode", F.sum(F.col("starts").cast("int")).over(w))
    )
    episodes = (
        marked.where("over")
        .groupBy("cluster", "episode")
        .agg(
            F.min("ts_ms").alias("start_ms"),
            F.max_by("next_ts", "ts_ms").alias("end_ms"),
            F.max("std").alias("peak_std"),
        )
        .withColumn("seconds_to_target", (F.col("end_ms") - F.col("start_ms")) / 1000)
    )
    membership = h.broker_load.groupBy("cluster", "broker").agg(
        F.min("ts_ms").alias("first_ms"), F.max("ts_ms").alias("last_ms")
    )
    moves_by_reason = (
        h.decisions.groupBy("cluster", "kind", "reason", "strategy")
        .count()
        .orderBy("cluster", F.desc("count"))
    )
    moves_per_bundle = (
        h.decisions.where(F.col("kind") != "assign").groupBy("cluster", "bundle").count()
    )
    hot_bundles = (
        h.bundle_load.withColumn(
            "throughput", F.col("msg_throughput_in") + F.col("msg_throughput_out")
        )
        .groupBy("cluster", "bundle")
        .agg(
            F.avg("throughput").alias("mean_throughput"),
            F.max("throughput").alias("peak_throughput"),
            F.count("*").alias("samples"),
            F.countDistinct("broker").alias("owners"),
        )
        .join(moves_per_bundle.withColumnRenamed("count", "moves"), ["cluster", "bundle"], "left")
        .fillna(0, ["moves"])
        .orderBy(F.desc("mean_throughput"))
        .limit(opts.top_bundles)
    )
    return {
        "broker_load": broker_load,
        "cluster_std": cluster_std,
        "episodes": episodes,
        "membership": membership,
        "moves_by_reason": moves_by_reason,
        "hot_bundles": hot_bundles,
        "ping_pong": _ping_pong(h.decisions, opts.ping_pong_window_s * 1000),
    }


def _ping_pong(decisions: DataFrame, window_ms: int) -> DataFrame:
    """Bundles arriving at a broker they left ``window_ms`` before or less, per bundle (as
    :func:`lbd.core.balance_metrics.ping_pongs` counts them)."""
    from pyspark.sql import functions as F

    arrivals = decisions.where(F.col("dst").isNotNull()).select(
        "cluster", "bundle", F.col("dst").alias("broker"), F.col("ts_ms").alias("arrived")
    )
    departures = decisions.where(F.col("src").isNotNull()).select(
        "cluster", "bundle", F.col("src").alias("broker"), F.col("ts_ms").alias("left")
    )
    back = arrivals.join(departures, ["cluster", "bundle", "broker"]).where(
        (F.col("left") <= F.col("arrived")) & (F.col("arrived") - F.col("left") <= window_ms)
    )
    return (
        back.select("cluster", "bundle", "broker", "arrived")
        .distinct()
        .groupBy("cluster", "bundle")
        .agg(F.count("*").alias("ping_pongs"), F.collect_set("broker").alias("brokers"))
        .withColumn("brokers", F.array_join(F.array_sort("brokers"), ","))
        .orderBy(F.desc("ping_pongs"), "bundle")
    )


def _plot_series(
    df: DataFrame, values: tuple[str, ...], opts: ReportOptions, key: str | None = None
) -> list[dict[str, Any]]:
    """``df`` averaged into at most :data:`MAX_PLOT_POINTS` buckets per cluster, collected."""
    from pyspark.sql import functions as F

    span = df.groupBy("cluster").agg((F.max("ts_ms") - F.min("ts_ms")).alias("span")).collect()
    widest = max((r["span"] or 0 for r in span), default=0)
    width = max(opts.bucket_s * 1000, widest // MAX_PLOT_POINTS + 1)
    bucket = (F.floor(F.col("ts_ms") / width) * width).cast("long").alias("ts_ms")
    keys: list[Column | str] = ["cluster", bucket, *([key] if key else [])]
    aggs = [F.avg(v).alias(v) for v in values]
    return _collect(df.groupBy(*keys).agg(*aggs).orderBy("cluster", "ts_ms"))


def _episodes(
    rows: Sequence[Mapping[str, Any]], membership: Sequence[Mapping[str, Any]], bucket_ms: int
) -> list[ClusterEpisode]:
    """Episodes with their likely cause: membership changes from shortly before the episode's
    start to the end of its first bucket."""
    starts = {
        r["cluster"]: min(m["first_ms"] for m in membership if m["cluster"] == r["cluster"])
        for r in rows
    }
    ends = {c: max(m["last_ms"] for m in membership if m["cluster"] == c) for c in starts}
    out = []
    for r in sorted(rows, key=lambda r: (r["cluster"], r["start_ms"])):
        lo, hi = r["start_ms"] - EVENT_LOOKBACK_S * 1000, r["start_ms"] + bucket_ms
        joined = sorted(
            m["broker"]
            for m in membership
            if m["cluster"] == r["cluster"]
            and m["first_ms"] > starts[r["cluster"]]
            and lo <= m["first_ms"] < hi
        )
        left = sorted(
            m["broker"]
            for m in membership
            if m["cluster"] == r["cluster"]
            and m["last_ms"] < ends[r["cluster"]]
            and lo <= m["last_ms"] < hi
        )
        causes = []
        if r["start_ms"] <= starts[r["cluster"]]:
            causes.append("history starts unbalanced")
        if joined:
            causes.append("joined: " + ", ".join(joined))
        if left:
            causes.append("left: " + ", ".join(left))
        episode = Episode(r["start_ms"], r["end_ms"], r["peak_std"])
        out.append(ClusterEpisode(r["cluster"], episode, "; ".join(causes) or "load shift"))
    return out


def _episode_rows(episodes: list[ClusterEpisode]) -> list[dict[str, object]]:
    return [
        {
            "cluster": e.cluster,
            "start_ms": e.episode.start_ms,
            "end_ms": e.episode.end_ms,
            "seconds_to_target": e.episode.seconds,
            "peak_std": round(e.episode.peak_std, 4),
            "cause": e.cause,
        }
        for e in episodes
    ]


def _collect(df: DataFrame) -> list[dict[str, Any]]:
    return [r.asDict() for r in df.collect()]


def _write_csv(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
    dicts = rows
    with open(path, "w", newline="", encoding="utf-8") as f:
        if not dicts:
            return
        writer = csv.DictWriter(f, fieldnames=list(dicts[0]))
        writer.writeheader()
        writer.writerows(dicts)


def _html_table(rows: Sequence[Mapping[str, Any]], limit: int = 50) -> str:
    dicts = rows
    if not dicts:
        return "<p><em>none</em></p>"
    head = "".join(f"<th>{html.escape(k)}</th>" for k in dicts[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in d.values()) + "</tr>"
        for d in dicts[:limit]
    )
    more = f"<p>{len(dicts) - limit} more rows in the CSV.</p>" if len(dicts) > limit else ""
    return f"<table><tr>{head}</tr>{body}</table>{more}"


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _write_html(
    path: str,
    history: str,
    opts: ReportOptions,
    s: ReportSummary,
    images: dict[str, str],
    tables: dict[str, Sequence[Mapping[str, Any]]],
) -> None:
    recovered = [e.episode.seconds for e in s.episodes if e.episode.seconds is not None]
    worst = f"{max(recovered):.0f} s" if recovered else "-"
    figures = "".join(
        f'<h2>{html.escape(title)}</h2><img src="{html.escape(name)}" alt="{html.escape(title)}">'
        for title, name in images.items()
    )
    sections = [
        ("Time back under the target std", "episodes"),
        ("Moves and splits by reason", "moves_by_reason"),
        ("Hot bundles", "hot_bundles"),
        ("Ping-pong (back to a broker it left within the window)", "ping_pong"),
    ]
    body = "".join(f"<h2>{t}</h2>{_html_table(tables[n])}" for t, n in sections)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>lbd report</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 6px;font-size:90%}}
img{{max-width:100%}}</style></head><body>
<h1>lbd history report</h1>
<p>History <code>{html.escape(history)}</code>: {s.rows} rows, clusters
{html.escape(", ".join(s.clusters))}. Target std {opts.target_std:g}, buckets of {opts.bucket_s} s,
ping-pong window {opts.ping_pong_window_s} s.</p>
<ul><li>{len(s.episodes)} episode(s) over the target std, {len(recovered)} back under it,
slowest {worst}</li><li>{s.moves} bundle move(s) and split(s)</li>
<li>{s.ping_pongs} ping-pong(s)</li></ul>
{figures}{body}
<p>Tables: <code>tables/</code> (Parquet directories, and CSV files for the small ones).</p>
</body></html>
"""
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
