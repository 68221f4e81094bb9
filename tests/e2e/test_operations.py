"""Plans and operations end to end on a dev cluster with traffic: plan, execute, track, cancel,
with ``lbd ctl`` and the gRPC API, and no bundle ever served by two brokers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from lbd.devcluster.cluster import TRAFFIC_NAMESPACE
from lbd.gen.v1 import lbd_pb2
from tests.e2e.clusters import Cluster, serving_overlaps, start_cluster, stop_cluster, wait_for

pytestmark = [pytest.mark.servers, pytest.mark.timeout(240)]

SETTLE_S = 30.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three simulated brokers with synthetic traffic (a load the plan can be told to fix,
    whatever the machine does); no automatic shedding (only what a test executes moves), and
    a governor that moves one bundle at a time."""
    running = start_cluster(
        tmp_path_factory.mktemp("dev"),
        3,
        "operations.auto_shedding=false",
        "governor.balancing_cluster=1",
        traffic=True,
        sim_brokers=True,
    )
    try:
        yield running
    finally:
        stop_cluster(running)


def pile_on(cluster: Cluster, broker: str) -> None:
    """Move every bundle of the traffic namespace to ``broker`` and wait until the load reports
    show it carrying all of the traffic."""
    client = cluster.client(timeout_s=60)
    for bundle, owner in sorted(cluster.owners(TRAFFIC_NAMESPACE).items()):
        if owner != broker:
            client.transfer(bundle, broker)

    def skewed() -> bool | None:
        loads = {b.broker_id: b for b in client.load().brokers}
        total = sum(b.msg_throughput for b in loads.values())
        if len(loads) == 3 and total > 0 and loads[broker].msg_throughput >= 0.8 * total:
            return True
        return None

    wait_for(f"the load reports show {broker} carrying most traffic", skewed, SETTLE_S)


def plan_of(
    cluster: Cluster, moves: int, seen: list[dict[str, Any]] | None = None
) -> dict[str, Any] | None:
    """``lbd ctl plan``'s plan when it has at least ``moves`` moves (else None: the shedder
    skipped, e.g. in the cool-down after a plan was executed). Every answer goes to ``seen``."""
    shown = cluster.ctl("--output", "json", "plan")
    assert shown.returncode == 0, shown.stderr
    answer: dict[str, Any] = json.loads(shown.stdout)
    if seen is not None:
        seen.append(answer)
    plan: dict[str, Any] = answer.get("plan", {})
    return plan if len(plan.get("moves", [])) >= moves else None


