from __future__ import annotations

import asyncio
import json
import socket
import struct

import pytest

from jupyter_gpushare import protocol as p
from jupyter_gpushare.protocol import (
    ErrorCode,
    FrameDecoder,
    Message,
    MsgType,
    ProtocolError,
    decode_frame,
    encode,
)


def frame(mtype: int, payload: bytes, *, magic: bytes = b"GPSH", version: int = 1) -> bytes:
    return struct.pack("<4sBBHI", magic, version, mtype, 0, len(payload)) + payload


def field(tag: int, value: bytes, length: int | None = None) -> bytes:
    return struct.pack("<HH", tag, len(value) if length is None else length) + value


def test_constants_match_the_contract() -> None:
    assert p.MAGIC == b"\x47\x50\x53\x48"
    assert p.VERSION == 1
    assert p.MAX_PAYLOAD == 65536
    assert p.HEADER_SIZE == 12
    assert {t.name: int(t) for t in MsgType} == {
        "HELLO": 0x01, "REQUEST": 0x02, "RELEASED": 0x03, "MEMORY": 0x04, "IDLE": 0x05,
        "EVICTED": 0x06, "RESTORED": 0x07, "GOODBYE": 0x08, "PRECOPIED": 0x09,
        "STATUS_REQUEST": 0x20, "CONTROL": 0x21, "WELCOME": 0x81, "GRANT": 0x82, "REVOKE": 0x83,
        "EVICT": 0x84, "SET_QUOTA": 0x85, "ERROR": 0x86, "PRECOPY": 0x87, "SLEEP": 0x88,
        "RESTORE_AHEAD": 0x89, "ROOM": 0x8A, "STAGING": 0x8B, "STATUS": 0xA0,
            "CONTROL_REPLY": 0xA1,
    }  # fmt: skip
    assert [int(c) for c in ErrorCode] == [1, 2, 3, 4, 5, 6, 7]
    assert p.FIELD_TAGS["client_id"] == 1 and p.FIELD_TAGS["context_bytes"] == 25
    assert p.FIELDS[26] == ("token", p.FieldType.STR)
    assert set(range(1, 26)) <= set(p.FIELDS)
    assert [p.FIELDS[t] for t in (39, 40, 41)] == [
        ("resume", p.FieldType.U64), ("since_ms", p.FieldType.U64), ("gpu_ms", p.FieldType.U64),
    ]  # fmt: skip
    assert p.FIELDS[43] == ("precopied_bytes", p.FieldType.U64)
    assert p.FIELDS[49] == ("host_bytes", p.FieldType.U64)
    assert p.FIELDS[50] == ("staging_bytes", p.FieldType.U64)
    assert p.FIELDS[22] == ("body", p.FieldType.JSON)
    assert p.FIELDS[14] == ("flag", p.FieldType.U64)


def test_exact_bytes_of_a_frame() -> None:
    data = encode(Message(MsgType.GRANT, {"flag": 1}))
    assert data == (
        b"GPSH" + bytes([1, 0x82, 0, 0]) + struct.pack("<I", 12)
        + struct.pack("<HH", 14, 8) + struct.pack("<Q", 1)
    )  # fmt: skip
    data = encode(Message(MsgType.HELLO, {"client_id": "k1", "pid": 7}))
    assert data[12:] == field(1, b"k1") + field(2, struct.pack("<Q", 7))
    assert encode(Message(MsgType.GOODBYE)) == b"GPSH\x01\x08\x00\x00\x00\x00\x00\x00"


ALL_FIELDS = {
    "client_id": "kernel-ünïcode-✓", "pid": 4242, "device_uuid": "GPU-abc",
    "device_name": "NVIDIA H100 80GB HBM3", "device_total": 85520809984, "quota": 0,
    "weight_milli": 1500, "user": "alice", "label": "train.ipynb", "used_bytes": 2**64 - 1,
    "managed_bytes": 1, "pinned_bytes": 2, "evicted_bytes": 3, "flag": 1, "pool_bytes": 5,
    "quantum_ms": 5000, "reason": "turn", "bytes_moved": 6, "micros": 7, "error_code": 3,
    "message": "oops", "body": {"a": [1, 2, {"b": None}], "ü": "✓"}, "version": "0.1.0",
    "idle_ms": 2000, "context_bytes": 536870912, "token": "0f" * 32,
}  # fmt: skip


