"""The gpushare wire protocol: framed, versioned messages on a Unix stream socket.

This module is the Python half of the contract in ``docs/protocol.md`` (the C half is
``native/src/base/protocol.c``). A frame is a 12-byte header (magic ``GPSH``, version, type,
reserved, payload length) and a payload of ``tag``/``len``/value fields, all little-endian.

    >>> msg = Message(MsgType.REQUEST, {"used_bytes": 1 << 30})
    >>> decode_frame(encode(msg)) == msg
    True

Decoding is strict where the contract is strict (bad magic, unknown version, oversized payload,
a field running past the payload, a u64 whose length is not 8: :class:`ProtocolError`) and lenient
where it is lenient (unknown tags are skipped, a repeated tag keeps its last value).
"""

from __future__ import annotations

import asyncio
import enum
import json
import socket
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FIELDS",
    "FIELD_TAGS",
    "HEADER",
    "MAGIC",
    "MAX_PAYLOAD",
    "VERSION",
    "ErrorCode",
    "FieldType",
    "FrameDecoder",
    "Message",
    "MsgType",
    "ProtocolError",
    "decode_frame",
    "decode_payload",
    "duplicate_client_id",
    "encode",
    "error_message",
    "kernel_client_id",
    "printable",
    "read_message",
    "read_message_sync",
    "write_message",
    "write_message_sync",
]

MAGIC = b"GPSH"
VERSION = 1
MAX_PAYLOAD = 65536
HEADER = struct.Struct("<4sBBHI")  # magic, version, type, reserved, payload length
HEADER_SIZE = HEADER.size  # 12
FIELD_HEADER = struct.Struct("<HH")  # tag, len
MAX_FIELD_LEN = 0xFFFF
U64 = struct.Struct("<Q")


class MsgType(enum.IntEnum):
    # shim -> scheduler
    HELLO = 0x01
    REQUEST = 0x02
    RELEASED = 0x03
    MEMORY = 0x04
    IDLE = 0x05
    EVICTED = 0x06
    RESTORED = 0x07
    GOODBYE = 0x08
    PRECOPIED = 0x09
    # control peers -> scheduler
    STATUS_REQUEST = 0x20
    CONTROL = 0x21
    # scheduler -> shim
    WELCOME = 0x81
    GRANT = 0x82
    REVOKE = 0x83
    EVICT = 0x84
    SET_QUOTA = 0x85
    ERROR = 0x86
    PRECOPY = 0x87
    SLEEP = 0x88  # deep idle: flag 1 = checkpointed (asleep), 0 = restored (docs/protocol.md)
    RESTORE_AHEAD = 0x89  # restore evicted memory without a grant; answered by RESTORED flag 1
    ROOM = 0x8A  # a holder's room_bytes changed (others' memory came or left); no answer
    STAGING = 0x8B  # the host staging the shim may hold for resident memory; no answer
    # scheduler -> control peers
    STATUS = 0xA0
    CONTROL_REPLY = 0xA1


SHIM_MESSAGES = frozenset(
    {
        MsgType.HELLO,
        MsgType.REQUEST,
        MsgType.RELEASED,
        MsgType.MEMORY,
        MsgType.IDLE,
        MsgType.EVICTED,
        MsgType.RESTORED,
        MsgType.GOODBYE,
        MsgType.PRECOPIED,
    }
)
CONTROL_MESSAGES = frozenset({MsgType.STATUS_REQUEST, MsgType.CONTROL})


class FieldType(enum.Enum):
    U64 = "u64"
    STR = "str"
    JSON = "json"


class ErrorCode(enum.IntEnum):
    BAD_FRAME = 1
    BAD_VERSION = 2
    UNEXPECTED = 3
    FORBIDDEN = 4
    NOT_FOUND = 5
    BAD_REQUEST = 6
    NO_ROOM = 7  # a waiter whose memory can never fit the pool and the node's host budget


