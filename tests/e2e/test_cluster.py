"""End to end on a 3-broker dev cluster: lookups, transfer, unload, split, bad requests.

Each test works in a namespace of its own, so the tests do not disturb each other; the last one
checks, over everything the module did, that no two brokers ever served a bundle at once.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from lbd.core.bundles import NamespaceBundles, parse_bundle_id
from lbd.core.names import NamespaceName
from lbd.ctl.client import RpcFailure
from lbd.gen.v1 import lbd_pb2
from tests.e2e.clusters import (
    Cluster,
    grpcurl_binary,
    serving_overlaps,
    start_cluster,
    stop_cluster,
    wait_for,
)

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]

SETTLE_S = 10.0
README = Path(__file__).resolve().parents[2] / "README.md"


def lookup_owner(cluster: Cluster, topic: str, via: str | None = None) -> tuple[str, str]:
    r = cluster.client(via).lookup(topic)
    return r.bundle, r.owner_broker_id


def test_concurrent_lookups_of_a_new_topic_all_name_the_same_owner(cluster: Cluster) -> None:
    cluster.client().create_namespace("e2e/race", 4)
    topic = "persistent://e2e/race/contended"
    stubs = [cluster.stub(b) for b in cluster.broker_ids]

    def lookup(i: int) -> tuple[str, str, int]:
        r = stubs[i % len(stubs)].Lookup(lbd_pb2.LookupRequest(topic=topic), timeout=30)
        return r.bundle, r.owner_broker_id, r.state

    with ThreadPoolExecutor(max_workers=100) as pool:
        answers = list(pool.map(lookup, range(100)))
    assert len(set(answers)) == 1, Counter(answers)
    bundle, owner, state = answers[0]
    assert owner in cluster.broker_ids
    assert state == lbd_pb2.BUNDLE_STATE_OWNED
    assert bundle == NamespaceBundles.default(NamespaceName("e2e", "race"), 4).find(topic).id


def test_lookups_of_many_topics_spread_bundles_over_every_broker(tmp_path: Path) -> None:
    # A cluster of its own, with no traffic yet, whose placement counts no broker's load as far
    # enough under the average to take a burst alone (assignment.load_margin=1): least-usage
    # placement (Pulsar's too) sends a burst to the brokers at least load_margin (0.10 by default)
    # under the average when there are any, and the load a broker of a dev cluster reports is its
    # own process's CPU and memory, which a busy machine moves by more than that between two
    # reports (CI saw all 64 bundles on broker-1 after a wait for even loads, and 51, 11 and 2
    # before that wait).
    cluster = start_cluster(tmp_path, 3, "shedding.interval_s=3600", "assignment.load_margin=1")
    try:
        _spread_lookups(cluster)
    finally:
        stop_cluster(cluster)


def _spread_lookups(cluster: Cluster) -> None:
    # Each sidecar places the bundles of the lookups it answers by its own view: the burst waits
    # until every sidecar knows every broker's load.
    def reported() -> bool | None:
        views = [cluster.client(b).load().brokers for b in cluster.broker_ids]
        return True if all(len(v) == len(cluster.broker_ids) for v in views) else None

    wait_for("every broker's load reported to every sidecar", reported, 60)
    cluster.client().create_namespace("e2e/spread", 64)
    layout = NamespaceBundles.default(NamespaceName("e2e", "spread"), 64)
    topics = [f"persistent://e2e/spread/t-{i}" for i in range(1000)]
    stubs = [cluster.stub(b) for b in cluster.broker_ids]

    def lookup(i: int) -> lbd_pb2.LookupResponse:
        return stubs[i % len(stubs)].Lookup(lbd_pb2.LookupRequest(topic=topics[i]), timeout=30)

    with ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(lookup, range(len(topics))))
    owner_of: dict[str, set[str]] = {}
    for topic, answer in zip(topics, answers, strict=True):
        assert answer.bundle == layout.find(topic).id
        owner_of.setdefault(answer.bundle, set()).add(answer.owner_broker_id)
    assert all(len(owners) == 1 for owners in owner_of.values()), "one bundle, two owners"
    per_broker = Counter(next(iter(o)) for o in owner_of.values())
    assert set(per_broker) == set(cluster.broker_ids), per_broker
    assert min(per_broker.values()) >= 5, per_broker
    # Every sidecar materialises the same table.
    views = [cluster.owners("e2e/spread", via=b) for b in cluster.broker_ids]
    expected = {bundle: next(iter(o)) for bundle, o in owner_of.items()}
    for view in views:
        assert {b: o for b, o in view.items() if b in expected} == expected


def test_transfer_with_grpcurl_releases_on_the_source_before_the_destination_owns(
    cluster: Cluster,
) -> None:
    cluster.client().create_namespace("e2e/move", 4)
    bundle, src = lookup_owner(cluster, "persistent://e2e/move/a")
    dst = next(b for b in cluster.broker_ids if b != src)
    request = json.dumps({"bundle": bundle, "dst_broker_id": dst})
    done = subprocess.run(
        [
            grpcurl_binary(),
            *cluster.grpcurl_flags(),
            "-d",
            request,
            cluster.addr(),
            "lbd.v1.Admin/Transfer",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer == {"bundle": bundle, "src_broker_id": src, "dst_broker_id": dst}

    for via in cluster.broker_ids:
        wait_for(
            f"{via} answers {dst}",
            lambda via=via: lookup_owner(cluster, "persistent://e2e/move/a", via)[1] == dst or None,
            SETTLE_S,
        )
    events = [e for e in cluster.events() if e["bundle"] == bundle]
    released = [e for e in events if e["event"] == "release" and e["broker"] == src]
    owned = [e for e in events if e["event"] == "own" and e["broker"] == dst]
    assert released and owned, events
    assert released[-1]["t_ns"] < owned[-1]["t_ns"]  # type: ignore[operator]
    assert released[-1]["new_owner"] == dst


def test_unload_frees_the_bundle_and_the_next_lookup_assigns_it_again(cluster: Cluster) -> None:
    cluster.client().create_namespace("e2e/unload", 4)
    topic = "persistent://e2e/unload/a"
    bundle, src = lookup_owner(cluster, topic)
    done = cluster.ctl("--output", "json", "unload", bundle)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"bundle": bundle, "src_broker_id": src}

    def state() -> int:
        (info,) = [b for b in cluster.client().bundles("e2e/unload").bundles if b.bundle == bundle]
        return info.state

    wait_for("the bundle is Free", lambda: state() == lbd_pb2.BUNDLE_STATE_FREE or None, SETTLE_S)
    assert any(
        e["event"] == "release" and e["bundle"] == bundle and e["broker"] == src
        for e in cluster.events()
    )
    again, owner = lookup_owner(cluster, topic, via=cluster.broker_ids[-1])
    assert again == bundle and owner in cluster.broker_ids
    # The lookup answered at another sidecar; the first one's table follows the channel a moment
    # later (seen in CI: still Assigning when asked at once).
    wait_for("the bundle Owned again", lambda: state() == lbd_pb2.BUNDLE_STATE_OWNED or None, 10)


def test_split_gives_two_children_owned_by_the_parent_s_owner(cluster: Cluster) -> None:
    cluster.client().create_namespace("e2e/split", 4)
    bundle, owner = lookup_owner(cluster, "persistent://e2e/split/a")
    via = next(b for b in cluster.broker_ids if b != owner)  # forwarded to the owner's sidecar
    done = cluster.ctl("--server", cluster.addr(via), "--output", "json", "split", bundle)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    parent = parse_bundle_id(bundle).range
    mid = parent.lo + (parent.hi - parent.lo) // 2
    children = [
        f"e2e/split/0x{parent.lo:08x}_0x{mid:08x}",
        f"e2e/split/0x{mid:08x}_0x{parent.hi:08x}",
    ]
    assert answer == {"parent": bundle, "children": children, "owner_broker_id": owner}

    # Every sidecar's ListBundles, not only the owner's, shows the new layout.
    for sidecar in cluster.broker_ids:
        seen: dict[str, str] = {}

        def listed(sidecar: str = sidecar, seen: dict[str, str] = seen) -> bool | None:
            seen.clear()
            seen.update(cluster.owners("e2e/split", via=sidecar))
            return (all(seen.get(c) == owner for c in children) and bundle not in seen) or None

        try:
            wait_for(f"{sidecar}'s ListBundles shows both children", listed, SETTLE_S)
        except AssertionError as e:
            raise AssertionError(f"{e}; it lists these Owned bundles: {seen}") from None
    owned_children = {
        e["bundle"] for e in cluster.events() if e["event"] == "own" and e["broker"] == owner
    }
    assert set(children) <= owned_children
    # A topic of the split range now looks up to one of the children.
    assert lookup_owner(cluster, "persistent://e2e/split/a")[0] in children


@pytest.fixture(scope="module")
def bad_namespace(cluster: Cluster) -> tuple[str, str]:
    """A namespace with one owned bundle for the bad requests: (bundle, owner)."""
    cluster.client().create_namespace("e2e/bad", 4)
    return lookup_owner(cluster, "persistent://e2e/bad/a")


@pytest.mark.parametrize(
    ("call", "code", "words"),
    [
        ("lookup-malformed", grpc.StatusCode.INVALID_ARGUMENT, "invalid topic name"),
        ("unload-unknown-bundle", grpc.StatusCode.NOT_FOUND, "0x00000000_0x00000010"),
        ("transfer-unknown-broker", grpc.StatusCode.NOT_FOUND, "broker-99"),
        ("transfer-to-owner", grpc.StatusCode.FAILED_PRECONDITION, "already owned by"),
        ("split-bad-boundaries", grpc.StatusCode.INVALID_ARGUMENT, "not strictly inside"),
        ("split-unknown-algorithm", grpc.StatusCode.INVALID_ARGUMENT, "no_such_algorithm"),
    ],
)
def test_bad_requests_get_their_status_and_a_clear_message_and_change_nothing(
    cluster: Cluster, bad_namespace: tuple[str, str], call: str, code: grpc.StatusCode, words: str
) -> None:
    ns = "e2e/bad"
    client = cluster.client()
    bundle, owner = bad_namespace
    before = sorted(
        (b.bundle, b.state, b.owner_broker_id, b.version_id) for b in client.bundles(ns).bundles
    )
    with pytest.raises(RpcFailure) as failed:
        if call == "lookup-malformed":
            client.lookup("persistent://e2e/bad")
        elif call == "unload-unknown-bundle":
            client.unload("e2e/bad/0x00000000_0x00000010")
        elif call == "transfer-unknown-broker":
            client.transfer(bundle, "broker-99")
        elif call == "transfer-to-owner":
            client.transfer(bundle, owner)
        elif call == "split-bad-boundaries":
            # The bundle's own lower bound is not strictly inside it.
            client.split(bundle, "specified_positions_divide", [parse_bundle_id(bundle).range.lo])
        else:
            client.split(bundle, "no_such_algorithm", [])
    assert failed.value.code == code, failed.value
    assert words in failed.value.details
    after = sorted(
        (b.bundle, b.state, b.owner_broker_id, b.version_id) for b in client.bundles(ns).bundles
    )
    assert after == before


def test_ctl_prints_status_errors_as_one_line(cluster: Cluster) -> None:
    done = cluster.ctl("lookup", "not-a-topic")
    assert done.returncode == 1
    assert done.stderr.startswith("lbd: error: INVALID_ARGUMENT: invalid topic name")
    assert "Traceback" not in done.stderr


def readme_grpcurl_lines() -> list[str]:
    """The grpcurl commands of the README's "Local cluster" section, in order."""
    text = README.read_text()
    section = text.split("## Local cluster", 1)[1].split("\n## ", 1)[0]
    lines: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", section, flags=re.S):
        joined = block.replace("\\\n", " ")
        lines.extend(
            line.strip() for line in joined.splitlines() if line.strip().startswith("grpcurl ")
        )
    return lines


def test_the_readme_grpcurl_examples_work_as_written(cluster: Cluster) -> None:
    lines = readme_grpcurl_lines()
    assert len(lines) >= 6, lines
    grpcurl_dir = str(Path(grpcurl_binary()).parent)
    tls = " ".join(shlex.quote(f) for f in cluster.grpcurl_flags())
    for line in lines:
        done = subprocess.run(
            ["bash", "-c", line.replace("-plaintext", tls)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={"S": cluster.addr(), "PATH": f"{grpcurl_dir}:/usr/bin:/bin"},
        )
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        json.loads(done.stdout)


def test_no_two_brokers_ever_served_a_bundle_at_once(cluster: Cluster) -> None:
    assert cluster.events(), "the brokers logged nothing"
    assert serving_overlaps(cluster) == []