def test_plan_then_execute_then_cancel_leaves_the_in_flight_move_done(cluster: Cluster) -> None:
    hot = cluster.broker_ids[0]
    pile_on(cluster, hot)
    client = cluster.client(timeout_s=60)

    # The plan, with lbd ctl: moves with reasons, std now and predicted, nothing moved. (Until
    # every broker's report shows the pile-up, the planner may see less to move.)
    before = cluster.owners(TRAFFIC_NAMESPACE)

    seen: list[dict[str, Any]] = []  # what the shedder said, should it never plan two moves
    try:
        planned = wait_for(
            "a plan of at least two moves", lambda: plan_of(cluster, 2, seen), SETTLE_S, 1.0
        )
    except AssertionError as e:
        raise AssertionError(f"{e}; the last answer of `lbd ctl plan`: {seen[-1:]}") from None
    assert planned["std_after"] < planned["std_before"]
    assert all(m["src_broker_id"] == hot for m in planned["moves"])
    assert planned["bytes_to_move"] > 0 and planned["expires_at_ms"] > planned["created_at_ms"]
    assert cluster.owners(TRAFFIC_NAMESPACE) == before

    # Execute it and cancel at once: one move at a time, so the first finishes, none other starts.
    op = client.execute(planned["id"])
    cancelled = client.cancel_operation(op.id)
    assert cancelled.state in (
        lbd_pb2.OPERATION_STATE_CANCELLING,
        lbd_pb2.OPERATION_STATE_CANCELLED,
    )
    ended = list(client.watch_operation(op.id, timeout_s=SETTLE_S))[-1]
    assert ended.state == lbd_pb2.OPERATION_STATE_CANCELLED, ended
    states = [m.state for m in ended.moves]
    assert lbd_pb2.MOVE_STATE_FAILED not in states
    # No move still waiting when the cancel was taken starts after it. The cancel's answer says
    # which had started (on a busy machine a second may have, between the two calls); one more
    # may have had its governor slot and not be in flight yet (one move at a time: at most one).
    started = sum(1 for m in cancelled.moves if m.state != lbd_pb2.MOVE_STATE_PENDING)
    assert states.count(lbd_pb2.MOVE_STATE_DONE) <= started + 1, (cancelled, ended)
    # Every other move is cancelled (none, when the plan has no move past those: a plan of two
    # whose second had started, or had its slot, when the cancel came).
    assert states.count(lbd_pb2.MOVE_STATE_CANCELLED) >= len(states) - started - 1, ended
    owners = cluster.owners(TRAFFIC_NAMESPACE)
    for move in ended.moves:
        expected = move.dst_broker_id if move.state == lbd_pb2.MOVE_STATE_DONE else hot
        assert owners.get(move.bundle) == expected, (move, ended)

    # The plan ran once: executing it again is refused, naming the plan.
    again = cluster.ctl("execute", planned["id"])
    assert again.returncode != 0 and "NOT_FOUND" in again.stderr and planned["id"] in again.stderr

    # A new plan (once the executed one's cool-down is over), executed to the end with lbd ctl,
    # and tracked by ops list / get.
    plan_id = wait_for("a new plan", lambda: plan_of(cluster, 1), SETTLE_S, 1.0)["id"]
    done = cluster.ctl("execute", plan_id, "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "succeeded" in done.stdout
    listed = cluster.ctl("--output", "json", "ops", "list")
    ops = json.loads(listed.stdout)["operations"]
    mine = next(o for o in ops if o["plan_id"] == plan_id)
    assert mine["state"] == "OPERATION_STATE_SUCCEEDED"
    assert mine["moves_left"] == 0 and mine["moves_done"] == len(mine["moves"])
    assert any(o["id"] == op.id and o["state"] == "OPERATION_STATE_CANCELLED" for o in ops)
    got = client.operation(mine["id"])
    for move in got.moves:
        assert move.unavailable_ms >= 0 and move.ended_at_ms >= move.started_at_ms > 0
        assert cluster.owners(TRAFFIC_NAMESPACE)[move.bundle] == move.dst_broker_id
    # Every move is in the decision log with its reason and operation.
    decisions = client.decisions().decisions
    logged = {(d.bundle, d.operation_id) for d in decisions if d.source == "plan"}
    assert {(m.bundle, got.id) for m in got.moves} <= logged


def test_an_admin_transfer_is_an_operation_of_the_leader(cluster: Cluster) -> None:
    leader = cluster.client().leader().broker_id
    follower = next(b for b in cluster.broker_ids if b != leader)
    owners = cluster.owners(TRAFFIC_NAMESPACE)
    bundle, owner = sorted(owners.items())[0]
    dst = next(b for b in cluster.broker_ids if b != owner)
    # Asked of a follower: forwarded to the leader, run under its governor.
    done = cluster.client(follower).transfer(bundle, dst)
    assert (done.src_broker_id, done.dst_broker_id) == (owner, dst)
    ops = cluster.client(follower).operations().operations
    admin = next(o for o in ops if o.kind == "admin" and o.moves[0].bundle == bundle)
    assert admin.state == lbd_pb2.OPERATION_STATE_SUCCEEDED
    assert admin.moves[0].unavailable_ms >= 0


def test_no_two_brokers_ever_served_a_bundle_at_once(cluster: Cluster) -> None:
    assert serving_overlaps(cluster) == []