#: tag -> (name, type), exactly the table in docs/protocol.md.
FIELDS: dict[int, tuple[str, FieldType]] = {
    1: ("client_id", FieldType.STR),
    2: ("pid", FieldType.U64),
    3: ("device_uuid", FieldType.STR),
    4: ("device_name", FieldType.STR),
    5: ("device_total", FieldType.U64),
    6: ("quota", FieldType.U64),
    7: ("weight_milli", FieldType.U64),
    8: ("user", FieldType.STR),
    9: ("label", FieldType.STR),
    10: ("used_bytes", FieldType.U64),
    11: ("managed_bytes", FieldType.U64),
    12: ("pinned_bytes", FieldType.U64),
    13: ("evicted_bytes", FieldType.U64),
    14: ("flag", FieldType.U64),
    15: ("pool_bytes", FieldType.U64),
    16: ("quantum_ms", FieldType.U64),
    17: ("reason", FieldType.STR),
    18: ("bytes_moved", FieldType.U64),
    19: ("micros", FieldType.U64),
    20: ("error_code", FieldType.U64),
    21: ("message", FieldType.STR),
    22: ("body", FieldType.JSON),
    23: ("version", FieldType.STR),
    24: ("idle_ms", FieldType.U64),
    25: ("context_bytes", FieldType.U64),
    26: ("token", FieldType.STR),
    # Reconnecting after the scheduler was lost (docs/protocol.md, "Scheduler restarts").
    39: ("resume", FieldType.U64),
    40: ("since_ms", FieldType.U64),
    41: ("gpu_ms", FieldType.U64),
    # GRANT -> HELLO with resume = 1: proof that the shim is the process that was granted.
    42: ("resume_secret", FieldType.STR),
    # The memory engine (docs/protocol.md, "Pre-copy").
    43: ("precopied_bytes", FieldType.U64),
    44: ("evict_bytes", FieldType.U64),
    45: ("room_bytes", FieldType.U64),
    # HELLO: the secret its provisioner gave the kernel (GPUSHARE_KERNEL_SECRET): proves that the
    # shim is the kernel its id was bound to (docs/protocol.md, "Kernel ids").
    46: ("kernel_secret", FieldType.STR),
    # REQUEST: device bytes the driver refused although the room said they fit (the card fuller
    # than the pool's accounting): the scheduler makes at least that much room (docs/protocol.md).
    47: ("short_bytes", FieldType.U64),
    # Host memory is a budget (docs/protocol.md, "Host memory"): MEMORY, REQUEST and a
    # reconnecting HELLO say what the engine holds on the host, and the part of it that is
    # staging of resident memory; STAGING carries the allowance in staging_bytes.
    49: ("host_bytes", FieldType.U64),
    50: ("staging_bytes", FieldType.U64),
}
#: name -> tag
FIELD_TAGS: dict[str, int] = {name: tag for tag, (name, _type) in FIELDS.items()}


class ProtocolError(Exception):
    """A frame that breaks the contract. ``code`` is the :class:`ErrorCode` to answer with."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Message:
    """One protocol message: its type and its fields by name (see :data:`FIELDS`).

    ``type`` is a :class:`MsgType` when the type is known, else the raw byte (decoding does not
    reject unknown types; the receiver answers ``unexpected``).
    """

    type: MsgType | int
    fields: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def __contains__(self, name: object) -> bool:
        return name in self.fields

    @property
    def type_name(self) -> str:
        return self.type.name if isinstance(self.type, MsgType) else f"0x{int(self.type):02x}"


def error_message(code: ErrorCode | int, text: str) -> Message:
    return Message(MsgType.ERROR, {"error_code": int(code), "message": text})


# --------------------------------------------------------------------------------------------
# Client ids: a kernel's subprocesses inherit its GPUSHARE_CLIENT_ID, so the scheduler tells a
# second live client of the same id apart by its pid (docs/protocol.md, "Duplicate client ids").

#: What separates a kernel's client id from the suffix a duplicate gets.
DUPLICATE_SEPARATOR = "#"


def duplicate_client_id(client_id: str, pid: int, n: int = 1) -> str:
    """The id of the ``n``-th duplicate of ``client_id`` from process ``pid``."""
    base = f"{client_id}{DUPLICATE_SEPARATOR}{pid}"
    return base if n <= 1 else f"{base}.{n}"


def printable(text: str) -> str:
    """``text`` with every character a terminal or a log would act on escaped (``\\x1b``,
    ``\\n``, ``\\u202e``): ids, labels and names come from peers and must not move a cursor,
    set a title or forge a log line where they are shown."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def kernel_client_id(client_id: str) -> str:
    """The kernel's own id of a (possibly duplicate) client id: ``k#123.2`` -> ``k``."""
    return client_id.split(DUPLICATE_SEPARATOR, 1)[0]


# --------------------------------------------------------------------------------------------
# Encoding


