"""Property-based fuzzing of the scheduler's Unix-socket protocol (docs/protocol.md).

1. Against one live scheduler per test, random bytes and mutated valid frames (flipped bytes,
   truncations, wrong lengths, fields running past the payload, u64 fields of the wrong length,
   wrong versions, unknown types, scheduler-only types sent by a client, valid frames in the wrong
   order) arrive on fresh connections. The oracle is :class:`FrameDecoder` run on the same bytes:
   a protocol error must be answered with that ``ERROR`` and a close; anything else must leave the
   connection open (a sentinel control request proves the scheduler read everything); an
   incomplete frame gets silence. After every example a well-behaved shim, connected before the
   fuzzing, still gets GRANT/REVOKE and a STATUS, nothing from the fuzz connections is left in
   the scheduler's accounting, and the scheduler logged no error (no traceback).
2. ``decode_frame(encode(m)) == m`` for random messages, and :class:`FrameDecoder` fed the same
   bytes in random chunks yields the same messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import struct
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from sched_helpers import DEVICE, FakeShim, MiB

from jupyter_gpushare.protocol import (
    CONTROL_MESSAGES,
    FIELDS,
    MAX_PAYLOAD,
    SHIM_MESSAGES,
    ErrorCode,
    FieldType,
    FrameDecoder,
    Message,
    MsgType,
    ProtocolError,
    decode_frame,
    encode,
)

GOOD_ID = "well-behaved-shim-c0ffee"
GOOD_FAKE_PID = 4_242_424  # not this process's pid: a fuzzed HELLO naming GOOD_ID is no reconnect
U64_TAGS = [tag for tag, (_n, t) in FIELDS.items() if t is FieldType.U64]
# What peers may send, as protocol.py defines it (sorted: hypothesis wants a stable order).
CLIENT_TYPES = sorted(SHIM_MESSAGES | CONTROL_MESSAGES)
SHIM_AFTER_HELLO = sorted(SHIM_MESSAGES - {MsgType.HELLO})
SCHEDULER_TYPES = [t for t in MsgType if t not in CLIENT_TYPES]
_sentinels = itertools.count()

# --------------------------------------------------------------------------------------------
# Strategies

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
u64s = st.integers(0, (1 << 64) - 1) | st.sampled_from([0, 1, 100 * MiB, 900 * MiB, 1 << 40])
#: Long strings: the scheduler echoes ids and names into replies that have a size limit too.
long_text = st.integers(1000, 65000).map(lambda n: "x" * n)
fuzz_ids = (
    st.sampled_from(["", "fz-a", "fz-b", "pid-1"])
    | st.text(max_size=12).map(lambda s: "fz-" + s)
    | long_text.map(lambda s: "fz-" + s)
)


def field_value(name: str, ftype: FieldType) -> st.SearchStrategy[Any]:
    if ftype is FieldType.U64:
        return u64s
    if ftype is FieldType.JSON:
        return json_values.filter(lambda v: v is not None)
    if name == "client_id":
        return fuzz_ids
    if name == "device_uuid":
        return (
            st.sampled_from([DEVICE, DEVICE.lower(), "", "GPU-fuzz"])
            | st.text(max_size=12)
            | long_text
        )
    return st.text(max_size=24) | long_text


def random_fields(names: list[str] | None = None) -> st.SearchStrategy[dict[str, Any]]:
    """A dict of some of ``names`` (all fields by default) with values of the right type."""
    pool = names or [name for name, _t in FIELDS.values()]
    types = {name: t for name, t in FIELDS.values()}
    return st.fixed_dictionaries(
        {}, optional={name: field_value(name, types[name]) for name in pool}
    )


control_bodies = st.fixed_dictionaries(
    {},
    optional={
        "action": st.sampled_from(["release", "evict", "set_quota", "kernel_state", "bogus"]),
        "client": fuzz_ids | st.integers(),
        "quota": st.none()
        | st.integers(-5, 1 << 65)
        | st.sampled_from(["1GiB", "99999999999T", "1e30"])
        | st.text(max_size=8)
        | st.floats(),
        "state": st.sampled_from(["busy", "idle", "asleep"]),
        "device": st.sampled_from([DEVICE, "GPU-x"]) | st.integers(),
    },
) | json_values.filter(lambda v: v is not None)


def control_bodies_for(client: str) -> st.SearchStrategy[Any]:
    return control_bodies.map(lambda b: {**b, "client": client} if isinstance(b, dict) else b)


@st.composite
def valid_messages(draw: st.DrawFn) -> Message:
    mtype = draw(st.sampled_from(CLIENT_TYPES + SCHEDULER_TYPES) | st.integers(0, 255))
    if mtype in (MsgType.STATUS_REQUEST, MsgType.CONTROL):
        fields = draw(st.fixed_dictionaries({}, optional={"body": control_bodies}))
    else:
        fields = draw(random_fields())
        fields.pop("body", None)  # bodies only on control messages: see control_bodies
    msg = Message(mtype, fields)
    try:
        encode(msg)
    except ValueError:
        assume(False)  # over the frame's limits: not a frame encode() can make
    return msg


def raw_frame(mtype: int, payload: bytes, *, version: int = 1, length: int | None = None) -> bytes:
    n = len(payload) if length is None else length
    return struct.pack("<4sBBHI", b"GPSH", version, mtype, 0, n) + payload


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """Valid frames, then one or more mutations that are likely to hit the parser's edges."""
    frames = [encode(m) for m in draw(st.lists(valid_messages(), min_size=1, max_size=4))]
    data = bytearray(b"".join(frames))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(
            st.sampled_from(
                ["flip", "truncate", "length", "version", "type", "overrun", "bad_u64", "insert"]
            )
        )
        if kind == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        elif kind == "truncate" and data:
            del data[draw(st.integers(0, len(data) - 1)) :]
        elif kind == "length" and len(data) >= 12:
            n = draw(st.sampled_from([0, 1, 7, MAX_PAYLOAD, MAX_PAYLOAD + 1, 0xFFFFFFFF]))
            n = draw(st.just(n) | st.integers(0, 0xFFFFFFFF))
            struct.pack_into("<I", data, 8, n)
        elif kind == "version" and len(data) >= 5:
            data[4] = draw(st.integers(0, 255))
        elif kind == "type" and len(data) >= 6:
            data[5] = draw(st.integers(0, 255))
        elif kind == "overrun":
            tag = draw(st.integers(0, 40))
            claim = draw(st.integers(1, 0xFFFF))
            value = draw(st.binary(max_size=min(claim - 1, 16)))
            data += raw_frame(
                draw(st.sampled_from(CLIENT_TYPES)), struct.pack("<HH", tag, claim) + value
            )
        elif kind == "bad_u64":
            n = draw(st.integers(0, 16).filter(lambda n: n != 8))
            data += raw_frame(
                draw(st.sampled_from(CLIENT_TYPES)),
                struct.pack("<HH", draw(st.sampled_from(U64_TAGS)), n) + b"\x01" * n,
            )
        elif kind == "insert":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


