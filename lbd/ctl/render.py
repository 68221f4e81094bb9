"""How ``lbd ctl`` shows answers: rich tables for people, JSON for scripts.

JSON is the protobuf message with its proto field names and every field present (zeros and empty
strings included), enums by name: stable for ``jq`` and for tests.
"""

from __future__ import annotations

import json

from google.protobuf import json_format
from google.protobuf.message import Message
from rich.table import Table
from rich.text import Text

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


def brokers_table(r: lbd_pb2.ListBrokersResponse) -> Table:
    """Registered brokers, the leader marked."""
    table = Table(title="brokers")
    for column in ("broker", "leader", "bundles", "service url", "sidecar", "version"):
        table.add_column(column, justify="right" if column == "bundles" else "left")
    for b in sorted(r.brokers, key=lambda b: b.info.broker_id):
        table.add_row(
            b.info.broker_id,
            "*" if b.leader else "",
            str(b.owned_bundles),
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


def rebalance_table(r: lbd_pb2.RebalanceResponse, *, dry_run: bool) -> Table:
    """The shedder's decisions (proposed only, with ``dry_run``)."""
    verb = "proposed" if dry_run else "carried out"
    caption = f"avg {r.avg:.3f}   std {r.std:.3f}"
    if r.skip_reason:
        caption += f"   skipped: {r.skip_reason}"
    table = Table(title=f"rebalance: {len(r.decisions)} decision(s) {verb}", caption=caption)
    for column in ("bundle", "from", "to", "reason"):
        table.add_column(column)
    for d in r.decisions:
        table.add_row(d.bundle, d.src_broker_id, d.dst_broker_id or "(any)", d.reason)
    return table
