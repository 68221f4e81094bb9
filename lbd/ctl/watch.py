"""``lbd ctl watch``: a live view of the cluster as one sidecar sees it, refreshed every second.

Each refresh asks for the brokers, their load, the leader and the bundles. A call that fails
(a sidecar restarting, a leader being elected) is shown as an error line while the rest of the
view stays, and the next refresh tries again: the view is meant to be watched through failures.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from lbd.ctl.client import RpcFailure, SidecarClient
from lbd.ctl.render import load_bar, state_name
from lbd.gen.v1 import lbd_pb2

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class ClusterView:
    """One refresh: each part is None when its call failed, with the reason in ``errors``."""

    server: str
    brokers: lbd_pb2.ListBrokersResponse | None
    load: lbd_pb2.GetLoadResponse | None
    leader: lbd_pb2.GetLeaderResponse | None
    bundles: lbd_pb2.ListBundlesResponse | None
    errors: tuple[str, ...]
    fetched_at: str


def fetch(client: SidecarClient) -> ClusterView:
    """Ask the sidecar for everything the view shows; failures become ``errors``."""
    errors: list[str] = []

    def attempt(what: str, call: Callable[[], _T]) -> _T | None:
        try:
            return call()
        except RpcFailure as e:
            errors.append(f"{what}: {e}")
            return None

    return ClusterView(
        server=client.server,
        brokers=attempt("brokers", client.brokers),
        load=attempt("load", client.load),
        leader=attempt("leader", client.leader),
        bundles=attempt("bundles", client.bundles),
        errors=tuple(errors),
        fetched_at=time.strftime("%H:%M:%S"),
    )


def render(view: ClusterView) -> Group:
    """The view as a table of brokers and a few summary lines."""
    leader = view.leader.broker_id if view.leader is not None else None
    term = f" (term {view.leader.term})" if view.leader is not None else ""
    loads = {b.broker_id: b for b in view.load.brokers} if view.load is not None else {}
    owned: Counter[str] = Counter()
    states: Counter[str] = Counter()
    if view.bundles is not None:
        for bundle in view.bundles.bundles:
            states[state_name(bundle.state)] += 1
            if bundle.state == lbd_pb2.BUNDLE_STATE_OWNED:
                owned[bundle.owner_broker_id] += 1
    now_ms = int(time.time() * 1000)
    brokers = sorted(view.brokers.brokers, key=lambda b: b.info.broker_id) if view.brokers else []
    table = Table(
        title=f"lbd cluster via {view.server} · leader {leader or '?'}{term} · {view.fetched_at}",
        caption="Ctrl-C to stop",
    )
    for column in ("broker", "", "bundles", "load", "", "msg/s", "MB/s", "load updated"):
        table.add_column(
            column, justify="right" if column in ("bundles", "load", "msg/s", "MB/s") else "left"
        )
    for b in brokers:
        broker_id = b.info.broker_id
        load = loads.get(broker_id)
        table.add_row(
            broker_id,
            "leader" if broker_id == leader else "",
            str(owned.get(broker_id, b.owned_bundles)),
            f"{load.load:.3f}" if load is not None else "-",
            load_bar(load.load) if load is not None else Text("no load data", style="dim"),
            f"{load.msg_rate:,.0f}" if load is not None else "-",
            f"{load.msg_throughput / 1e6:.2f}" if load is not None else "-",
            _age(load.updated_at_ms, now_ms) if load is not None else "-",
        )
    lines: list[Text] = []
    if view.load is not None:
        lines.append(Text(f"load avg {view.load.avg:.3f}   std {view.load.std:.3f}"))
    if view.bundles is not None:
        summary = "   ".join(f"{state} {n}" for state, n in sorted(states.items()))
        lines.append(Text(f"bundles {len(view.bundles.bundles)}: {summary or 'none yet'}"))
    lines.extend(Text(error, style="red") for error in view.errors)
    return Group(table, *lines)


def watch(client: SidecarClient, console: Console, interval_s: float = 1.0) -> None:
    """Redraw the view every ``interval_s`` until Ctrl-C (KeyboardInterrupt ends it cleanly)."""
    try:
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                live.update(render(fetch(client)), refresh=True)
                time.sleep(interval_s)
    except KeyboardInterrupt:
        return


def _age(updated_at_ms: int, now_ms: int) -> str:
    """How long ago a load report was made, e.g. ``2s ago``."""
    return f"{max(0, now_ms - updated_at_ms) / 1000:.0f}s ago"
