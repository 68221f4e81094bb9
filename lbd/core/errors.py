"""Errors of the pure core.

Every error a user can cause carries a message that says what is wrong, so that the CLI and the
gRPC layer can show it as is (CLI: a one-line error and a non-zero exit; gRPC: INVALID_ARGUMENT).
"""


class LbdError(Exception):
    """Base of every error lbd raises on purpose; its message is meant for a human."""


class InvalidInputError(LbdError, ValueError):
    """Input (a name, a file, a request field) is malformed; the message names what and why."""


class NotFoundError(LbdError, LookupError):
    """A named thing (bundle, broker, namespace) does not exist."""


class PreconditionError(LbdError):
    """The request is well formed but the current state does not allow it."""


class DeadlineError(LbdError):
    """An operation did not settle before its deadline (e.g. an assignment still in flight)."""
