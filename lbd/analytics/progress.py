"""Progress bars for Spark jobs: a thread polls Spark's status tracker and draws with rich."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

POLL_S = 0.5


@contextmanager
def spark_progress(spark: SparkSession, description: str) -> Iterator[None]:
    """Show the tasks done over the tasks of the running Spark stages while the block runs.

    Drawn on stderr, and only when stderr is a terminal (logs and tests stay clean)."""
    console = Console(stderr=True)
    if not console.is_terminal:
        yield
        return
    tracker = spark.sparkContext.statusTracker()
    done = threading.Event()
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} tasks"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task(description, total=None)

        def poll() -> None:
            while not done.wait(POLL_S):
                stages = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
                infos = [s for s in stages if s is not None]
                total = sum(s.numTasks for s in infos)
                completed = sum(s.numCompletedTasks for s in infos)
                progress.update(task, total=total or None, completed=completed)

        thread = threading.Thread(target=poll, name="lbd-spark-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
    sys.stderr.flush()
