"""How ``lbd ctl`` shows answers: rich tables for people, JSON for scripts.

JSON is the protobuf message with its proto field names and every field present (zeros and empty
strings included), enums by name: stable for ``jq`` and for tests.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence

from google.protobuf import json_format
from google.protobuf.message import Message
from rich.table import Table
from rich.text import Text

from lbd.broker.lookups import status_code_of
from lbd.gen.v1 import lbd_pb2

_STATE_PREFIX = "BUNDLE_STATE_"
_LOAD_BAR_WIDTH = 24


def to_json(message: Message) -> str:
    """The message as indented JSON."""
    data = json_format.MessageToDict(
        message, always_print_fields_with_no_presence=True, preserving_proto_field_name=True
    )
    return json.dumps(data, indent=2)


def state_name(state: int) -> str:
    """A bundle state as DESIGN §4 writes it (``Owned``), from its protobuf enum value."""
    name: str = lbd_pb2.BundleState.Name(state)
    return name.removeprefix(_STATE_PREFIX).capitalize() if state else "-"


def fields_table(title: str, message: Message) -> Table:
    """A two-column table of a small response's fields (transfer, unload, split...)."""
    table = Table(title=title, show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for name, value in json_format.MessageToDict(
        message, always_print_fields_with_no_presence=True, preserving_proto_field_name=True
    ).items():
        shown = ", ".join(map(str, value)) if isinstance(value, list) else str(value)
        table.add_row(name, shown or "-")
    return table


def lookup_table(topic: str, r: lbd_pb2.LookupResponse) -> Table:
    """A lookup's answer."""
    table = Table(title=f"lookup {topic}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("bundle", r.bundle)
    table.add_row("state", state_name(r.state))
    table.add_row("owner", r.owner_broker_id or "-")
    table.add_row("service url", r.owner.service_url or "-")
    table.add_row("service url (tls)", r.owner.service_url_tls or "-")
    table.add_row("web service url", r.owner.web_service_url or "-")
    return table


def lookup_many_table(topics: Sequence[str], r: lbd_pb2.LookupManyResponse) -> Table:
    """Several lookups' answers, a row per topic in the order asked; a failed one says why."""
    table = Table(title=f"lookup of {len(topics)} topics")
    for column in ("topic", "bundle", "state", "owner", "service url"):
        table.add_column(column)
    for topic, result in zip(topics, r.results, strict=True):
        if result.HasField("failure"):
            code = status_code_of(result.failure.code).name
            failed = Text(f"{code}: {result.failure.message}", style="red")
            table.add_row(topic, failed, "", "", "")
            continue
        a = result.answer
        table.add_row(
            topic,
            a.bundle,
            state_name(a.state),
            a.owner_broker_id or "-",
            a.owner.service_url or "-",
        )
    return table


def brokers_table(r: lbd_pb2.ListBrokersResponse) -> Table:
    """Registered brokers, the leader marked, with their maintenance mode."""
    table = Table(title="brokers")
    columns = ("broker", "leader", "bundles", "maintenance", "service url", "sidecar", "version")
    for column in columns:
        table.add_column(column, justify="right" if column == "bundles" else "left")
    for b in sorted(r.brokers, key=lambda b: b.info.broker_id):
        table.add_row(
            b.info.broker_id,
            "*" if b.leader else "",
            str(b.owned_bundles),
            b.maintenance or "-",
            b.info.service_url,
            b.info.sidecar_grpc_addr,
            b.info.version,
        )
    return table


def bundles_table(r: lbd_pb2.ListBundlesResponse) -> Table:
    """Bundles with their state and brokers."""
    table = Table(title=f"bundles ({len(r.bundles)})")
    for column in ("bundle", "state", "owner", "source", "version"):
        table.add_column(column, justify="right" if column == "version" else "left")
    for b in sorted(r.bundles, key=lambda b: b.bundle):
        table.add_row(
            b.bundle,
            state_name(b.state),
            b.owner_broker_id or "-",
            b.source_broker_id or "-",
            str(b.version_id),
        )
    return table


def leader_table(r: lbd_pb2.GetLeaderResponse) -> Table:
    """The leader and its term."""
    table = Table(title="leader", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("broker", r.broker_id or "(none)")
    table.add_row("term", str(r.term))
    return table


def load_bar(load: float) -> Text:
    """A bar of ``load`` (0..1, clipped), red from 0.85 (the overloaded threshold) up."""
    filled = round(min(max(load, 0.0), 1.0) * _LOAD_BAR_WIDTH)
    style = "red" if load >= 0.85 else "yellow" if load >= 0.6 else "green"
    return Text("█" * filled + "·" * (_LOAD_BAR_WIDTH - filled), style=style)


def load_table(r: lbd_pb2.GetLoadResponse) -> Table:
    """Per-broker load with the cluster's average and standard deviation."""
    table = Table(title="load", caption=f"avg {r.avg:.3f}   std {r.std:.3f}")
    for column in ("broker", "load", "", "MB/s", "updated at (ms)"):
        table.add_column(column, justify="left" if column in ("broker", "") else "right")
    for b in sorted(r.brokers, key=lambda b: b.broker_id):
        table.add_row(
            b.broker_id,
            f"{b.load:.3f}",
            load_bar(b.load),
            f"{b.msg_throughput / 1e6:.2f}",
            str(b.updated_at_ms),
        )
    return table


def utc_time(ms: int) -> str:
    """Epoch milliseconds as an ISO-8601 UTC time to the millisecond (``...T13:00:00.000Z``)."""
    when = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def decisions_table(r: lbd_pb2.ListDecisionsResponse) -> Table:
    """Decisions, oldest first, with their reasons."""
    table = Table(title=f"decisions ({len(r.decisions)})")
    for column in ("at (UTC)", "kind", "bundle", "from", "to", "reason", "source", "operation"):
        # Times and bundle ids stay whole (copied into other commands); reasons wrap.
        table.add_column(column, no_wrap=column in ("at (UTC)", "bundle"))
    for d in r.decisions:
        table.add_row(
            utc_time(d.at_ms),
            d.kind,
            d.bundle,
            d.src_broker_id or "-",
            d.dst_broker_id or "-",
            d.reason,
            d.source,
            d.operation_id or "-",
        )
    return table


def audit_view(r: lbd_pb2.AuditResponse) -> Table | Text:
    """The safety auditor's findings, each with what to do; or that it found nothing, when it
    ran and what it checked."""
    if not r.checked_at_ms:
        return Text("no audit has run yet")
    checked = (
        f"audit at {utc_time(r.checked_at_ms)}: {r.bundles_checked} bundles checked, "
        f"{r.sidecars_compared} sidecar tables compared"
    )
    if not r.findings:
        return Text(f"no findings ({checked})", style="green")
    table = Table(title=f"audit: {len(r.findings)} finding(s)", caption=checked, show_lines=True)
    for column in ("kind", "bundle", "broker", "since (UTC)", "what is wrong / what to do"):
        table.add_column(column, no_wrap=column in ("bundle", "since (UTC)"))
    for f in r.findings:
        text = Text(f.detail)
        text.append("\ndo: ", style="bold").append(f.action)
        table.add_row(
            Text(f.kind, style="red"),
            f.bundle or "-",
            f.broker_id or "-",
            utc_time(f.since_ms),
            text,
        )
    return table


def rebalance_table(r: lbd_pb2.RebalanceResponse, *, dry_run: bool) -> Table:
    """The shedder's plan (kept for ``lbd ctl execute`` with ``dry_run``, else executing)."""
    verb = "planned" if dry_run else "executing"
    caption = f"avg {r.avg:.3f}   std {r.std:.3f}"
    if r.HasField("plan"):
        plan = r.plan
        caption = (
            f"plan {plan.id} ({plan.strategy}): std {plan.std_before:.3f} -> "
            f"{plan.std_after:.3f} predicted   {_mb(plan.bytes_to_move)} and "
            f"{plan.sessions_to_move} session(s) to move"
        )
        if dry_run:
            caption += (
                f"\nexecute it before {utc_time(plan.expires_at_ms)}: lbd ctl execute {plan.id}"
            )
    if r.operation_id:
        caption += f"\noperation {r.operation_id}: lbd ctl ops watch {r.operation_id}"
    if r.skip_reason:
        caption += f"   skipped: {r.skip_reason}"
    table = Table(title=f"rebalance: {len(r.decisions)} move(s) {verb}", caption=caption)
    for column in ("bundle", "from", "to", "reason", "traffic", "sessions"):
        table.add_column(column)
    moves = list(r.plan.moves) if r.HasField("plan") else []
    for i, d in enumerate(r.decisions):
        traffic = _mb(moves[i].msg_throughput) if i < len(moves) else "-"
        sessions = str(moves[i].sessions) if i < len(moves) else "-"
        table.add_row(
            d.bundle, d.src_broker_id, d.dst_broker_id or "(any)", d.reason, traffic, sessions
        )
    return table


def _mb(bytes_per_s: float) -> str:
    return f"{bytes_per_s / (1024 * 1024):.1f} MB/s"


_OP_PREFIX = "OPERATION_STATE_"
_MOVE_PREFIX = "MOVE_STATE_"


def operation_state(state: int) -> str:
    """An operation's state in lower case (``running``)."""
    return str(lbd_pb2.OperationState.Name(state)).removeprefix(_OP_PREFIX).lower()


def move_state(state: int) -> str:
    """A move's state in lower case (``in_flight``)."""
    return str(lbd_pb2.MoveState.Name(state)).removeprefix(_MOVE_PREFIX).lower()


def operations_table(r: lbd_pb2.ListOperationsResponse) -> Table:
    """The leader's operations, newest first."""
    table = Table(title=f"{len(r.operations)} operation(s)")
    for column in ("id", "kind", "state", "done", "left", "started (UTC)", "what"):
        table.add_column(column)
    for op in r.operations:
        table.add_row(
            op.id,
            op.kind,
            operation_state(op.state),
            str(op.moves_done),
            str(op.moves_left),
            utc_time(op.created_at_ms),
            op.description + (f" ({op.error})" if op.error else ""),
        )
    return table


def operation_table(op: lbd_pb2.Operation) -> Table:
    """One operation with every move and its progress."""
    ended = f", ended {utc_time(op.ended_at_ms)}" if op.ended_at_ms else ""
    caption = (
        f"{operation_state(op.state)}: {op.moves_done} done, {op.moves_left} left of "
        f"{len(op.moves)}; started {utc_time(op.created_at_ms)}{ended}"
    )
    if op.error:
        caption += f"\n{op.error}"
    table = Table(title=f"operation {op.id}: {op.description}", caption=caption)
    for column in ("bundle", "from", "to", "reason", "state", "unavailable", "note"):
        table.add_column(column)
    for m in op.moves:
        unavailable = f"{m.unavailable_ms:.0f} ms" if m.unavailable_ms >= 0 else "-"
        table.add_row(
            m.bundle,
            m.src_broker_id,
            m.dst_broker_id or "(any)",
            m.reason,
            move_state(m.state),
            unavailable,
            m.error,
        )
    return table


def operation_line(op: lbd_pb2.Operation) -> str:
    """One line of progress for ``--wait`` and ``ops watch``."""
    in_flight = sum(1 for m in op.moves if m.state == lbd_pb2.MOVE_STATE_IN_FLIGHT)
    return (
        f"{op.id}: {operation_state(op.state)}, {op.moves_done}/{len(op.moves)} done, "
        f"{in_flight} in flight, {op.moves_left} left" + (f" ({op.error})" if op.error else "")
    )
