"""``lbd config``: print the documented defaults, validate a settings file, show the effective
settings."""

from __future__ import annotations

import argparse
from pathlib import Path

from lbd.config import add_cluster_flags, load_settings, render_defaults, render_values
from lbd.config.flags import settings_from_args


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``config`` verb group."""
    parser = sub.add_parser(
        "config",
        help="settings: defaults, validate, show",
        description="Inspect and check lbd's settings (DESIGN §9).",
    )
    verbs = parser.add_subparsers(dest="config_command", metavar="VERB", required=True)

    defaults = verbs.add_parser(
        "defaults",
        help="print every key with its default and documentation, as TOML",
        description="Print a commented TOML file of every key with its default. It is valid as "
        "it is: start a settings file from it.",
    )
    defaults.set_defaults(func=_run_defaults)

    validate = verbs.add_parser(
        "validate",
        help="check a settings file; report every problem",
        description="Check FILE on its own (environment variables are not applied): types, "
        "ranges, unknown keys and cross-key rules. Prints 'FILE: OK' and exits 0, or lists "
        "every problem and exits 2.",
    )
    validate.add_argument("file", type=Path, metavar="FILE")
    validate.set_defaults(func=_run_validate)

    show = verbs.add_parser(
        "show",
        help="print the effective settings (file, environment and flags), secrets masked",
        description="Print the settings lbd would use: defaults, overridden by --config FILE, "
        "then LBD_* environment variables, then flags. Secrets are masked.",
    )
    add_cluster_flags(show)
    show.set_defaults(func=_run_show)


def _run_defaults(args: argparse.Namespace) -> int:
    print(render_defaults(), end="")
    return 0


def _run_validate(args: argparse.Namespace) -> int:
    load_settings(args.file, env={})
    print(f"{args.file}: OK")
    return 0


def _run_show(args: argparse.Namespace) -> int:
    print(render_values(settings_from_args(args)), end="")
    return 0
