"""``lbd ctl``: operate a running cluster through one sidecar's gRPC API.

Any sidecar will do: calls that need the leader or a bundle's owner are forwarded by the sidecar.
Answers are tables by default and JSON with ``--output json``; a failed call prints
``lbd: error: <STATUS>: <message>`` and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from google.protobuf.message import Message
from rich.console import Console, RenderableType

from lbd.broker.credentials import ClientCredentials
from lbd.core.errors import InvalidInputError, LbdError
from lbd.ctl import render
from lbd.ctl.client import DEFAULT_TIMEOUT_S, SidecarClient
from lbd.ctl.decisions import merge, parse_since
from lbd.ctl.watch import watch
from lbd.gen.v1 import lbd_pb2
from lbd.history.reader import read_decisions

TOKEN_ENV = "LBD_GRPC__ADMIN_TOKEN"
"""The admin token of the sidecars' own settings, used when no other token is given."""
CREDENTIAL_FLAGS = {
    "tls_ca": ("--tls-ca", "LBD_CTL_TLS_CA", "CA file: speak TLS, trust sidecars it signed"),
    "tls_cert": ("--tls-cert", "LBD_CTL_TLS_CERT", "client certificate file (mutual TLS)"),
    "tls_key": ("--tls-key", "LBD_CTL_TLS_KEY", "key file of --tls-cert"),
    "token": ("--token", "LBD_CTL_TOKEN", f"bearer token (else env {TOKEN_ENV})"),
    "token_file": ("--token-file", "LBD_CTL_TOKEN_FILE", "file holding the bearer token"),
}
"""Destination -> flag, environment variable and help of how a client proves who it is."""
WATCH_TIMEOUT_S = 2.0
"""Deadline of each call of the live view: a hung sidecar must not freeze the screen."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lbd ctl`` and its verbs."""
    p = sub.add_parser(
        "ctl", help="operate a running cluster through a sidecar", description=__doc__
    )
    p.add_argument("--server", required=True, metavar="HOST:PORT", help="a sidecar's gRPC address")
    add_credential_flags(p)
    p.add_argument("--output", choices=("table", "json"), default="table")
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"deadline of each call in seconds (default {DEFAULT_TIMEOUT_S:g})",
    )
    verbs = p.add_subparsers(dest="ctl_command", metavar="VERB", required=True)

    v = verbs.add_parser(
        "lookup",
        help="topics' bundles and owners (assigns them if needed); several in one LookupMany",
    )
    v.add_argument("topic", nargs="+")
    v.add_argument("--read-only", action="store_true", help="never start an assignment")
    verbs.add_parser("brokers", help="registered brokers")
    v = verbs.add_parser("bundles", help="bundles with their state and owner")
    v.add_argument("--namespace", default="", metavar="NS", help="only this tenant/namespace")
    verbs.add_parser("leader", help="the leader and its term")
    verbs.add_parser(
        "health", help="the sidecar's health (exit 0 only when SERVING; a probe over TLS)"
    )
    verbs.add_parser("load", help="per-broker load, average and standard deviation")
    v = verbs.add_parser("assign", help="assign a bundle (or a topic's bundle)")
    v.add_argument("target", metavar="BUNDLE|TOPIC")
    v.add_argument("--dst", metavar="BROKER", help="where to assign (default: the strategy picks)")
    v = verbs.add_parser("transfer", help="move an owned bundle to another broker")
    v.add_argument("bundle")
    v.add_argument("dst", metavar="DST_BROKER")
    v = verbs.add_parser("unload", help="free an owned bundle (the next lookup re-assigns it)")
    v.add_argument("bundle")
    v = verbs.add_parser("split", help="split an owned bundle")
    v.add_argument("bundle")
    v.add_argument("--algorithm", default="", metavar="A", help="default: range_equally_divide")
    v.add_argument(
        "--boundaries",
        type=parse_boundaries,
        default=[],
        metavar="0x..,0x..",
        help="split points for specified_positions_divide",
    )
    v = verbs.add_parser("rebalance", help="plan now and execute the plan (an operation)")
    v.add_argument(
        "--dry-run", action="store_true", help="only plan, move nothing (the same as `plan`)"
    )
    verbs.add_parser(
        "plan", help="plan a rebalance: moves, std before and predicted after (lbd ctl execute)"
    )
    v = verbs.add_parser("execute", help="execute a plan (from `lbd ctl plan`)")
    v.add_argument("plan_id", metavar="PLAN_ID")
    v.add_argument("--wait", action="store_true", help="follow the operation until it ends")
    ops = verbs.add_parser("ops", help="the leader's operations: list, get, watch, cancel")
    ops_verbs = ops.add_subparsers(dest="ops_command", metavar="OPS_VERB", required=True)
    v = ops_verbs.add_parser("list", help="operations, newest first")
    v.add_argument("--active", action="store_true", help="only those still running")
    v = ops_verbs.add_parser("get", help="one operation with every move")
    v.add_argument("op_id", metavar="OP_ID")
    v = ops_verbs.add_parser("watch", help="follow an operation until it ends")
    v.add_argument("op_id", metavar="OP_ID")
    v = ops_verbs.add_parser("cancel", help="stop scheduling its moves (in-flight ones finish)")
    v.add_argument("op_id", metavar="OP_ID")
    v = verbs.add_parser("snapshot", help="the leader's load snapshot as a scenario file")
    v.add_argument("--out", type=Path, metavar="FILE", help="write here (default: stdout)")
    verbs.add_parser(
        "audit", help="the leader's safety auditor's findings, each with what to do about it"
    )
    v = verbs.add_parser("decisions", help="the leader's recent decisions and their reasons")
    v.add_argument(
        "--since",
        type=since_arg,
        default=0,
        metavar="DURATION|TIME",
        help="only decisions since then: a duration back from now (30s, 10m, 2h, 1d) or an "
        "ISO-8601 time (UTC unless it has an offset); default: every one kept",
    )
    v.add_argument(
        "--limit", type=int, default=0, metavar="N", help="only the newest N (default: all)"
    )
    v.add_argument(
        "--history",
        metavar="URI",
        help="also read the decisions of the Parquet history at URI (history.uri), which "
        "keeps more than the leader",
    )
    v = verbs.add_parser("create-namespace", help="create a namespace")
    v.add_argument("namespace", metavar="NS")
    v.add_argument("--bundles", type=int, default=0, metavar="N", help="default: the sidecar's")
    v = verbs.add_parser("cordon", help="keep new bundles off a broker (it keeps its own)")
    v.add_argument("broker", metavar="BROKER")
    v.add_argument("--reason", default="", metavar="R", help="why (shown with the record)")
    v = verbs.add_parser("uncordon", help="put a broker back in service (stops its drain)")
    v.add_argument("broker", metavar="BROKER")
    v = verbs.add_parser("drain", help="cordon a broker and move every bundle off it")
    v.add_argument("broker", metavar="BROKER")
    v.add_argument("--wait", action="store_true", help="follow the operation until it ends")
    v = verbs.add_parser("decommission", help="drain a broker, then deregister it for good")
    v.add_argument("broker", metavar="BROKER")
    v.add_argument("--wait", action="store_true", help="follow the operation until it ends")
    verbs.add_parser("watch", help="a live view of the cluster until Ctrl-C")
    p.set_defaults(func=run)


