"""The service-unit state machine, its channel value and the conflict resolver (DESIGN §4), in
three parts: the states and the value (:mod:`~lbd.core.state.states`), the value's JSON codec
(:mod:`~lbd.core.state.codec`) and the resolver every sidecar applies the channel with
(:mod:`~lbd.core.state.resolver`). The names every caller uses are importable from here."""

from lbd.core.state.codec import (
    FIELDS,
    TOMBSTONE,
    decode_value,
    encode_value,
    from_json_object,
    to_json_object,
)
from lbd.core.state.resolver import MAX_TERM_JUMP, Rule, Verdict, resolve
from lbd.core.state.states import (
    ALLOWED_TRANSITIONS,
    INT64_MAX,
    LISTED_SPLIT_CHILDREN,
    MAX_BROKER_ID_CHARS,
    MAX_SPLIT_CHILDREN,
    MAX_VALUE_BYTES,
    ServiceUnitState,
    ServiceUnitStateData,
    holder,
    is_allowed_transition,
    owner_of,
    server_of,
    state_of,
)

__all__ = [
    "ALLOWED_TRANSITIONS",
    "FIELDS",
    "INT64_MAX",
    "LISTED_SPLIT_CHILDREN",
    "MAX_BROKER_ID_CHARS",
    "MAX_SPLIT_CHILDREN",
    "MAX_TERM_JUMP",
    "MAX_VALUE_BYTES",
    "TOMBSTONE",
    "Rule",
    "ServiceUnitState",
    "ServiceUnitStateData",
    "Verdict",
    "decode_value",
    "encode_value",
    "from_json_object",
    "holder",
    "is_allowed_transition",
    "owner_of",
    "resolve",
    "server_of",
    "state_of",
    "to_json_object",
]
