"""Network partitions of a dev cluster under real client traffic, one scenario at a time.

Each scenario cuts (or makes flaky) some links of one broker's host (:mod:`lbd.devcluster.links`)
for a while, then restores them, as a window of :class:`~lbd.devcluster.disruptions.ClientHarness`:
the clients' own records give what the window cost them (failed sends, lost and duplicated
messages), and the harness measures how long after the links returned every bundle was Owned by a
registered broker again with every sidecar listing every broker. The chaos suite asserts on the
figures; ``python -m bench.partitions_bench`` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lbd.devcluster.disruptions import ClientHarness, _retry
from lbd.devcluster.links import Mode

Victim = Literal["busiest", "follower", "leader"]
Kind = Literal["etcd", "channel", "sidecar", "storage"]


@dataclass(frozen=True, slots=True)
class Partition:
    """One scenario: which of the victim's links, how, and for how long."""

    name: str
    links: tuple[Kind, ...]
    seconds: float
    victim: Victim = "busiest"
    """``busiest``: the broker with the most traffic topics; ``follower``: the busiest one that
    does not lead; ``leader``: the leader's."""
    mode: Mode = "cut"

    def link_names(self, broker: str) -> list[str]:
        return [f"{broker}/{kind}" for kind in self.links]


SCENARIOS = (
    Partition("sidecar cut from etcd", ("etcd",), 60.0, "follower"),
    Partition("sidecar cut from the channel", ("channel",), 60.0, "follower"),
    Partition("broker cut from its sidecar", ("sidecar",), 30.0),
    Partition("leader cut from the channel", ("channel",), 30.0, "leader"),
    Partition("host split from the servers", ("etcd", "channel", "storage"), 30.0, "follower"),
    Partition("flaky links", ("etcd", "channel", "sidecar"), 30.0, "follower", "flaky"),
)
"""What the issue of real partitions asks for: a sidecar cut from etcd only and from the channel
only for a minute, a broker cut from its sidecar, the leader cut from the channel (the others
read nothing it writes), a host split from the servers (a cluster cut in two, the servers on the
other side), and links that stall every other second."""


def run(harness: ClientHarness, scenario: Partition, *, scale: float = 1.0) -> None:
    """Run one scenario as a window of ``harness`` (``scale`` shortens its duration)."""
    if scenario.victim == "busiest":
        victim = harness.busiest_broker()
    else:
        leader = _retry(lambda: harness.client().leader()).broker_id
        victim = leader if scenario.victim == "leader" else harness.busiest_broker(avoid=leader)
    harness.partition(
        scenario.name,
        scenario.link_names,
        scenario.seconds * scale,
        victim=victim,
        mode=scenario.mode,
    )