def _encode_value(name: str, ftype: FieldType, value: Any) -> bytes:
    if ftype is FieldType.U64:
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, int):
            raise TypeError(f"field {name!r} is a u64, got {type(value).__name__}")
        if not 0 <= value < 1 << 64:
            raise ValueError(f"field {name!r}: {value} does not fit a u64")
        return U64.pack(value)
    if ftype is FieldType.STR:
        if not isinstance(value, str):
            raise TypeError(f"field {name!r} is a str, got {type(value).__name__}")
        return value.encode("utf-8")
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def encode_payload(fields: Mapping[str, Any]) -> bytes:
    parts: list[bytes] = []
    for name, value in fields.items():
        if value is None:
            continue
        tag = FIELD_TAGS.get(name)
        if tag is None:
            raise ValueError(f"unknown field {name!r}")
        raw = _encode_value(name, FIELDS[tag][1], value)
        if len(raw) > MAX_FIELD_LEN:
            raise ValueError(f"field {name!r} is {len(raw)} bytes, over the {MAX_FIELD_LEN} limit")
        parts.append(FIELD_HEADER.pack(tag, len(raw)))
        parts.append(raw)
    payload = b"".join(parts)
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"payload is {len(payload)} bytes, over the {MAX_PAYLOAD} limit")
    return payload


def encode(msg: Message) -> bytes:
    """The frame for ``msg``. Fields whose value is None are left out.

    Raises ValueError/TypeError for an unknown field name, a value of the wrong type, or a frame
    over the limits (a field over 65 535 bytes, a payload over :data:`MAX_PAYLOAD`).
    """
    payload = encode_payload(msg.fields)
    return HEADER.pack(MAGIC, VERSION, int(msg.type), 0, len(payload)) + payload


# --------------------------------------------------------------------------------------------
# Decoding


def _check_header(header: bytes) -> tuple[int, int]:
    """Validate a 12-byte header; return (type, payload length)."""
    magic, version, mtype, _reserved, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"bad magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(
            ErrorCode.BAD_VERSION, f"protocol version {version} (this side speaks {VERSION})"
        )
    if length > MAX_PAYLOAD:
        raise ProtocolError(
            ErrorCode.BAD_FRAME, f"payload length {length} over the {MAX_PAYLOAD} limit"
        )
    return mtype, length


def _check_magic_prefix(data: bytes | bytearray) -> None:
    """Fail early on garbage: the first bytes of a frame must be a prefix of the magic."""
    n = min(len(data), len(MAGIC))
    if bytes(data[:n]) != MAGIC[:n]:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"bad magic {bytes(data[:n])!r}")


def _iter_fields(payload: bytes) -> Iterator[tuple[int, bytes]]:
    pos = 0
    end = len(payload)
    while pos < end:
        if end - pos < FIELD_HEADER.size:
            raise ProtocolError(
                ErrorCode.BAD_FRAME, f"truncated field header at offset {pos} of {end}"
            )
        tag, flen = FIELD_HEADER.unpack_from(payload, pos)
        pos += FIELD_HEADER.size
        if flen > end - pos:
            raise ProtocolError(
                ErrorCode.BAD_FRAME,
                f"field {tag} of {flen} bytes runs past the payload's end ({end - pos} left)",
            )
        yield tag, payload[pos : pos + flen]
        pos += flen


def decode_payload(payload: bytes) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for tag, raw in _iter_fields(payload):
        spec = FIELDS.get(tag)
        if spec is None:
            continue  # unknown tags are skipped: either side may add fields
        name, ftype = spec
        if ftype is FieldType.U64:
            if len(raw) != 8:
                raise ProtocolError(
                    ErrorCode.BAD_FRAME, f"u64 field {name!r} has length {len(raw)}, not 8"
                )
            fields[name] = U64.unpack(raw)[0]
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"field {name!r} is not UTF-8") from exc
        if ftype is FieldType.STR:
            fields[name] = text
        else:
            try:
                fields[name] = json.loads(text)
            except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
                raise ProtocolError(
                    ErrorCode.BAD_FRAME, f"field {name!r} is not a JSON document: {exc}"
                ) from exc
    return fields


def _message_type(raw: int) -> MsgType | int:
    try:
        return MsgType(raw)
    except ValueError:
        return raw


