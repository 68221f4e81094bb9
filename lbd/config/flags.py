"""The flags every cluster-talking command shares (DESIGN §9), and settings built from them."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from lbd.config.loader import load_settings
from lbd.config.schema import Settings


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--config``, ``--pulsar-url``, ``--etcd-endpoints`` and ``--cluster`` to ``parser``."""
    group = parser.add_argument_group("cluster settings")
    group.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="TOML settings file (see `lbd config defaults`)",
    )
    group.add_argument(
        "--pulsar-url", metavar="URL", help="Pulsar service URL (env LBD_PULSAR_URL)"
    )
    group.add_argument(
        "--etcd-endpoints",
        metavar="URL[,URL]",
        help="etcd client URLs, comma-separated (env LBD_ETCD_ENDPOINTS)",
    )
    group.add_argument("--cluster", metavar="NAME", help="cluster name (env LBD_CLUSTER)")


def settings_from_args(
    args: argparse.Namespace,
    overrides: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Settings from the flags of :func:`add_cluster_flags`, the environment (None: the process
    environment) and the file. ``overrides`` (dotted ``section.key`` -> value, None = not given)
    carries a command's own flags, such as ``lbd serve --broker-id``; they win over the rest."""
    flags: dict[str, object] = {
        "pulsar.service_url": args.pulsar_url,
        "etcd.endpoints": args.etcd_endpoints,
        "cluster.name": args.cluster,
    }
    flags.update(overrides or {})
    return load_settings(args.config, env=env, overrides=flags)
