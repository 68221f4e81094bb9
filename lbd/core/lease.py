"""The broker's serving lease, as the broker keeps it (DESIGN §5, docs/safety.md).

A broker may serve bundles only while it holds an unexpired lease from its sidecar. It asks with
a :class:`~lbd.core.broker_info.LeaseRequest` and the sidecar answers, while it can vouch for the
broker's ownership, with a :class:`~lbd.core.broker_info.ServingLease` for the same sequence number.
The lease runs for ``duration`` from when the broker **sent** that request, on the broker's own
monotonic clock: a grant that was delayed (a paused sidecar, a paused broker reading it late, a
slow network) therefore never lasts longer than the sidecar meant, and the sidecar can bound the
end of every lease it granted by ``answer time + duration`` without sharing a clock with the
broker.

When the lease runs out the broker stops serving everything and forgets what it was told to
own: it serves again only bundles it is told to Own after a new lease, and a lease that ran out
is renewed only once the broker has noted the lapse. Each lapse increments
:attr:`BrokerLease.lapses`, which every request carries, so that the sidecar learns that the
broker dropped its bundles even when it never saw the lease run out.
"""

from __future__ import annotations

from lbd.core.broker_info import LeaseRequest, ServingLease


class BrokerLease:
    """The broker side of the serving lease; times are seconds of one monotonic clock."""

    def __init__(self) -> None:
        self._sequence = 0
        self._sent: dict[int, float] = {}
        self._valid_until: float | None = None
        self.lapses = 0
        """How often a lease ran out (or was never granted in time) in this session."""

    @property
    def valid_until(self) -> float | None:
        """When the lease runs out (None: never granted, or run out)."""
        return self._valid_until

    def valid(self, now: float) -> bool:
        """Whether the broker may serve at ``now``."""
        return self._valid_until is not None and now < self._valid_until

    def request(self, now: float) -> LeaseRequest:
        """The next request, sent at ``now``."""
        self._sequence += 1
        self._sent[self._sequence] = now
        return LeaseRequest(self._sequence, self.lapses)

    def grant(self, lease: ServingLease, now: float) -> bool:
        """Take the sidecar's answer; whether it extended the lease. A grant for a request this
        broker did not send, or already superseded, extends nothing; nor does one that finds
        the lease run out but its lapse not yet noted (a broker that was paused reads the grant
        and its own lease check at once): the broker must first drop everything
        (:meth:`lapse_if_due`), or it would serve on with what it was told before the lapse."""
        if self._valid_until is not None and now >= self._valid_until:
            return False
        sent = self._sent.get(lease.sequence)
        if sent is None:
            return False
        for sequence in [s for s in self._sent if s <= lease.sequence]:
            del self._sent[sequence]
        until = sent + lease.duration_ms / 1000
        if until <= now:
            return False
        if self._valid_until is None or until > self._valid_until:
            self._valid_until = until
        return True

    def lapse_if_due(self, now: float) -> bool:
        """Note that the lease ran out, once; True when it just did (the broker must then stop
        serving everything)."""
        if self._valid_until is None or now < self._valid_until:
            return False
        self._valid_until = None
        self.lapses += 1
        return True