def parse_boundaries(text: str) -> list[int]:
    """``0x10000000,0x20000000`` (hex with 0x, or decimal) -> the hash values."""
    points: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = int(part, 16) if part.lower().startswith("0x") else int(part, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not a hash value (0x followed by hex digits, or decimal)"
            ) from None
        if not 0 <= value <= 0xFFFFFFFF:
            raise argparse.ArgumentTypeError(f"{part} is outside the hash space 0..0xffffffff")
        points.append(value)
    return points


def since_arg(text: str) -> int:
    """``--since`` as epoch milliseconds (see :func:`lbd.ctl.decisions.parse_since`)."""
    try:
        return parse_since(text, time.time_ns() // 1_000_000)
    except InvalidInputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_credential_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of :data:`CREDENTIAL_FLAGS`, each defaulting to its environment variable."""
    for dest, (flag, env, text) in CREDENTIAL_FLAGS.items():
        metavar = "FILE" if "file" in text else "T"
        parser.add_argument(flag, dest=dest, metavar=metavar, help=f"{text} (env {env})")


def credentials_from(args: argparse.Namespace) -> ClientCredentials:
    """The client credentials the flags (or their environment variables) name."""

    def given(dest: str) -> str | None:
        value = getattr(args, dest, None)
        return value if value is not None else os.environ.get(CREDENTIAL_FLAGS[dest][1]) or None

    def path(dest: str) -> Path | None:
        value = given(dest)
        return None if value is None else Path(value)

    token = given("token")
    token_file = path("token_file")
    if token is None and token_file is None:
        token = os.environ.get(TOKEN_ENV) or None
    try:
        return ClientCredentials(
            ca_file=path("tls_ca"),
            cert_file=path("tls_cert"),
            key_file=path("tls_key"),
            token=token,
            token_file=token_file,
        )
    except InvalidInputError as e:
        flags = ", ".join(flag for flag, _, _ in CREDENTIAL_FLAGS.values())
        raise InvalidInputError(f"{e} ({flags})") from None


def run(args: argparse.Namespace) -> int:
    """Run one ``lbd ctl`` verb."""
    if args.timeout <= 0:
        raise InvalidInputError(f"--timeout must be > 0 seconds, got {args.timeout}")
    credentials = credentials_from(args)
    console = Console()
    timeout = WATCH_TIMEOUT_S if args.ctl_command == "watch" else args.timeout
    with SidecarClient(args.server, credentials=credentials, timeout_s=timeout) as client:
        if args.ctl_command == "watch":
            watch(client, console)
            return 0
        if args.ctl_command == "snapshot":
            return _snapshot(client, args.out)
        if args.ctl_command == "ops" and args.ops_command == "watch":
            return follow_operation(client, args.op_id, console, json_lines=args.output == "json")
        if args.ctl_command == "execute" and args.wait:
            op = client.execute(args.plan_id)
            return follow_operation(client, op.id, console, json_lines=args.output == "json")
        if args.ctl_command in ("drain", "decommission") and args.wait:
            op = _MAINTENANCE_OPS[args.ctl_command](client, args.broker)
            return follow_operation(client, op.id, console, json_lines=args.output == "json")
        if args.ctl_command == "health":
            status = client.health()
            print(status)
            return 0 if status == "SERVING" else 1
        message, table = _VERBS[args.ctl_command](client, args)
    if args.output == "json":
        print(render.to_json(message))
    else:
        console.print(table)
    return 1 if _some_lookup_failed(message) else 0


def _some_lookup_failed(message: Message) -> bool:
    """Whether ``message`` is the answer to several lookups of which one failed: the exit status
    is then 1, as for a single lookup that failed."""
    return isinstance(message, lbd_pb2.LookupManyResponse) and any(
        r.HasField("failure") for r in message.results
    )


_Shown = tuple[Message, RenderableType]


def _lookup(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    if len(a.topic) == 1:
        (topic,) = a.topic
        r = c.lookup(topic, read_only=a.read_only)
        return r, render.lookup_table(topic, r)
    many = c.lookup_many(a.topic, read_only=a.read_only)
    return many, render.lookup_many_table(a.topic, many)


def _brokers(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    r = c.brokers()
    return r, render.brokers_table(r)


def _bundles(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    r = c.bundles(a.namespace)
    return r, render.bundles_table(r)


def _audit(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    r = c.audit()
    return r, render.audit_view(r)


def _leader(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    r = c.leader()
    return r, render.leader_table(r)


def _load(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    r = c.load()
    return r, render.load_table(r)


def _assign(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    r = c.assign(a.target, a.dst)
    return r, render.fields_table("assigned", r)


def _transfer(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    r = c.transfer(a.bundle, a.dst)
    return r, render.fields_table("transferred", r)


def _unload(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    r = c.unload(a.bundle)
    return r, render.fields_table("unloaded", r)


def _split(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    r = c.split(a.bundle, a.algorithm, a.boundaries)
    return r, render.fields_table("split", r)


def _rebalance(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    r = c.rebalance(dry_run=a.dry_run)
    return r, render.rebalance_table(r, dry_run=a.dry_run)


def _plan(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    r = c.rebalance(dry_run=True)
    return r, render.rebalance_table(r, dry_run=True)


def _execute(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    r = c.execute(a.plan_id)
    return r, render.operation_table(r)


def _ops(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    if a.ops_command == "list":
        listed = c.operations(active_only=a.active)
        return listed, render.operations_table(listed)
    op = c.cancel_operation(a.op_id) if a.ops_command == "cancel" else c.operation(a.op_id)
    return op, render.operation_table(op)


def follow_operation(
    client: SidecarClient, op_id: str, console: Console, *, json_lines: bool = False
) -> int:
    """Print an operation's progress until it ends; 0 when it succeeded, else 1."""
    last: lbd_pb2.Operation | None = None
    for op in client.watch_operation(op_id):
        last = op
        if json_lines:
            print(render.to_json(op).replace("\n", ""), flush=True)
        else:
            console.print(render.operation_line(op))
    if last is None:
        raise LbdError(f"the leader sent nothing about operation {op_id}")
    if not json_lines:
        console.print(render.operation_table(last))
    return 0 if last.state == lbd_pb2.OPERATION_STATE_SUCCEEDED else 1


def _decisions(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    if a.limit < 0:
        raise InvalidInputError(f"--limit must be >= 0 (0: all), got {a.limit}")
    r = c.decisions(a.since, a.limit)
    if a.history is not None:
        r = merge(r.decisions, read_decisions(a.history, since_ms=a.since), a.limit)
    return r, render.decisions_table(r)


def _cordon(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    r = c.cordon(a.broker, a.reason)
    return r, render.fields_table("cordoned", r)


def _uncordon(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    r = c.uncordon(a.broker)
    return r, render.fields_table("uncordoned", r)


_MAINTENANCE_OPS: dict[str, Callable[[SidecarClient, str], lbd_pb2.Operation]] = {
    "drain": SidecarClient.drain,
    "decommission": SidecarClient.decommission,
}


def _maintenance_op(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    r = _MAINTENANCE_OPS[a.ctl_command](c, a.broker)
    return r, render.operation_table(r)


def _create_namespace(c: SidecarClient, a: argparse.Namespace) -> _Shown:
    if a.bundles < 0:
        raise InvalidInputError(f"--bundles must be >= 1 (or 0 for the default), got {a.bundles}")
    r = c.create_namespace(a.namespace, a.bundles)
    return r, render.fields_table("namespace created", r)


_VERBS: dict[str, Callable[[SidecarClient, argparse.Namespace], _Shown]] = {
    "audit": _audit,
    "lookup": _lookup,
    "brokers": _brokers,
    "bundles": _bundles,
    "leader": _leader,
    "load": _load,
    "assign": _assign,
    "transfer": _transfer,
    "unload": _unload,
    "split": _split,
    "rebalance": _rebalance,
    "plan": _plan,
    "execute": _execute,
    "ops": _ops,
    "decisions": _decisions,
    "create-namespace": _create_namespace,
    "cordon": _cordon,
    "uncordon": _uncordon,
    "drain": _maintenance_op,
    "decommission": _maintenance_op,
}


def _snapshot(client: SidecarClient, out: Path | None) -> int:
    text = client.snapshot().scenario_json
    try:
        scenario = json.dumps(json.loads(text), indent=2) + "\n"
    except json.JSONDecodeError as e:
        raise LbdError(f"the sidecar sent a snapshot that is not JSON: {e.msg}") from None
    if out is None:
        sys.stdout.write(scenario)
    else:
        out.write_text(scenario, encoding="utf-8")
        print(f"wrote the cluster's load snapshot to {out} (try: lbd shed --scenario {out})")
    return 0
