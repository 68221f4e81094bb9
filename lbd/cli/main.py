"""Entry point of the ``lbd`` console script.

Each verb group lives in its own module exposing ``register(subparsers)``; the parser it adds sets
``func`` to a callable taking the parsed arguments and returning the exit code. Errors lbd raises on
purpose (:class:`~lbd.core.errors.LbdError`) and unreadable files end in one line on stderr and a
non-zero exit, never a traceback.

A verb whose parser sets ``exit_at_once`` (one that used a Pulsar client and then returns, such as
``lbd channel dump``) ends the console script's process with :func:`os._exit` once its output and
logs are flushed: the Pulsar client's C++ threads, torn down as the interpreter exits, abort the
process now and then ("terminate called without an active exception", about one run in forty)
after the verb has done all its work.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from lbd import __version__
from lbd.cli import (
    analytics,
    auth,
    bench,
    broker,
    channel,
    config_cmd,
    ctl,
    demo,
    dev,
    load,
    serve,
    shed,
    sim,
)
from lbd.core.errors import InvalidInputError, LbdError

EXIT_FAILURE = 1
EXIT_USAGE = 2

_GROUPS = (
    serve,
    broker,
    ctl,
    dev,
    load,
    sim,
    shed,
    bench,
    channel,
    config_cmd,
    auth,
    demo,
    analytics,
)


def build_parser() -> argparse.ArgumentParser:
    """The full ``lbd`` parser with every verb group registered."""
    parser = argparse.ArgumentParser(
        prog="lbd", description="Load-balancer sidecar for Pulsar-style message brokers."
    )
    parser.add_argument("--version", action="version", version=f"lbd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in _GROUPS:
        group.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run the chosen verb and return its exit code."""
    return _run(build_parser().parse_args(argv))


def entry() -> NoReturn:
    """The ``lbd`` console script: :func:`main` on the command line, then exit with its code (at
    once, for a verb that sets ``exit_at_once``)."""
    args = build_parser().parse_args()
    code = _run(args)
    if getattr(args, "exit_at_once", False):
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # closed, or a broken pipe
                stream.flush()
        os._exit(code)
    sys.exit(code)


def _run(args: argparse.Namespace) -> int:
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except InvalidInputError as e:
        print(f"lbd: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except LbdError as e:
        print(f"lbd: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        print(f"lbd: error: {e.strerror or e}{where}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    entry()