@st.composite
def wrong_order(draw: st.DrawFn) -> bytes:
    """Well-formed frames in an order the state machine must refuse (without closing)."""
    hello = Message(MsgType.HELLO, {"client_id": draw(fuzz_ids), "device_uuid": DEVICE})
    shim = Message(
        draw(st.sampled_from(SHIM_AFTER_HELLO)), draw(random_fields(["used_bytes", "flag"]))
    )
    sched = Message(draw(st.sampled_from(SCHEDULER_TYPES)), draw(random_fields(["flag"])))
    unknown = Message(draw(st.integers(0x09, 0x1F)), {})
    goodbye = Message(MsgType.GOODBYE, {})
    seqs = [
        [shim, hello],  # REQUEST (etc.) before HELLO
        [hello, hello],  # a second HELLO
        [sched],  # GRANT, WELCOME, ... sent by a client
        [hello, sched, shim],
        [unknown, hello, unknown],
        [hello, goodbye, shim, hello],  # after GOODBYE
        [Message(MsgType.STATUS_REQUEST, {}), hello],  # a control peer that says HELLO
        # A control action on the client this connection just became (any body).
        [hello, Message(MsgType.CONTROL, {"body": draw(control_bodies_for(hello["client_id"]))})],
    ]
    return b"".join(encode(m) for m in draw(st.sampled_from(seqs)))


fuzz_inputs = st.one_of(
    st.binary(max_size=64),
    st.binary(max_size=16).map(lambda b: b"GPSH" + b),
    st.binary(max_size=32).map(lambda b: b"GPSH\x01" + b),
    mutated(),
    wrong_order(),
    st.lists(valid_messages(), min_size=1, max_size=3).map(
        lambda ms: b"".join(encode(m) for m in ms)
    ),
)

# --------------------------------------------------------------------------------------------
# The live-scheduler fuzz test


@dataclass
class Harness:
    scheduler: Any
    good: FakeShim
    ctl: FakeShim
    baseline_connections: int


@pytest.fixture
async def harness(make_scheduler: Any, sock_path: str) -> Any:
    scheduler = await make_scheduler()
    scheduler.fake_creds = [{"pid": GOOD_FAKE_PID}]  # the first connection: the good shim
    good = await FakeShim.connect(sock_path)
    await good.hello(GOOD_ID)
    ctl = await FakeShim.connect(sock_path)
    await ctl.send(MsgType.STATUS_REQUEST)
    await ctl.expect(MsgType.STATUS)
    try:
        yield Harness(scheduler, good, ctl, len(scheduler._connections))
    finally:
        await good.close()
        await ctl.close()