@pytest.mark.parametrize("mtype", list(MsgType))
def test_round_trip_every_type(mtype: MsgType) -> None:
    msg = Message(mtype, dict(ALL_FIELDS))
    assert decode_frame(encode(msg)) == msg


def test_empty_fields_and_none_are_left_out() -> None:
    msg = decode_frame(encode(Message(MsgType.REVOKE, {"flag": 0, "reason": None})))
    assert msg.fields == {"flag": 0}


def test_unknown_tags_are_skipped_and_repeated_tags_keep_the_last() -> None:
    payload = (
        field(999, b"future stuff")
        + field(1, b"first")
        + field(1, b"second")
        + field(500, b"")
        + field(10, struct.pack("<Q", 9))
    )
    msg = decode_frame(frame(0x02, payload))
    assert msg.type == MsgType.REQUEST
    assert msg.fields == {"client_id": "second", "used_bytes": 9}


def test_unknown_type_decodes_to_its_number() -> None:
    msg = decode_frame(frame(0x55, b""))
    assert msg.type == 0x55 and not isinstance(msg.type, MsgType)
    assert msg.type_name == "0x55"


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"nonsense": 1}, ValueError),
        ({"pid": -1}, ValueError),
        ({"pid": 2**64}, ValueError),
        ({"pid": "12"}, TypeError),
        ({"client_id": 12}, TypeError),
        ({"label": "x" * 70000}, ValueError),
        ({"body": {"x": "y" * 70000}}, ValueError),
    ],
)
def test_encode_rejects(fields: dict, error: type[Exception]) -> None:
    with pytest.raises(error):
        encode(Message(MsgType.HELLO, fields))


def test_payload_limit() -> None:
    # Five 16 000-byte fields: every field fits, the payload does not.
    big = {
        name: "x" * 16000 for name in ("client_id", "device_uuid", "device_name", "user", "label")
    }
    with pytest.raises(ValueError, match="65536"):
        encode(Message(MsgType.HELLO, big))
    # Exactly at the limit is fine.
    ok = {"client_id": "a" * (p.MAX_PAYLOAD - 4)}
    data = encode(Message(MsgType.HELLO, ok))
    assert len(data) == 12 + p.MAX_PAYLOAD
    assert decode_frame(data).fields == ok


BAD_FRAMES = {
    "bad magic": (frame(0x02, b"", magic=b"GPSX"), ErrorCode.BAD_FRAME),
    "garbage": (b"hello world!\n", ErrorCode.BAD_FRAME),
    "bad version": (frame(0x02, b"", version=2), ErrorCode.BAD_VERSION),
    "version 0": (frame(0x02, b"", version=0), ErrorCode.BAD_VERSION),
    "oversized": (
        struct.pack("<4sBBHI", b"GPSH", 1, 2, 0, p.MAX_PAYLOAD + 1),
        ErrorCode.BAD_FRAME,
    ),
    "field overrun": (frame(0x02, field(10, b"\0" * 8, length=9)), ErrorCode.BAD_FRAME),
    "field header truncated": (
        frame(0x02, field(10, b"\0" * 8) + b"\x01\x00"),
        ErrorCode.BAD_FRAME,
    ),
    "u64 of 4 bytes": (frame(0x02, field(10, b"\0" * 4)), ErrorCode.BAD_FRAME),
    "u64 of 9 bytes": (frame(0x02, field(10, b"\0" * 9)), ErrorCode.BAD_FRAME),
    "u64 of 0 bytes": (frame(0x02, field(2, b"")), ErrorCode.BAD_FRAME),
    "bad utf-8": (frame(0x01, field(1, b"\xff\xfe")), ErrorCode.BAD_FRAME),
    "bad json": (frame(0x21, field(22, b"{nope")), ErrorCode.BAD_FRAME),
}


