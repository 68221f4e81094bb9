"""The frame codec against frames the official client and a Pulsar server really exchanged
(``captured_frames.jsonl``, made by ``scripts/capture_frames.py``), and against any bytes at all."""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbd.front import wire
from lbd.front.wire import Command, FrameDecoder, FrameError, Type
from lbd.gen.pulsar import pulsar_api_pb2 as api

CAPTURED = [
    json.loads(line)
    for line in (Path(__file__).parent / "captured_frames.jsonl").read_text().splitlines()
]


def test_the_capture_has_every_command_a_producer_consumer_and_reader_use() -> None:
    kinds = {f["type"] for f in CAPTURED}
    assert {
        "CONNECT",
        "CONNECTED",
        "PARTITIONED_METADATA",
        "LOOKUP",
        "LOOKUP_RESPONSE",
        "PRODUCER",
        "PRODUCER_SUCCESS",
        "SEND",
        "SEND_RECEIPT",
        "SUBSCRIBE",
        "FLOW",
        "MESSAGE",
        "ACK",
        "GET_LAST_MESSAGE_ID",
        "CLOSE_PRODUCER",
        "CLOSE_CONSUMER",
    } <= kinds


@pytest.mark.parametrize(
    "captured", CAPTURED, ids=[f"{i}-{f['from']}-{f['type']}" for i, f in enumerate(CAPTURED)]
)
def test_a_captured_frame_decodes_and_encodes_to_the_same_bytes(captured: dict[str, str]) -> None:
    raw = bytes.fromhex(captured["hex"])
    (frame,) = FrameDecoder().feed(raw)
    assert wire.type_name(frame.type) == captured["type"]
    assert wire.encode(frame.command, frame.payload) == raw


def test_a_captured_send_carries_the_producers_metadata_and_a_valid_checksum() -> None:
    sends = [bytes.fromhex(f["hex"]) for f in CAPTURED if f["type"] == "SEND"]
    assert sends
    for raw in sends:
        (frame,) = FrameDecoder().feed(raw)
        assert frame.payload is not None
        payload = wire.parse_payload(frame.payload)
        assert payload.checksum == wire.crc32c(frame.payload[6:])
        assert payload.metadata.sequence_id == frame.command.send.sequence_id
        assert payload.body


def test_frames_split_anywhere_and_glued_together_come_out_whole_and_in_order() -> None:
    stream = b"".join(bytes.fromhex(f["hex"]) for f in CAPTURED)
    for chunk in (1, 3, 7, 64, 1000):
        decoder = FrameDecoder()
        frames = []
        for at in range(0, len(stream), chunk):
            frames += decoder.feed(stream[at : at + chunk])
        assert [wire.type_name(f.type) for f in frames] == [f["type"] for f in CAPTURED]
        assert decoder.buffered == 0


def test_crc32c_of_the_standard_check_string() -> None:
    assert wire.crc32c(b"123456789") == 0xE3069283


def test_a_payload_made_here_reads_back() -> None:
    metadata = api.MessageMetadata(producer_name="p", sequence_id=7, publish_time=1)
    part = wire.make_payload(metadata, b"body")
    read = wire.parse_payload(part)
    assert (read.metadata.sequence_id, read.body) == (7, b"body")
    assert read.checksum == wire.crc32c(part[6:])


def test_a_frame_over_the_limit_is_refused_before_its_body_arrives() -> None:
    decoder = FrameDecoder(max_frame_size=1024)
    with pytest.raises(FrameError, match="over the limit of 1024"):
        decoder.feed(struct.pack(">I", 1025))


def test_a_command_size_beyond_its_frame_is_refused() -> None:
    with pytest.raises(FrameError, match="does not fit"):
        FrameDecoder().feed(struct.pack(">II", 8, 100) + b"xxxx")


def test_a_frame_too_short_for_its_command_size_is_refused() -> None:
    with pytest.raises(FrameError, match="no room"):
        FrameDecoder().feed(struct.pack(">I", 2) + b"xx")


def test_a_command_missing_a_required_field_is_named() -> None:
    partial = Command(type=Type.SEND)
    partial.send.producer_id = 1  # sequence_id, required, is missing
    body = partial.SerializePartialToString()
    frame = struct.pack(">II", len(body) + 4, len(body)) + body
    with pytest.raises(FrameError, match=r"SEND lacks send\.sequence_id"):
        FrameDecoder().feed(frame)


def test_an_unknown_command_type_is_named() -> None:
    body = b"\x08\xc6\x01"  # type = 198, no such command
    with pytest.raises(FrameError, match="unknown command type 198"):
        FrameDecoder().feed(struct.pack(">II", len(body) + 4, len(body)) + body)


def test_encoding_a_command_missing_a_required_field_fails_here_not_at_the_client() -> None:
    with pytest.raises(FrameError, match="cannot encode SEND_RECEIPT"):
        wire.encode(Command(type=Type.SEND_RECEIPT, send_receipt=api.CommandSendReceipt()))


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_any_bytes_give_frames_or_a_frame_error_and_nothing_else(data: bytes) -> None:
    decoder = FrameDecoder(max_frame_size=4096)
    try:
        for frame in decoder.feed(data):
            assert isinstance(frame.command, Command)
    except FrameError:
        pass


@st.composite
def framed(draw: st.DrawFn) -> bytes:
    """Bytes laid out as a frame (sizes consistent) around a random command body and payload."""
    body = draw(st.binary(max_size=200))
    payload = draw(st.binary(max_size=200))
    command_size = draw(st.one_of(st.just(len(body)), st.integers(0, 2**32 - 1)))
    total = draw(st.one_of(st.just(4 + len(body) + len(payload)), st.integers(0, 2**32 - 1)))
    return struct.pack(">II", total, command_size) + body + payload


@settings(max_examples=400, deadline=None)
@given(framed())
def test_frames_with_any_body_or_sizes_decode_or_are_refused(data: bytes) -> None:
    decoder = FrameDecoder(max_frame_size=4096)
    try:
        frames = decoder.feed(data)
    except FrameError:
        return
    for frame in frames:
        if frame.payload is not None:
            with contextlib.suppress(FrameError):
                wire.parse_payload(frame.payload)
