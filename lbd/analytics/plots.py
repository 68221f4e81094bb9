"""The report's PNG plots (matplotlib, no display needed)."""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lbd.analytics.report import ClusterEpisode


def _when(ts_ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ts_ms / 1000, tz=dt.UTC)


def draw_all(
    out: str,
    clusters: Sequence[str],
    std_rows: Sequence[Mapping[str, Any]],
    broker_rows: Sequence[Mapping[str, Any]],
    small: Mapping[str, Sequence[Mapping[str, Any]]],
    episodes: Sequence[ClusterEpisode],
    target_std: float,
) -> dict[str, str]:
    """Draw every plot into ``out``; return {title: file name} in display order."""
    import matplotlib

    matplotlib.use("Agg")
    images: dict[str, str] = {}
    for i, cluster in enumerate(clusters):
        name = f"balance-{i + 1}.png"
        _balance(
            os.path.join(out, name),
            cluster,
            [r for r in std_rows if r["cluster"] == cluster],
            [r for r in broker_rows if r["cluster"] == cluster],
            [e for e in episodes if e.cluster == cluster],
            target_std,
        )
        images[f"Broker load and cluster std: {cluster}"] = name
    moves = [r for r in small["moves_by_reason"]]
    if moves:
        _bars(
            os.path.join(out, "moves.png"),
            [f"{r['kind']}/{r['reason']}" for r in moves],
            [r["count"] for r in moves],
            "decisions",
        )
        images["Decisions by kind and reason"] = "moves.png"
    hot = list(small["hot_bundles"])[:10]
    if hot:
        _bars(
            os.path.join(out, "hot-bundles.png"),
            [str(r["bundle"]) for r in hot],
            [r["mean_throughput"] / 1e6 for r in hot],
            "mean throughput, MB/s",
        )
        images["Hot bundles"] = "hot-bundles.png"
    return images


def _balance(
    path: str,
    cluster: str,
    std_rows: Sequence[Mapping[str, Any]],
    broker_rows: Sequence[Mapping[str, Any]],
    episodes: Sequence[ClusterEpisode],
    target_std: float,
) -> None:
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, height_ratios=[2, 1])
    by_broker: dict[str, list[Mapping[str, Any]]] = {}
    for r in broker_rows:
        by_broker.setdefault(r["broker"], []).append(r)
    for broker, rows in sorted(by_broker.items()):
        top.plot([_when(r["ts_ms"]) for r in rows], [r["load"] for r in rows], lw=0.8, label=broker)
    top.set_ylabel("broker load (EMA)")
    top.set_title(f"cluster {cluster}")
    if len(by_broker) <= 12:
        top.legend(fontsize="x-small", ncol=2, loc="upper right")
    times = [_when(r["ts_ms"]) for r in std_rows]
    bottom.plot(times, [r["std"] for r in std_rows], color="black", lw=1, label="std")
    bottom.axhline(target_std, color="red", ls="--", lw=1, label=f"target {target_std:g}")
    end = times[-1] if times else None
    for e in episodes:
        stop = _when(e.episode.end_ms) if e.episode.end_ms is not None else end
        if stop is not None:
            bottom.axvspan(_when(e.episode.start_ms), stop, color="red", alpha=0.12)
    bottom.set_ylabel("load std")
    bottom.legend(fontsize="x-small", loc="upper right")
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _bars(path: str, labels: Sequence[str], values: Sequence[float], xlabel: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.35 * len(labels) + 1.2))
    ax.barh(list(reversed(labels)), list(reversed(values)), color="#4477aa")
    ax.set_xlabel(xlabel)
    ax.tick_params(axis="y", labelsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