@pytest.mark.parametrize("case", list(BAD_FRAMES))
def test_decoder_rejects(case: str) -> None:
    data, code = BAD_FRAMES[case]
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError) as info:
        list(decoder.feed(data))
    assert info.value.code == code
    # The stream cannot be resynchronised: the decoder stays broken.
    with pytest.raises(ProtocolError):
        list(decoder.feed(encode(Message(MsgType.GOODBYE))))


def test_decoder_fails_early() -> None:
    # Garbage fails on its first byte; an oversized length before its payload arrives.
    with pytest.raises(ProtocolError):
        list(FrameDecoder().feed(b"X"))
    decoder = FrameDecoder()
    assert list(decoder.feed(b"GPS")) == []
    with pytest.raises(ProtocolError, match="limit"):
        list(decoder.feed(b"H\x01\x02\x00\x00" + struct.pack("<I", 10**9)))


def test_decoder_truncated_at_eof() -> None:
    decoder = FrameDecoder()
    data = encode(Message(MsgType.REQUEST, {"used_bytes": 5}))
    assert list(decoder.feed(data[:-3])) == []
    assert decoder.pending == len(data) - 3
    with pytest.raises(ProtocolError) as info:
        decoder.eof()
    assert info.value.code == ErrorCode.BAD_FRAME
    clean = FrameDecoder()
    assert len(list(clean.feed(data))) == 1
    clean.eof()  # between frames: fine


def test_decoder_byte_by_byte_and_batched() -> None:
    msgs = [Message(t, {"reason": str(i), "flag": i}) for i, t in enumerate(MsgType)]
    stream = b"".join(encode(m) for m in msgs)
    decoder = FrameDecoder()
    out: list[Message] = []
    for i in range(len(stream)):
        out.extend(decoder.feed(stream[i : i + 1]))
    assert out == msgs
    assert list(FrameDecoder().feed(stream)) == msgs


def test_messages_before_a_bad_frame_are_delivered() -> None:
    good = encode(Message(MsgType.REQUEST, {"used_bytes": 1}))
    it = FrameDecoder().feed(good + b"JUNKJUNKJUNKJUNK")
    assert next(it) == Message(MsgType.REQUEST, {"used_bytes": 1})
    with pytest.raises(ProtocolError):
        next(it)


def test_sync_helpers_over_a_socketpair() -> None:
    a, b = socket.socketpair()
    with a, b:
        msg = Message(MsgType.STATUS, {"body": {"devices": []}})
        p.write_message_sync(a, msg)
        assert p.read_message_sync(b) == msg
        a.sendall(encode(msg)[:20])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ProtocolError):
            p.read_message_sync(b)
    c, d = socket.socketpair()
    with c, d:
        c.close()
        assert p.read_message_sync(d) is None


async def test_async_helpers() -> None:
    a, b = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=a)
    try:
        msg = Message(MsgType.CONTROL, {"body": {"action": "release", "client": "k"}})
        b.sendall(encode(msg) + encode(Message(MsgType.GOODBYE)))
        assert await p.read_message(reader) == msg
        assert await p.read_message(reader) == Message(MsgType.GOODBYE)
        await p.write_message(writer, Message(MsgType.GRANT, {"flag": 0}))
        assert decode_frame(b.recv(100)) == Message(MsgType.GRANT, {"flag": 0})
        b.sendall(frame(0x02, b"", version=9))
        with pytest.raises(ProtocolError) as info:
            await p.read_message(reader)
        assert info.value.code == ErrorCode.BAD_VERSION
    finally:
        writer.close()
        b.close()


def test_error_message_helper() -> None:
    msg = p.error_message(ErrorCode.FORBIDDEN, "no")
    assert decode_frame(encode(msg)).fields == {"error_code": 4, "message": "no"}
    assert json.loads(json.dumps(ALL_FIELDS["body"])) == ALL_FIELDS["body"]
