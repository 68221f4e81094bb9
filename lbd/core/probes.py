"""Named probes on the rare branches the safety argument rests on (docs/safety.md).

``probe("orphan.handover")`` marks that a run reached that branch. Outside a simulation nothing
records: a probe is a global lookup and a comparison. The simulation records the probes each seed
reached (:func:`recording`), and ``lbd sim check`` prints how many seeds reached each one and
fails when a probe of :data:`REQUIRED` was reached by fewer than its share of the seeds: a
change that stopped the faults from reaching a path the argument counts on would otherwise still
look green (as FoundationDB's simulation reports the code it reached).

Every probe is in :data:`PROBES`, with the branch it marks; a seed that reaches a name not in it
fails (a misspelt probe would otherwise never be counted), and a test checks that every probe
named in the code is listed and every listed probe is named in the code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Final

PROBES: Final[dict[str, str]] = {
    # The fence (docs/safety.md, "The grounds to vouch").
    "fence.enter": "a sidecar fenced its broker: neither the lease nor the channel ground held",
    "fence.exit": "a fenced sidecar unfenced: a ground holds again",
    "fence.channel_only": "a sidecar vouched on the channel read barrier alone, its lease ground "
    "lapsed",
    "fence.read_since_lease": "the lease ground held back until a read barrier begun after the "
    "new lease or registration completed",
    "grant.withheld": "a serving lease was not granted: the broker may serve a bundle the table "
    "does not name it server of, or announces away from it",
    # The broker's serving lease.
    "lease.lapse_reported": "a broker reported that its serving lease ran out; its sidecar counts "
    "it serving nothing",
    "lease.wait_out": "a sidecar waited for its broker's serving lease to run out",
    "release.ack_timeout": "a Release the broker did not acknowledge in time: the move goes on "
    "once the lease ran out",
    "own.in_doubt": "an Own whose outcome is in doubt (refused, not acknowledged, a lapse or a "
    "fence meanwhile) was followed by a Close",
    "own.reoffer": "a bundle Owned by a broker that did not serve it was offered to it again",
    "own.overlap_blocked": "a bundle was not taken while another broker serves part of its range",
    # Orphans (docs/safety.md, "Orphans").
    "orphan.grace_kept": "a gone broker registered again within the orphan grace and kept its "
    "bundles",
    "orphan.announce": "the leader announced an orphan's move (a forced Releasing from it)",
    "orphan.wait": "an announced orphan waited for the hand-over wait to end",
    "orphan.handover": "the leader handed an announced orphan over (a forced Assigning) once the "
    "hand-over wait ended",
    "orphan.returned": "an announced orphan's broker was registered again when its wait ended: "
    "no hand-over, its sidecar finishes the move",
    "orphan.self_release": "a sidecar released a bundle the leader announced away from it",
    # Stuck in-flight states.
    "inflight.undo": "a stuck Releasing or Splitting went back to Owned by its source",
    "inflight.reassign": "a stuck Assigning was moved on from its destination (a Releasing)",
    "split.finish": "a split left half done was finished as Deleted (a child exists)",
    "split.rolled_back": "an admin split ended because the leader rolled the stuck split back",
    # Leader terms (docs/safety.md, "Leader terms").
    "term.adopt": "a new leader leads above the channel's higher term (H + T)",
    "term.stale_rejected": "a forced write from a deposed leader's term was rejected",
    "monitor.deposed": "the leader's monitor stopped: the channel shows a higher term",
    # The resolver and the channel.
    "resolver.server_change": "rule 8 rejected a value that would make a second broker server",
    "resolver.version_gap": "a value skipped versions (its reader missed messages)",
    "channel.duplicate": "a follower skipped a message delivered again",
    # Brokers that go quiet.
    "silence.deregister": "a sidecar deregistered its silent broker: its bundles follow the "
    "orphan path",
}
"""Every probe, with the branch it marks."""

REQUIRED: Final[dict[str, float]] = {
    # Share of seeds 1..500 that reached it at the time of writing, in the comment. Each bound
    # lies five standard deviations of 500 seeds below that share, less a tenth, so that a
    # moving set of 500 other seeds meets it by chance all but never; one reached by a few
    # percent needs one seed in 500. Probes reached by fewer than ten of the 500 are not
    # required (docs/simulation.md says which faults would reach them).
    "fence.channel_only": 0.85,  # 100.0%
    "orphan.announce": 0.85,  # 98.8%
    "fence.read_since_lease": 0.8,  # 98.2%
    "lease.lapse_reported": 0.8,  # 98.2%
    "orphan.wait": 0.75,  # 95.4%
    "fence.enter": 0.75,  # 94.0%
    "fence.exit": 0.75,  # 93.6%
    "orphan.handover": 0.7,  # 91.8%
    "orphan.self_release": 0.6,  # 84.2%
    "silence.deregister": 0.5,  # 73.4%
    "channel.duplicate": 0.5,  # 71.2%
    "lease.wait_out": 0.3,  # 52.2%
    "release.ack_timeout": 0.3,  # 52.2%
    "orphan.grace_kept": 0.2,  # 36.0%
    "own.in_doubt": 0.02,  # 9.2%
    "own.reoffer": 0.015,  # 8.0%
    "inflight.undo": 0.002,  # 4.0%
    "inflight.reassign": 0.002,  # 3.2%
    "term.adopt": 0.002,  # 2.2%
}
"""The probes a clean ``lbd sim check`` of at least :data:`REQUIRED_FROM_SEEDS` seeds of the
default world must have reached, each in at least this share of its seeds: the faults must keep
reaching them."""

REQUIRED_FROM_SEEDS: Final = 500
"""Fewer seeds say too little about a share (a probe one seed in fifty reaches is missed by a
hundred seeds one time in eight): their probe counts are printed, not judged. CI's two sets of
the simulation are 500 seeds each."""

_hits: set[str] | None = None


def probe(name: str) -> None:
    """Mark that the branch ``name`` (a key of :data:`PROBES`) was reached."""
    if _hits is not None:
        _hits.add(name)


def unknown(hits: set[str]) -> list[str]:
    """The names among ``hits`` that are not probes of :data:`PROBES`, sorted."""
    return sorted(hits - PROBES.keys())


@contextlib.contextmanager
def recording() -> Iterator[set[str]]:
    """Record the probes reached inside the block, in the set it yields (one run at a time:
    the simulation runs one seed per process)."""
    global _hits
    saved, hits = _hits, set[str]()
    _hits = hits
    try:
        yield hits
    finally:
        _hits = saved
