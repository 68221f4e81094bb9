"""``lbd channel``: offline tools over the state channel (DESIGN §4).

``lbd channel replay FILE`` applies the conflict resolver to a channel written as JSON lines
(``{"key": bundle, "value": {...} | null}`` in channel order) and prints the resulting table, so an
operator can see what every sidecar materialises from that log, and with ``--explain`` why.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lbd.cli import channel_dump
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BundleId
from lbd.core.state import TOMBSTONE, to_json_object
from lbd.core.table import ChannelPosition, Outcome, StateTable

_LEDGER = 0
"""Ledger id of replayed positions; the line number is the entry id."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``channel`` verb group and its subcommands."""
    parser = sub.add_parser(
        "channel",
        help="offline tools over the state channel",
        description="Offline tools over the state channel.",
    )
    verbs = parser.add_subparsers(dest="channel_command", required=True)
    _register_replay(verbs)
    channel_dump.register(verbs)


def _register_replay(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    replay = verbs.add_parser(
        "replay",
        help="apply the conflict resolver to a channel dump and print the table",
        description=(
            'Apply the conflict resolver to FILE, JSON lines {"key": bundle, "value": '
            "{...} | null} in channel order, and print the resulting table as one JSON object "
            "{bundle: value}. Tombstoned bundles are absent."
        ),
    )
    replay.add_argument("file", metavar="FILE", type=Path, help="channel as JSON lines")
    replay.add_argument(
        "--skip-malformed",
        action="store_true",
        help="skip malformed lines with a warning instead of failing",
    )
    replay.add_argument(
        "--explain",
        action="store_true",
        help="print on stderr, for every line, whether it was accepted and why",
    )
    replay.set_defaults(func=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    """Replay ``args.file`` and print the table; InvalidInputError on malformed lines."""
    path: Path = args.file
    table = StateTable()
    problems: list[str] = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            key, value = _parse_line(raw)
        except InvalidInputError as e:
            problems.append(f"line {number}: {e}")
            continue
        result = table.apply(ChannelPosition(_LEDGER, number), key, value)
        if result.outcome is Outcome.MALFORMED:
            problems.append(f"line {number}: {result.reason}")
        elif args.explain:
            print(
                f"line {number}: {key}: {result.outcome.value}: {result.reason}",
                file=sys.stderr,
            )
    if problems and not args.skip_malformed:
        for problem in problems:
            print(f"{path}:{problem}", file=sys.stderr)
        raise InvalidInputError(
            f"{len(problems)} malformed line(s) in {path}; fix them or pass --skip-malformed"
        )
    for problem in problems:
        print(f"lbd: warning: {path}:{problem} (skipped)", file=sys.stderr)
    out = {bundle: to_json_object(data) for bundle, data in sorted(table.items())}
    print(json.dumps(out, indent=2))
    return 0


def _parse_line(raw: bytes) -> tuple[BundleId, bytes]:
    """The bundle and the raw channel value of one line of a channel file."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidInputError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise InvalidInputError('expected an object {"key": bundle, "value": {...} | null}')
    key = obj.get("key")
    if not isinstance(key, str) or not key.strip():
        raise InvalidInputError(f'"key" must be a non-empty string, got {key!r}')
    if "value" not in obj:
        raise InvalidInputError('missing "value" (null for a tombstone)')
    value = obj["value"]
    # The table decodes the value exactly as a sidecar reads it from the channel, and reports
    # a malformed one; only null (the tombstone) needs translating.
    return BundleId(key), TOMBSTONE if value is None else json.dumps(value).encode()
