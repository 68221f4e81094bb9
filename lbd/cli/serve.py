"""``lbd serve``: run the sidecar beside one broker until SIGTERM or SIGINT (DESIGN §9).

Logs go to stderr, one line per event: text by default, one JSON object per line with
``logging.json = true`` (for log collectors).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from lbd.config import LoggingSettings, add_cluster_flags, settings_from_args


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lbd serve``."""
    parser = sub.add_parser(
        "serve",
        help="run the load-balancer sidecar beside a broker",
        description=(
            "Run the sidecar: follow the state channel, serve the gRPC API (LoadBalancer, "
            "Admin, reflection, health) and /metrics, take part in leader election. Stops "
            "cleanly on SIGTERM or SIGINT."
        ),
    )
    add_cluster_flags(parser)
    parser.add_argument(
        "--broker-id",
        metavar="ID",
        help="this broker's id in the registry (broker.broker_id; env LBD_BROKER__BROKER_ID)",
    )
    parser.add_argument(
        "--grpc-addr",
        metavar="HOST:PORT",
        help="gRPC listen address (grpc.addr, default 127.0.0.1:7000)",
    )
    parser.add_argument(
        "--metrics-addr",
        metavar="HOST:PORT",
        help="/metrics listen address (metrics.addr, default 127.0.0.1:9464; '' to disable)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until stopped; 0 after an orderly stop, 1 when a vital part died."""
    from lbd.app import serve  # the whole daemon: imported only by the verb that runs it

    settings = settings_from_args(
        args,
        {
            "broker.broker_id": args.broker_id,
            "grpc.addr": args.grpc_addr,
            "metrics.addr": args.metrics_addr,
        },
    )
    configure_logging(settings.logging)
    return serve(settings)


class JsonLines(logging.Formatter):
    """One JSON object per record: time, level, logger, message (and the traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        line = {
            "ts": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line)


def configure_logging(settings: LoggingSettings) -> None:
    """Send the process's logs to stderr at the configured level and format."""
    handler = logging.StreamHandler(sys.stderr)
    if settings.json_lines:
        handler.setFormatter(JsonLines())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level)
    # The Pulsar C++ client logs every connection step at INFO.
    logging.getLogger("pulsar").setLevel(max(logging.WARNING, root.level))