def expected_outcome(data: bytes) -> tuple[list[Message], ProtocolError | None, int]:
    """What the scheduler's decoder makes of ``data``: messages, the error, the pending bytes."""
    decoder = FrameDecoder()
    msgs: list[Message] = []
    try:
        for msg in decoder.feed(data):
            msgs.append(msg)
    except ProtocolError as exc:
        return msgs, exc, 0
    return msgs, None, decoder.pending


async def read_frames(
    reader: asyncio.StreamReader, decoder: FrameDecoder, until: Any, timeout: float
) -> tuple[list[Message], bool]:
    """Frames until ``until(msg)`` is true, the connection closes or ``timeout``: (msgs, closed).

    Every byte the scheduler sends must decode (FrameDecoder raises otherwise)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    msgs: list[Message] = []
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            return msgs, False
        try:
            data = await asyncio.wait_for(reader.read(65536), remaining)
        except (asyncio.TimeoutError, TimeoutError):
            return msgs, False
        except ConnectionResetError:
            # Linux resets the peer when a Unix socket is closed with unread data in it.
            data = b""
        if not data:
            decoder.eof()
            return msgs, True
        for msg in decoder.feed(data):
            msgs.append(msg)
            if until(msg):
                return msgs, False


async def good_flow(h: Harness) -> None:
    """The well-behaved shim: REQUEST -> GRANT, an admin release -> REVOKE -> RELEASED, STATUS.

    The fuzz clients may have made the policy EVICT it meanwhile: it answers as a shim would."""
    good = h.good

    async def until(mtype: MsgType) -> Message:
        while True:
            msg = await good.recv(3.0)
            assert msg is not None, "the scheduler closed the good shim's connection"
            if msg.type == mtype:
                return msg
            if msg.type == MsgType.EVICT:
                await good.send(MsgType.EVICTED, bytes_moved=0, micros=1, evicted_bytes=0)
            elif msg.type == MsgType.REVOKE:
                await good.send(MsgType.RELEASED, flag=0, bytes_moved=0, micros=1)
            else:
                assert msg.type in (MsgType.SET_QUOTA, MsgType.GRANT), msg

    await good.request(10 * MiB)
    grant = await until(MsgType.GRANT)
    if grant.fields.get("flag"):
        await good.send(MsgType.RESTORED, bytes_moved=0, micros=1)
    await h.ctl.send(MsgType.CONTROL, body={"action": "release", "client": GOOD_ID})
    reply = await h.ctl.expect(MsgType.CONTROL_REPLY)
    assert reply.fields["body"]["ok"] is True
    await until(MsgType.REVOKE)
    await good.send(MsgType.RELEASED, flag=0, bytes_moved=0, micros=1)
    await h.ctl.send(MsgType.STATUS_REQUEST)
    status = await h.ctl.expect(MsgType.STATUS)
    clients = [c for dev in status.fields["body"]["devices"] for c in dev["clients"]]
    assert [c["id"] for c in clients] == [GOOD_ID], clients
    assert clients[0]["state"] in ("idle", "waiting"), clients  # released: not running


async def wait_for_no_fuzz_state(h: Harness) -> None:
    """The fuzz connection's Leave is immediate, but its handler finishes on the loop: wait."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3.0
    while True:
        sched = h.scheduler
        clients = [c["id"] for dev in sched.status_document()["devices"] for c in dev["clients"]]
        state = (clients, sorted(sched._shims), len(sched._connections))
        if state == ([GOOD_ID], [GOOD_ID], h.baseline_connections):
            return
        assert loop.time() < deadline, f"state left behind by a closed fuzz connection: {state}"
        await asyncio.sleep(0.005)


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=fuzz_inputs, cuts=st.lists(st.integers(0, 1 << 16), max_size=3))
async def test_scheduler_survives_fuzzed_frames(
    harness: Harness,
    sock_path: str,
    caplog: pytest.LogCaptureFixture,
    data: bytes,
    cuts: list[int],
) -> None:
    caplog.set_level(logging.WARNING)
    caplog.clear()
    h = harness
    msgs, error, pending = expected_outcome(data)
    reader, writer = await asyncio.open_unix_connection(sock_path)
    decoder = FrameDecoder()
    try:
        # The bytes in a few chunks, so the scheduler's decoder sees frames split anywhere.
        points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for start, end in itertools.pairwise(points):
                writer.write(data[start:end])
                await writer.drain()
                await asyncio.sleep(0)
        event("protocol error" if error else "incomplete frame" if pending else "whole frames")
        if error is not None:
            # A protocol error: the scheduler answers ERROR with the decoder's code and closes.
            got, closed = await read_frames(reader, decoder, lambda m: False, 3.0)
            assert closed, f"no close after a protocol error ({error.message}); got {got}"
            assert got and got[-1].type == MsgType.ERROR, (error.message, got)
            assert got[-1].fields["error_code"] == int(error.code), (error.message, got[-1])
        elif pending == 0:
            # Whole frames only: the connection stays open and the scheduler reads past them all.
            token = f"sentinel-{next(_sentinels)}"
            writer.write(encode(Message(MsgType.CONTROL, {"body": {"action": "release",
                                                                   "client": token}})))  # fmt: skip
            got, closed = await read_frames(
                reader,
                decoder,
                lambda m: m.type == MsgType.ERROR and token in m.fields.get("message", ""),
                3.0,
            )
            assert not closed and got, f"no answer to the sentinel after {msgs}: {got}"
            assert got[-1].fields["error_code"] == ErrorCode.NOT_FOUND
            for msg in got:
                assert msg.type in SCHEDULER_TYPES, msg
                if msg.type == MsgType.ERROR:
                    assert msg.fields["error_code"] not in (
                        ErrorCode.BAD_FRAME,
                        ErrorCode.BAD_VERSION,
                    ), (msgs, msg)
        else:
            # Inside a frame: the scheduler waits for the rest (answers to whole frames aside).
            got, closed = await read_frames(reader, decoder, lambda m: False, 0.02)
            assert not closed, f"closed while a frame was incomplete: {got}"
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    await wait_for_no_fuzz_state(h)
    await good_flow(h)
    event(f"scheduler warnings: {sum(r.levelno == logging.WARNING for r in caplog.records)}")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]


