"""Pulsar's binary protocol framing: frames to bytes and back.

Every frame starts with two big-endian 32-bit sizes::

    [total_size][command_size][BaseCommand]                                  a simple command
    [total_size][command_size][BaseCommand][0x0e01][crc32c]
        [metadata_size][MessageMetadata][payload]                            SEND and MESSAGE

``total_size`` counts every byte after itself. What follows the command of a SEND or MESSAGE
(checksum, metadata, payload; a server may put broker-entry metadata, magic 0x0e02, first) is
the frame's *payload part*: the front forwards it as it came, so the checksum the producer
computed over metadata and payload still holds at the consumer, and nothing is decoded on the
way. :func:`parse_payload` reads it where the front needs to (tests, capture tooling).

:class:`FrameDecoder` takes bytes as they arrive and returns whole frames. Whatever it cannot
take is a :class:`FrameError` naming what is wrong: a frame over the size limit (checked on the
first four bytes, before the rest is buffered), a command size that does not fit its frame, a
command protobuf cannot parse or that lacks a field Pulsar requires. The connection that sent it
is answered and closed; no other is touched.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

from google.protobuf.message import DecodeError, EncodeError

from lbd.core.errors import InvalidInputError
from lbd.gen.pulsar import pulsar_api_pb2 as api

Command = api.BaseCommand
Type = api.BaseCommand.Type

DEFAULT_MAX_MESSAGE_SIZE = 5 * 1024 * 1024
"""Pulsar's default ``maxMessageSize``, announced to clients in CONNECTED."""

FRAME_OVERHEAD = 10 * 1024
"""What a frame may carry beyond its message (command, metadata), as Pulsar allows."""

CHECKSUM_MAGIC = 0x0E01
BROKER_ENTRY_METADATA_MAGIC = 0x0E02

_SIZES = struct.Struct(">II")
_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")


class FrameError(InvalidInputError):
    """Bytes that are not a Pulsar frame; the message says what is wrong with them."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame: its command and, for SEND and MESSAGE, the bytes after the command."""

    command: Command
    payload: bytes | None = None

    @property
    def type(self) -> int:
        """The command's type (a :class:`Type` value)."""
        return self.command.type


def encode(command: Command, payload: bytes | None = None) -> bytes:
    """The bytes of one frame. Raises FrameError for a command missing a required field."""
    try:
        body = command.SerializeToString()
    except EncodeError as e:
        raise FrameError(f"cannot encode {type_name(command.type)}: {e}") from None
    extra = len(payload) if payload is not None else 0
    head = _SIZES.pack(4 + len(body) + extra, len(body))
    return head + body + payload if payload is not None else head + body


