"""``lbd sim broker``: a simulated broker attached to a sidecar (demo, tests, benchmarks).

It holds a ``BrokerSession`` with the sidecar at ``--sidecar``, serves what it is told to own,
and reports synthetic, deterministic load (``--seed``) for the bundles it serves. It runs until
SIGINT or SIGTERM and reconnects whenever its session drops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from pathlib import Path

from lbd.cli import sim_check
from lbd.cli.ctl import add_credential_flags, credentials_from
from lbd.core.errors import InvalidInputError
from lbd.devcluster.sim_broker import SimBrokerConfig, run_sim_broker
from lbd.tasks import run_event_loop
from lbd.workload.traffic import Workload, WorkloadSpec


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lbd sim broker`` and ``lbd sim check``."""
    group = sub.add_parser("sim", help="simulated parts of a cluster", description=__doc__)
    verbs = group.add_subparsers(dest="sim_command", metavar="VERB", required=True)
    p = verbs.add_parser(
        "broker",
        help="run a simulated broker attached to a sidecar",
        description=__doc__,
    )
    p.add_argument("--sidecar", required=True, metavar="HOST:PORT", help="the sidecar's gRPC API")
    p.add_argument("--broker-id", required=True, metavar="ID", help="this broker's id")
    add_credential_flags(p)
    p.add_argument(
        "--topics-per-bundle", type=int, default=10, metavar="N", help="topics per bundle served"
    )
    p.add_argument(
        "--msg-rate",
        type=float,
        default=50.0,
        metavar="R",
        help="mean messages/s produced per topic (0: an idle broker)",
    )
    p.add_argument(
        "--hot-fraction", type=float, default=0.05, metavar="F", help="share of hot topics"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic load")
    p.add_argument(
        "--report-interval", type=float, default=1.0, metavar="S", help="seconds between reports"
    )
    p.add_argument(
        "--events-file",
        type=Path,
        metavar="FILE",
        help="append one JSON line per own/release/close/session event",
    )
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.set_defaults(func=run)
    sim_check.register(verbs)


def run(args: argparse.Namespace) -> int:
    """Run the simulated broker until SIGINT or SIGTERM."""
    try:
        spec = WorkloadSpec(
            topics_per_bundle=args.topics_per_bundle,
            msg_rate=args.msg_rate,
            hot_fraction=args.hot_fraction,
            seed=args.seed,
        )
    except ValueError as e:
        raise InvalidInputError(str(e)) from None
    config = SimBrokerConfig(
        sidecar=args.sidecar,
        broker_id=args.broker_id,
        report_interval_s=args.report_interval,
        credentials=credentials_from(args),
    )
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_event_loop(_until_signalled(config, Workload(spec), args.events_file))
    return 0


async def _until_signalled(
    config: SimBrokerConfig, workload: Workload, events: Path | None
) -> None:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await run_sim_broker(config, workload, events)