def decode_frame(frame: bytes) -> Message:
    """Decode exactly one complete frame (no bytes before or after it)."""
    if len(frame) < HEADER_SIZE:
        _check_magic_prefix(frame)
        raise ProtocolError(ErrorCode.BAD_FRAME, f"truncated frame: {len(frame)} bytes")
    mtype, length = _check_header(frame[:HEADER_SIZE])
    if len(frame) != HEADER_SIZE + length:
        raise ProtocolError(
            ErrorCode.BAD_FRAME,
            f"frame is {len(frame)} bytes, its header says {HEADER_SIZE + length}",
        )
    return Message(_message_type(mtype), decode_payload(frame[HEADER_SIZE:]))


class FrameDecoder:
    """Incremental decoder: feed it bytes as they arrive, get whole messages back.

    Header errors are reported as soon as the header's bytes are in (a garbage first byte fails at
    once; an oversized length fails before its payload arrives). After a :class:`ProtocolError`
    the stream has no frame boundary left to resync on: the decoder keeps raising it.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._error: ProtocolError | None = None

    @property
    def pending(self) -> int:
        """Bytes received that are not yet part of a whole frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> Iterator[Message]:
        """Add ``data``; iterate over the messages that are now complete.

        The bytes are buffered at once; the frames are decoded as the iterator is consumed, so the
        messages before a bad frame are still delivered before its ProtocolError is raised.
        """
        if self._error is not None:
            raise self._error
        self._buf += data
        return self._drain()

    def _drain(self) -> Iterator[Message]:
        while True:
            msg = self._next()
            if msg is None:
                return
            yield msg

    def _next(self) -> Message | None:
        if self._error is not None:
            raise self._error
        try:
            if len(self._buf) < HEADER_SIZE:
                _check_magic_prefix(self._buf)
                return None
            mtype, length = _check_header(bytes(self._buf[:HEADER_SIZE]))
            if len(self._buf) < HEADER_SIZE + length:
                return None
            payload = bytes(self._buf[HEADER_SIZE : HEADER_SIZE + length])
            del self._buf[: HEADER_SIZE + length]
            return Message(_message_type(mtype), decode_payload(payload))
        except ProtocolError as exc:
            self._error = exc
            raise

    def eof(self) -> None:
        """The stream ended: raise ProtocolError if it ended inside a frame."""
        if self._error is not None:
            raise self._error
        if self._buf:
            self._error = ProtocolError(
                ErrorCode.BAD_FRAME, f"connection closed inside a frame ({len(self._buf)} bytes)"
            )
            raise self._error


# --------------------------------------------------------------------------------------------
# Stream helpers


async def read_message(reader: asyncio.StreamReader) -> Message | None:
    """Read one message; None at a clean end of stream (between frames).

    Raises ProtocolError for a bad frame or a stream that ends inside one.
    """
    try:
        header = await reader.readexactly(HEADER_SIZE)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        _check_magic_prefix(exc.partial)
        raise ProtocolError(
            ErrorCode.BAD_FRAME, f"connection closed inside a header ({len(exc.partial)} bytes)"
        ) from None
    mtype, length = _check_header(header)
    try:
        payload = await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(
            ErrorCode.BAD_FRAME,
            f"connection closed inside a payload ({len(exc.partial)} of {length} bytes)",
        ) from None
    return Message(_message_type(mtype), decode_payload(payload))


async def write_message(writer: asyncio.StreamWriter, msg: Message) -> None:
    writer.write(encode(msg))
    await writer.drain()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            break
        chunks += chunk
    return bytes(chunks)


def read_message_sync(sock: socket.socket) -> Message | None:
    """Blocking :func:`read_message` for a connected socket (the CLI's side)."""
    header = _recv_exactly(sock, HEADER_SIZE)
    if not header:
        return None
    if len(header) < HEADER_SIZE:
        _check_magic_prefix(header)
        raise ProtocolError(
            ErrorCode.BAD_FRAME, f"connection closed inside a header ({len(header)} bytes)"
        )
    mtype, length = _check_header(header)
    payload = _recv_exactly(sock, length)
    if len(payload) < length:
        raise ProtocolError(
            ErrorCode.BAD_FRAME,
            f"connection closed inside a payload ({len(payload)} of {length} bytes)",
        )
    return Message(_message_type(mtype), decode_payload(payload))


def write_message_sync(sock: socket.socket, msg: Message) -> None:
    sock.sendall(encode(msg))