class Coalescer:
    """Frames written during one turn of the event loop leave in one write to the socket.

    A producer's client pipelines sends and storage answers them in bursts; one system call per
    frame would cost more than the rest of forwarding it. Nothing waits longer than the current
    turn of the loop.
    """

    __slots__ = ("_loop", "_parts", "_scheduled", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        self._parts: list[bytes] = []
        self._scheduled = False

    def write(self, data: bytes) -> None:
        """Queue ``data`` for the end of this turn."""
        self._parts.append(data)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write what is queued now."""
        self._scheduled = False
        if not self._parts:
            return
        data = b"".join(self._parts) if len(self._parts) > 1 else self._parts[0]
        self._parts.clear()
        if not self._transport.is_closing():
            self._transport.write(data)


def type_name(value: int) -> str:
    """A command type's name (``SEND``), or ``type N`` for one this protocol subset lacks."""
    try:
        return Type.Name(value)
    except ValueError:
        return f"type {value}"


class FrameDecoder:
    """Cuts a byte stream into frames.

    ``max_frame_size``: the largest ``total_size`` taken (larger is a :class:`FrameError` as
    soon as its first four bytes arrive, so a peer cannot make the decoder buffer more).
    """

    __slots__ = ("_buffer", "_max")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_MESSAGE_SIZE + FRAME_OVERHEAD) -> None:
        if max_frame_size < 8:
            raise InvalidInputError(f"max frame size must be >= 8 bytes, got {max_frame_size}")
        self._buffer = bytearray()
        self._max = max_frame_size

    @property
    def buffered(self) -> int:
        """Bytes received that do not make a whole frame yet."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Frame]:
        """Take ``data``; every frame it completes, in order. After a FrameError the stream
        cannot be resynchronised: the caller closes the connection."""
        buffer = self._buffer
        buffer += data
        frames: list[Frame] = []
        start = 0
        end = len(buffer)
        while end - start >= 4:
            (total,) = _U32.unpack_from(buffer, start)
            if total > self._max:
                raise FrameError(f"frame of {total} bytes is over the limit of {self._max}")
            if end - start - 4 < total:
                break
            frames.append(_frame(buffer, start + 4, total))
            start += 4 + total
        if start:
            del buffer[:start]
        return frames


def _frame(buffer: bytearray, at: int, total: int) -> Frame:
    if total < 4:
        raise FrameError(f"frame of {total} bytes has no room for its command size")
    (size,) = _U32.unpack_from(buffer, at)
    if size > total - 4:
        raise FrameError(f"command of {size} bytes does not fit in a frame of {total}")
    body = bytes(buffer[at + 4 : at + 4 + size])
    try:
        command = Command.FromString(body)
    except DecodeError as e:
        raise FrameError(f"unreadable command ({size} bytes): {_why(body, e)}") from None
    if not command.IsInitialized():  # the parser takes a message that lacks a required field
        raise FrameError(f"unreadable command ({size} bytes): {_why(body, None)}")
    rest = total - 4 - size
    payload = bytes(buffer[at + 4 + size : at + total]) if rest else None
    return Frame(command, payload)


def _why(body: bytes, error: DecodeError | None) -> str:
    """A reason for an undecodable command, naming its type when the type alone is the cause."""
    partial = Command()
    try:
        partial.MergeFromString(body)  # no required-field check
    except DecodeError:
        return str(error or "") or "not a protobuf message"
    if not partial.HasField("type"):
        unknown = _raw_type(body)
        if unknown is not None:
            return f"unknown command type {unknown}"
        return "the command has no type"
    missing: list[str] = partial.FindInitializationErrors()  # type: ignore[attr-defined]
    if missing:
        return f"{type_name(partial.type)} lacks {', '.join(missing)}"
    return str(error or "") or "not a Pulsar command"


def _raw_type(body: bytes) -> int | None:
    """The varint of field 1 (the type) when it leads the message, as encoders write it."""
    if not body or body[0] != 0x08:
        return None
    value, shift = 0, 0
    for byte in body[1:11]:
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value
        shift += 7
    return None


@dataclass(frozen=True, slots=True)
class Payload:
    """The payload part of a SEND or MESSAGE, read."""

    checksum: int | None
    """The crc32c the sender put before the metadata (None when it sent none)."""
    broker_entry_metadata: bytes | None
    metadata: api.MessageMetadata
    body: bytes


def parse_payload(part: bytes) -> Payload:
    """Read a payload part (see the module docstring); FrameError when it is not one."""
    at = 0
    entry_metadata: bytes | None = None
    checksum: int | None = None
    try:
        if len(part) >= 2 and _U16.unpack_from(part, at)[0] == BROKER_ENTRY_METADATA_MAGIC:
            (size,) = _U32.unpack_from(part, at + 2)
            entry_metadata = part[at + 6 : at + 6 + size]
            at += 6 + size
        if len(part) - at >= 2 and _U16.unpack_from(part, at)[0] == CHECKSUM_MAGIC:
            (checksum,) = _U32.unpack_from(part, at + 2)
            at += 6
        (size,) = _U32.unpack_from(part, at)
    except struct.error:
        raise FrameError(f"payload part of {len(part)} bytes is cut short") from None
    if at + 4 + size > len(part):
        raise FrameError(f"message metadata of {size} bytes does not fit the payload part")
    try:
        metadata = api.MessageMetadata.FromString(part[at + 4 : at + 4 + size])
    except DecodeError as e:
        raise FrameError(f"unreadable message metadata: {e}") from None
    return Payload(checksum, entry_metadata, metadata, part[at + 4 + size :])


def make_payload(metadata: api.MessageMetadata, body: bytes, *, checksum: bool = True) -> bytes:
    """A payload part for ``metadata`` and ``body``, with its crc32c unless ``checksum`` is
    False (tests and tools; the front forwards payload parts as they came)."""
    meta = metadata.SerializeToString()
    covered = _U32.pack(len(meta)) + meta + body
    if not checksum:
        return covered
    return _U16.pack(CHECKSUM_MAGIC) + _U32.pack(crc32c(covered)) + covered


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum of Pulsar's payload frames. Pure Python: for tests
    and tools, never on the forwarding path."""
    crc = 0xFFFFFFFF
    table = _CRC32C
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF
