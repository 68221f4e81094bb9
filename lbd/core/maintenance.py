"""A broker's maintenance record: cordoned, draining, decommissioning or decommissioned.

The value of ``maintenance/<broker_id>`` in the metadata store (JSON). It is not under any
session lease: a cordon outlives the broker's session and the sidecar that wrote it, so that a
restarted broker, a new leader and every sidecar see it. No record means "in service".

Every mode keeps new bundles off the broker (it is *cordoned*); the later ones say what else is
going on:

- ``cordoned``: new bundles go elsewhere; the broker keeps what it has;
- ``draining``: the leader moves every bundle off it (an operation under the execution governor);
- ``decommissioning``: draining, and once empty the broker is deregistered;
- ``decommissioned``: empty and deregistered; its own sidecar keeps it deregistered until the
  record is cleared (uncordon).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId

LEAVE_REASON_PREFIX = "leaving: "
"""The reason of a record a sidecar writes when its broker leaves gracefully (``LeaveRequest``):
such a record is the broker's own, and goes when the broker says Hello again."""


class MaintenanceMode(enum.StrEnum):
    """What a maintenance record says about its broker."""

    CORDONED = "cordoned"
    DRAINING = "draining"
    DECOMMISSIONING = "decommissioning"
    DECOMMISSIONED = "decommissioned"

    @property
    def draining(self) -> bool:
        """Whether the leader should be moving the broker's bundles off it."""
        return self in (MaintenanceMode.DRAINING, MaintenanceMode.DECOMMISSIONING)


@dataclass(frozen=True, slots=True)
class MaintenanceRecord:
    """One broker's maintenance: its mode, why, since when and who set it."""

    broker: BrokerId
    mode: MaintenanceMode
    reason: str = ""
    since_ms: int = 0
    """Epoch milliseconds at which this mode was set."""
    who: str = ""
    """The sidecar (broker id) that wrote the record."""

    @property
    def leave(self) -> bool:
        """Whether the broker's own graceful leave wrote this record (not an operator)."""
        return self.reason.startswith(LEAVE_REASON_PREFIX)

    def describe(self) -> str:
        """``cordoned by broker-0 (reason: disk swap)``: for error messages and logs."""
        why = f" (reason: {self.reason})" if self.reason else ""
        by = f" by {self.who}" if self.who else ""
        return f"{self.mode.value}{by}{why}"

    def to_json(self) -> bytes:
        """The stored JSON value (every field present; the broker is the key's)."""
        return json.dumps(
            {
                "mode": self.mode.value,
                "reason": self.reason,
                "since_ms": self.since_ms,
                "who": self.who,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, broker: BrokerId, raw: bytes | str) -> MaintenanceRecord:
        """Read the stored value of ``maintenance/<broker>``; InvalidInputError naming what is
        wrong."""
        try:
            data: Any = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidInputError(f"maintenance record of {broker}: not JSON: {e}") from None
        if not isinstance(data, dict):
            raise InvalidInputError(f"maintenance record of {broker}: not a JSON object")
        try:
            mode = MaintenanceMode(str(data.get("mode")))
        except ValueError:
            modes = ", ".join(m.value for m in MaintenanceMode)
            raise InvalidInputError(
                f"maintenance record of {broker}: mode {data.get('mode')!r} is not one of {modes}"
            ) from None
        reason, who, since = data.get("reason", ""), data.get("who", ""), data.get("since_ms", 0)
        if not isinstance(reason, str) or not isinstance(who, str):
            raise InvalidInputError(f"maintenance record of {broker}: reason and who are strings")
        if not isinstance(since, int) or isinstance(since, bool) or since < 0:
            raise InvalidInputError(
                f"maintenance record of {broker}: since_ms must be an integer >= 0, got {since!r}"
            )
        return cls(broker, mode, reason, since, who)
