"""Exceptions every adapter raises for the same conditions, whatever system is behind it."""

from lbd.core.errors import LbdError, PreconditionError


class UnavailableError(LbdError):
    """The outside system (etcd, Pulsar) could not be reached or did not answer in time.

    Retrying later may succeed; nothing is known to have been written unless the operation is
    documented as idempotent. The gRPC layer maps it to ``UNAVAILABLE``.
    """


class CasConflictError(PreconditionError):
    """A compare-and-swap lost: the record changed since the revision the caller read."""

    def __init__(self, key: str, expected: int, actual: int | None) -> None:
        self.key = key
        self.expected = expected
        self.actual = actual
        now = "absent" if actual is None else f"at revision {actual}"
        super().__init__(f"{key}: expected revision {expected}, but it is {now}")


class SessionExpiredError(LbdError):
    """The metadata session ended for good: the lease was lost and, by the configured policy
    (``etcd.session_expired_policy = shutdown``), not replaced. The daemon must stop."""
