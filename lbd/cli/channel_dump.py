"""``lbd channel dump --out FILE``: the live state channel as JSON lines (DESIGN §4).

Reads the channel from its start to its end as of the call and writes one line per message,
``{"key": bundle, "value": {...} | null}``, in channel order: the input of ``lbd channel replay``.
A value is written as the channel holds it (unknown fields kept); an empty value (a tombstone) as
null; a value that is not a JSON object as a string, so that ``replay`` reports it as the
followers did. The file is written whole or not at all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TextIO

from lbd.adapters.pulsar_channel import PulsarChannelLog
from lbd.adapters.pulsar_client import PulsarConnection
from lbd.config import Settings, add_cluster_flags, settings_from_args


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lbd channel dump`` to the ``channel`` verb group."""
    dump = verbs.add_parser(
        "dump",
        help="write the live state channel as JSON lines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    dump.add_argument("--out", required=True, metavar="FILE", help="output file ('-': stdout)")
    add_cluster_flags(dump)
    # The Pulsar client can abort the process as it exits (lbd.cli.main): the dump is written.
    dump.set_defaults(func=run, exit_at_once=True)


def run(args: argparse.Namespace) -> int:
    """Dump the channel of the configured cluster into ``--out``."""
    settings = settings_from_args(args)
    if args.out == "-":
        count = asyncio.run(dump(settings, sys.stdout, keep=True))
    else:
        count = _dump_to_file(settings, Path(args.out))
    print(f"dumped {count} messages from {settings.pulsar.state_channel_topic}", file=sys.stderr)
    return 0


def _dump_to_file(settings: Settings, out: Path) -> int:
    directory = out.parent if str(out.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            count = asyncio.run(dump(settings, f, keep=True))
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return count


_CLOSED: list[PulsarConnection] = []
"""The command's closed connections, never destroyed: the process ends with os._exit (lbd.cli.main)
before their C++ clients' destructors could run, where the abort at exit happens."""


async def dump(settings: Settings, out: TextIO, *, keep: bool = False) -> int:
    """Write every message of the channel up to its current end; return how many. ``keep``: the
    closed connection is kept referenced for the rest of the process (the command line's)."""
    connection = PulsarConnection.from_settings(settings.pulsar)
    log = PulsarChannelLog(connection, settings.pulsar.state_channel_topic)
    count = 0
    try:
        async for message in log.catch_up(None):
            out.write(json.dumps({"key": message.key, "value": _value(message.value)}) + "\n")
            count += 1
    finally:
        await log.close()
        await connection.close()
        if keep:
            _CLOSED.append(connection)
    return count


def _value(raw: bytes) -> object:
    if not raw:
        return None
    try:
        decoded = json.loads(raw)
    except ValueError:
        decoded = None
    if isinstance(decoded, dict):
        return decoded
    return raw.decode("utf-8", errors="replace")