# --------------------------------------------------------------------------------------------
# Round trip of protocol.py


@st.composite
def any_messages(draw: st.DrawFn) -> Message:
    mtype = draw(st.sampled_from(list(MsgType)) | st.integers(0, 255))
    msg = Message(mtype, draw(random_fields()))
    try:
        encode(msg)
    except ValueError:
        assume(False)  # over the frame's limits
    return msg


@settings(max_examples=300, deadline=None)
@given(
    msgs=st.lists(any_messages(), min_size=1, max_size=5),
    cuts=st.lists(st.integers(0, 1 << 20), max_size=8),
)
def test_encode_decode_round_trip(msgs: list[Message], cuts: list[int]) -> None:
    frames = [encode(m) for m in msgs]
    for msg, frame in zip(msgs, frames, strict=True):
        decoded = decode_frame(frame)
        assert decoded == msg
    stream = b"".join(frames)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    decoder = FrameDecoder()
    out: list[Message] = []
    for start, end in itertools.pairwise(points):
        out.extend(decoder.feed(stream[start:end]))
    decoder.eof()
    assert out == msgs
    assert decoder.pending == 0


# --------------------------------------------------------------------------------------------
# Regressions the fuzzer found (kept as plain examples)


async def test_set_quota_over_u64_is_a_bad_request(harness: Harness) -> None:
    await harness.ctl.send(
        MsgType.CONTROL, body={"action": "set_quota", "client": GOOD_ID, "quota": 1 << 64}
    )
    err = await harness.ctl.expect(MsgType.ERROR)
    assert err.fields["error_code"] == ErrorCode.BAD_REQUEST
    await good_flow(harness)


async def test_status_survives_devices_too_large_for_a_frame(
    harness: Harness, connect: Any
) -> None:
    # HELLO refuses long device uuids and names (next test), so only many devices (NVML on a big
    # node, or shims of many devices) can make the list this large: the fallback stays as defence
    # in depth. Three ~30 KiB names: over the frame limit even without clients.
    for n in range(3):
        harness.scheduler._register_device(f"GPU-{n}", "z" * 30000, 1 << 30)
    await harness.ctl.send(MsgType.STATUS_REQUEST)
    status = await harness.ctl.expect(MsgType.STATUS)
    assert status.fields["body"]["truncated"] is True
    assert status.fields["body"]["devices_truncated"] == 4


async def test_hello_with_an_oversized_device_is_refused(harness: Harness, connect: Any) -> None:
    """Devices are never forgotten: a HELLO may not register an arbitrarily long uuid or name."""
    shim = await connect()
    await shim.send(
        MsgType.HELLO, client_id="fz-long", pid=1, device_uuid="GPU-" + "z" * 100, device_total=1
    )
    err = await shim.expect(MsgType.ERROR)
    assert err.fields["error_code"] == ErrorCode.BAD_REQUEST
    assert "device_uuid" in err.fields["message"]
    await shim.close()
    await harness.ctl.send(MsgType.STATUS_REQUEST)
    status = await harness.ctl.expect(MsgType.STATUS)
    assert all(len(d["uuid"]) <= 64 for d in status.fields["body"]["devices"])
    assert "fz-long" not in {
        c["id"] for d in status.fields["body"]["devices"] for c in d["clients"]
    }
