"""``lbd broker``: the broker front, a Pulsar binary-protocol broker beside the sidecar.

Pulsar clients (the official ``pulsar-client`` among them) produce and consume through it; it
serves the bundles its sidecar gives it, keeps topics in the cluster's storage server and hands
clients over when a bundle moves (docs/broker-contract.md). Settings come from ``[front]`` and
``[broker]`` of the same file as the sidecar's. SIGTERM hands its bundles to other brokers first;
a second SIGTERM stops it at once.
"""

from __future__ import annotations

import argparse

from lbd.config import add_cluster_flags, settings_from_args
from lbd.core.errors import InvalidInputError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lbd broker``."""
    parser = sub.add_parser(
        "broker",
        help="run the broker front: a Pulsar-protocol broker governed by its sidecar",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_cluster_flags(parser)
    parser.add_argument(
        "--broker-id", metavar="ID", help="this broker's id (broker.broker_id), as its sidecar's"
    )
    parser.add_argument("--addr", metavar="HOST:PORT", help="pulsar:// listen address (front.addr)")
    parser.add_argument(
        "--web-addr", metavar="HOST:PORT", help="http:// REST API address (front.web_addr)"
    )
    parser.add_argument(
        "--sidecar", metavar="HOST:PORT", help="the sidecar's gRPC address (front.sidecar_addr)"
    )
    parser.add_argument(
        "--storage-url", metavar="URL", help="the storage server (front.storage_url)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        dest="settings",
        metavar="SECTION.KEY=VALUE",
        help="any setting, over the file and the environment (repeatable)",
    )
    parser.set_defaults(func=run)


def parse_sets(pairs: list[str]) -> dict[str, object]:
    """``--set section.key=value`` pairs as dotted overrides; InvalidInputError for a bad one."""
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or key.count(".") != 1 or not all(key.split(".")):
            raise InvalidInputError(f"--set expects section.key=value, got {pair!r}")
        out[key] = value.strip()
    return out


def run(args: argparse.Namespace) -> int:
    """Serve until stopped; 0 after an orderly stop, 1 when the session failed for good."""
    from lbd.cli.serve import configure_logging
    from lbd.front.app import run_broker  # the whole broker: imported only by the verb

    overrides: dict[str, object] = {
        "broker.broker_id": args.broker_id,
        "front.addr": args.addr,
        "front.web_addr": args.web_addr,
        "front.sidecar_addr": args.sidecar,
        "front.storage_url": args.storage_url,
    }
    overrides.update(parse_sets(args.settings))
    settings = settings_from_args(args, overrides)
    configure_logging(settings.logging)
    return run_broker(settings)
