"""The names a broker gives its consumers on storage (a Failover subscription's active consumer
is the one whose name sorts first)."""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from lbd.front.storage import REWIND_NAME, newest_first_name

_PRINTABLE = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=12)


def test_a_client_consumers_newer_storage_consumer_sorts_before_its_older_ones() -> None:
    older = newest_first_name("m")
    time.sleep(0.001)
    newer = newest_first_name("m")
    assert newer < older


@given(_PRINTABLE, _PRINTABLE)
def test_consumers_of_different_names_keep_the_order_of_their_names(a: str, b: str) -> None:
    if a != b:
        assert (newest_first_name(a) < newest_first_name(b)) == (a < b)


@given(_PRINTABLE)
def test_the_rewind_consumer_sorts_before_every_client_consumer(name: str) -> None:
    assert newest_first_name(name) > REWIND_NAME
