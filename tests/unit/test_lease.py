"""The broker's serving lease (lbd.core.lease): counted from the request's send time."""

from __future__ import annotations

import pytest

from lbd.core.broker_info import LeaseRequest, ServingLease
from lbd.core.errors import InvalidInputError
from lbd.core.lease import BrokerLease


def test_a_lease_runs_from_when_its_request_was_sent_not_from_its_arrival() -> None:
    lease = BrokerLease()
    request = lease.request(now=100.0)
    assert request == LeaseRequest(1, 0)
    assert lease.grant(ServingLease(1, 10_000), now=104.0)  # answered 4 s late
    assert lease.valid_until == 110.0
    assert lease.valid(109.9) and not lease.valid(110.0)


def test_a_grant_that_arrives_after_its_lease_would_have_ended_extends_nothing() -> None:
    lease = BrokerLease()
    lease.request(now=0.0)
    # A paused broker (or sidecar) reads the answer 30 s later: it is worth nothing now.
    assert not lease.grant(ServingLease(1, 10_000), now=30.0)
    assert not lease.valid(30.0)


def test_only_answers_to_requests_sent_count_and_older_ones_are_forgotten() -> None:
    lease = BrokerLease()
    lease.request(now=0.0)
    lease.request(now=2.0)
    assert not lease.grant(ServingLease(7, 10_000), now=2.5)  # never asked
    assert lease.grant(ServingLease(2, 10_000), now=2.5)
    assert lease.valid_until == 12.0
    assert not lease.grant(ServingLease(1, 10_000), now=2.6)  # superseded by the answer to 2
    assert lease.valid_until == 12.0


def test_a_renewal_never_shortens_the_lease() -> None:
    lease = BrokerLease()
    lease.request(now=0.0)
    lease.grant(ServingLease(1, 10_000), now=0.1)
    lease.request(now=1.0)
    lease.grant(ServingLease(2, 1_000), now=1.1)
    assert lease.valid_until == 10.0


def test_a_lapse_is_noted_once_and_counted_in_the_next_requests() -> None:
    lease = BrokerLease()
    lease.request(now=0.0)
    lease.grant(ServingLease(1, 1_000), now=0.1)
    assert not lease.lapse_if_due(0.5)
    assert lease.lapse_if_due(1.0)
    assert not lease.lapse_if_due(1.5)
    assert lease.lapses == 1 and lease.valid_until is None
    assert lease.request(now=2.0) == LeaseRequest(2, 1)


def test_a_request_outside_its_domain_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="sequence must be >= 1"):
        LeaseRequest(0)


def test_a_lease_that_ran_out_is_renewed_only_after_its_lapse_is_noted() -> None:
    # A broker paused past its lease reads a fresh grant before its own lease check: the grant
    # must not revive the lease, or the broker would serve on with what it owned before.
    lease = BrokerLease()
    lease.request(now=0.0)
    lease.grant(ServingLease(1, 1_000), now=0.1)
    lease.request(now=5.0)
    assert not lease.grant(ServingLease(2, 10_000), now=5.1)
    assert not lease.valid(5.1)
    assert lease.lapse_if_due(5.2) and lease.lapses == 1
    lease.request(now=5.3)
    assert lease.grant(ServingLease(3, 10_000), now=5.4)
    assert lease.valid(5.4)
