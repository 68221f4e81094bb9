"""What the clients' records say: failed, lost, duplicated and reordered messages, latency, gaps."""

from __future__ import annotations

from lbd.traffic.records import TrafficRecord, lost_sends, parse_payload, payload, summarize

MS = 1_000_000


def _record(sends: int = 5) -> TrafficRecord:
    record = TrafficRecord()
    p = record.add_producer("persistent://t/n/a")
    record.add_consumer("persistent://t/n/a")
    for seq in range(sends):
        send = record.sent(p, seq * 10 * MS)
        send.ended_ns = send.sent_ns + (seq + 1) * MS
    return record


def _deliver(record: TrafficRecord, seqs: list[int], at_ms: float = 100.0) -> None:
    for i, seq in enumerate(seqs):
        record.delivered(0, payload(0, seq, 64), int((at_ms + i) * MS), 0)


def test_a_payload_names_its_producer_and_sequence_and_has_its_size() -> None:
    body = payload(3, 1234, 100)
    assert len(body) == 100
    assert parse_payload(body) == (3, 1234)
    assert parse_payload(b"not ours") is None


def test_every_message_received_once_in_order_is_a_clean_run() -> None:
    record = _record()
    _deliver(record, [0, 1, 2, 3, 4])
    s = summarize(record)
    assert (s.sent, s.acknowledged, s.failed, s.lost, s.duplicates, s.reordered) == (
        5,
        5,
        0,
        0,
        0,
        0,
    )
    assert s.latency_max_ms == 5.0
    assert s.latency_p50_ms == 3.0


def test_an_acknowledged_message_never_received_is_lost() -> None:
    record = _record()
    _deliver(record, [0, 1, 3, 4])
    s = summarize(record)
    assert s.lost == 1
    assert s.lost_examples == ("persistent://t/n/a #2 (producer 0)",)


def test_the_lost_sends_are_the_acknowledged_ones_no_consumer_received() -> None:
    record = _record()
    record.producers[0].sends[1].error = "Timeout"  # failed, not lost
    record.producers[0].sends[4].ended_ns = None  # pending, not lost
    _deliver(record, [0, 3])
    assert lost_sends(record) == [(0, 2)]


def test_a_failed_send_is_not_lost_but_failed() -> None:
    record = _record()
    record.producers[0].sends[2].error = "Timeout"
    _deliver(record, [0, 1, 3, 4])
    s = summarize(record)
    assert (s.failed, s.lost, s.failures) == (1, 0, ("1 x Timeout",))


def test_a_second_delivery_is_a_duplicate_and_an_earlier_one_after_a_later_is_reordered() -> None:
    record = _record()
    _deliver(record, [0, 2, 1, 2, 3, 4])
    s = summarize(record)
    assert s.duplicates == 1
    assert s.reordered == 1


def test_a_duplicate_under_another_storage_id_was_stored_twice() -> None:
    record = _record()
    for seq, message_id in ((0, "1:0"), (1, "1:1"), (1, "1:1"), (2, "1:2"), (2, "2:0")):
        record.delivered(0, payload(0, seq, 64), 100 * MS, 0, message_id)
    s = summarize(record)
    assert (s.duplicates, s.stored_twice) == (2, 1)


def test_the_longest_gap_is_between_first_deliveries_of_a_topic() -> None:
    record = _record()
    record.delivered(0, payload(0, 0, 64), 100 * MS, 0)
    record.delivered(0, payload(0, 1, 64), 130 * MS, 0)
    record.delivered(0, payload(0, 1, 64), 900 * MS, 1)  # a duplicate: not a delivery gap
    record.delivered(0, payload(0, 2, 64), 400 * MS, 0)
    assert summarize(record).longest_gap_ms == 270.0


def test_a_window_judges_only_the_sends_made_in_it() -> None:
    record = _record()
    _deliver(record, [0, 1, 2, 3])  # 4 is lost
    early = summarize(record, since_ns=0, until_ns=25 * MS)  # sends 0, 1, 2
    assert (early.sent, early.lost) == (3, 0)
    late = summarize(record, since_ns=25 * MS)
    assert (late.sent, late.lost) == (2, 1)


def test_a_pending_send_is_neither_acknowledged_nor_lost() -> None:
    record = _record()
    record.producers[0].sends[4].ended_ns = None
    _deliver(record, [0, 1, 2, 3])
    s = summarize(record)
    assert (s.pending, s.lost, s.acknowledged) == (1, 0, 4)


def test_a_message_no_producer_of_the_record_sent_is_counted_apart() -> None:
    record = _record()
    record.delivered(0, b"stranger", 0, 0)
    record.delivered(0, payload(9, 0, 32), 0, 0)
    assert record.strangers == 2
