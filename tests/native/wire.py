"""The wire format spoken by hand, for tests whose scheduler is a stand-in on a socket: they see
the bytes the shim sends and send what they choose, whatever the Python side's field table
holds."""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from jupyter_gpushare.protocol import FIELD_HEADER, HEADER, MAGIC, U64, VERSION, MsgType

ROOT = Path(__file__).resolve().parents[2]


def c_tags() -> dict[str, int]:
    text = (ROOT / "native" / "src" / "base" / "protocol.h").read_text()
    return {m[0]: int(m[1]) for m in re.findall(r"GS_TAG_(\w+) = (\d+)", text) if m[0] != "MAX"}


def frame(mtype: int, fields: list[tuple[int, bytes]]) -> bytes:
    payload = b"".join(FIELD_HEADER.pack(tag, len(raw)) + raw for tag, raw in fields)
    return HEADER.pack(MAGIC, VERSION, mtype, 0, len(payload)) + payload


def read_frame(conn: socket.socket) -> tuple[int, dict[int, bytes]]:
    def exactly(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    _magic, _version, mtype, _reserved, length = HEADER.unpack(exactly(HEADER.size))
    payload = exactly(length)
    fields: dict[int, bytes] = {}
    pos = 0
    while pos < len(payload):
        tag, flen = FIELD_HEADER.unpack_from(payload, pos)
        pos += FIELD_HEADER.size
        fields[tag] = payload[pos : pos + flen]
        pos += flen
    return mtype, fields


def expect(conn: socket.socket, mtype: int) -> dict[int, bytes]:
    while True:
        got, fields = read_frame(conn)
        if got == mtype:
            return fields


def u64(v: int) -> bytes:
    return U64.pack(v)


def field_u64(fields: dict[int, bytes], tag: int) -> int:
    return U64.unpack(fields[tag])[0]


class StandInScheduler:
    """A scheduler on ``path`` that runs ``script(conn)`` for the first shim that connects, on a
    thread; ``join`` re-raises what the script raised."""

    def __init__(self, path: Path, script: Callable[[socket.socket], None]) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(4)
        self.server.settimeout(60)
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(script,), daemon=True)
        self.thread.start()

    def _run(self, script: Callable[[socket.socket], None]) -> None:
        try:
            conn, _ = self.server.accept()
            conn.settimeout(60)
            with conn:
                script(conn)
        except BaseException as exc:  # re-raised in join
            self.errors.append(exc)

    def join(self, timeout: float = 30) -> None:
        self.thread.join(timeout)
        self.server.close()
        assert not self.thread.is_alive(), "the stand-in scheduler's script did not end"
        if self.errors:
            raise self.errors[0]


def until_closed(conn: socket.socket) -> None:
    """Read (and drop) what the shim sends until it closes the connection."""
    try:
        while True:
            read_frame(conn)
    except (EOFError, OSError):
        pass


def granted_until_idle(conn: socket.socket, idle: threading.Event) -> None:
    """A scheduler's side until the program is idle: welcome it, grant its first request, and
    wait until the test sets ``idle``."""
    expect(conn, MsgType.HELLO)
    conn.sendall(frame(MsgType.WELCOME, []))
    expect(conn, MsgType.REQUEST)
    conn.sendall(frame(MsgType.GRANT, [(c_tags()["FLAG"], u64(0))]))
    assert idle.wait(30), "the program did not go idle"


def evict_while_idle(
    conn: socket.socket, idle: threading.Event, revoke: list[tuple[int, bytes]]
) -> dict[str, dict[int, bytes]]:
    """A scheduler's side of one cycle: grant the device, wait until the test sets ``idle`` (the
    program went idle), revoke with ``revoke``'s fields, grant again with restore when the
    program asks; the RELEASED and RESTORED the shim answered with."""
    tags = c_tags()
    granted_until_idle(conn, idle)
    conn.sendall(frame(MsgType.REVOKE, revoke))
    released = expect(conn, MsgType.RELEASED)
    expect(conn, MsgType.REQUEST)  # the program reads its memory back
    conn.sendall(frame(MsgType.GRANT, [(tags["FLAG"], u64(1))]))
    restored = expect(conn, MsgType.RESTORED)
    until_closed(conn)
    return {"released": released, "restored": restored}
