"""The resume proof (issue 15): the shim keeps the secret of the latest GRANT (tag 42) and sends
it back in its HELLO when it claims its grant back (resume = 1) from a restarted scheduler.

The scheduler here is a stand-in on a socket that speaks the wire format directly, so the test
sees the bytes the shim sends whatever the Python side's field table holds."""

from __future__ import annotations

import socket
import threading

from jupyter_gpushare.protocol import U64, MsgType
from tests.native.probe import spawn_probe
from tests.native.wire import c_tags, expect, frame, read_frame, u64

TAG_FLAG, TAG_RESUME, TAG_SECRET = 14, 39, 42


def test_the_latest_grant_secret_goes_back_in_a_resuming_hello(harness, shim_probe):
    assert c_tags()["RESUME_SECRET"] == TAG_SECRET
    secrets = ["0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210"]
    hellos: list[dict[int, bytes]] = []
    errors: list[BaseException] = []
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(harness.socket_path))
    server.listen(4)
    server.settimeout(30)

    def scheduler() -> None:
        try:
            conn, _ = server.accept()
            hellos.append(expect(conn, MsgType.HELLO))
            conn.sendall(frame(MsgType.WELCOME, []))
            for i, secret in enumerate(secrets):
                expect(conn, MsgType.REQUEST)
                conn.sendall(
                    frame(MsgType.GRANT, [(TAG_FLAG, u64(0)), (TAG_SECRET, secret.encode())])
                )
                if i == 0:
                    conn.sendall(frame(MsgType.REVOKE, [(TAG_FLAG, u64(0))]))
                    expect(conn, MsgType.RELEASED)
            conn.close()  # the scheduler "restarts" while the shim holds the device
            conn, _ = server.accept()
            hellos.append(expect(conn, MsgType.HELLO))
            conn.sendall(frame(MsgType.WELCOME, [(TAG_RESUME, u64(1))]))
            conn.settimeout(10)
            try:
                while True:
                    read_frame(conn)
            except (EOFError, OSError):
                pass
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=scheduler, daemon=True)
    thread.start()
    proc = spawn_probe(harness, shim_probe, "launches", 2, 20000, idle_seconds=0)
    run = proc.finish(60).ok()
    thread.join(15)
    server.close()
    assert not errors, errors
    assert len(hellos) == 2, run.describe()
    first, resumed = hellos
    assert TAG_SECRET not in first  # nothing to prove on a first HELLO
    assert U64.unpack(resumed[TAG_RESUME])[0] == 1, run.describe()
    assert resumed[TAG_SECRET].decode() == secrets[-1]
