"""The shim's side of the node's host budget (docs/protocol.md, "Host memory"): it reports the
host memory its engine holds (host_bytes, tag 49) and the part that is staging of resident memory
(staging_bytes, tag 50) in REQUEST, MEMORY and a move's answer; it makes staging only up to the
allowance a STAGING (0x8B) gives, and gives back what it holds for resident blocks past a lowered
one, never an evicted block's (its data lives only there). The scheduler is a stand-in that
sends the messages itself."""

from __future__ import annotations

import socket
import threading
import time

from jupyter_gpushare.protocol import MsgType
from tests.native.wire import StandInScheduler, c_tags, expect, field_u64, frame, read_frame, u64

MiB = 1 << 20
BLOCK = 64 * MiB
TAGS = c_tags()
FLAG, HOST, STAGING = TAGS["FLAG"], TAGS["HOST_BYTES"], TAGS["STAGING_BYTES"]


def _reading(conn: socket.socket, seen: list[tuple[int, int]]) -> tuple[int, dict[int, bytes]]:
    """The next message; the (host, staging) it reports, if any, goes into ``seen``."""
    mtype, fields = read_frame(conn)
    if HOST in fields:
        seen.append((field_u64(fields, HOST), field_u64(fields, STAGING)))
    return mtype, fields


def _until_memory(conn: socket.socket, seen: list[tuple[int, int]], staging: int, host: int):
    """Read until the latest report (a MEMORY, or a move's answer) says ``host`` and ``staging``
    bytes; every (host, staging) a report said goes into ``seen``."""
    deadline = time.monotonic() + 30
    while not seen or seen[-1] != (host, staging):
        if time.monotonic() > deadline:
            raise AssertionError(f"no report of host {host}, staging {staging}: {seen}")
        try:
            _reading(conn, seen)
        except EOFError:  # the program ended its idle and left first
            raise AssertionError(
                f"no report of host {host}, staging {staging} while it ran: {seen}"
            ) from None


def _until_answer(conn: socket.socket, seen: list[tuple[int, int]], mtype: int) -> tuple[int, int]:
    """Read until the answer ``mtype``; the MEMORY reports before it go into ``seen`` too (the
    shim reports what changed before it answers a move), and so does the answer's own."""
    while True:
        got, fields = _reading(conn, seen)
        if got == mtype:
            return field_u64(fields, HOST), field_u64(fields, STAGING)


def test_staging_stays_within_the_allowance_and_a_lowered_one_is_given_back(harness):
    seen: list[tuple[int, int]] = []
    moved: dict[str, tuple[int, int]] = {}
    idle = threading.Event()
    # The program's blocks stay after its checks until the script has seen the give-back below:
    # its next call (which brings them back) comes at its idle's end, and its frees would race
    # the shim's giving back (seen lost once, loaded, in a background job).
    seen_all = harness.tmp / "seen-all"

    def script(conn: socket.socket) -> None:
        try:
            steps(conn)
        finally:
            seen_all.touch()

    def steps(conn: socket.socket) -> None:
        expect(conn, MsgType.HELLO)
        conn.sendall(frame(MsgType.WELCOME, []))
        request = expect(conn, MsgType.REQUEST)
        # What it made before any allowance (staging for every block, as without a scheduler
        # that sends one), if its allocations paused long enough before this first call.
        assert field_u64(request, STAGING) <= field_u64(request, HOST) <= 4 * BLOCK
        conn.sendall(frame(MsgType.GRANT, [(FLAG, u64(0))]))
        conn.sendall(frame(MsgType.STAGING, [(STAGING, u64(2 * BLOCK))]))
        _until_memory(conn, seen, 2 * BLOCK, 2 * BLOCK)  # two of the four blocks, no more
        assert idle.wait(30), "the program did not go idle"
        time.sleep(0.5)  # no more staging comes meanwhile
        conn.sendall(frame(MsgType.STAGING, [(STAGING, u64(BLOCK))]))
        _until_memory(conn, seen, BLOCK, BLOCK)  # one given back
        # Evicted, every block has host memory (the copies): none of it is resident staging.
        conn.sendall(frame(MsgType.REVOKE, [(FLAG, u64(1))]))
        moved["released"] = _until_answer(conn, seen, MsgType.RELEASED)
        expect(conn, MsgType.REQUEST)
        conn.sendall(frame(MsgType.GRANT, [(FLAG, u64(1))]))
        moved["restored"] = _until_answer(conn, seen, MsgType.RESTORED)
        # Back on the device, the blocks' staging is resident staging again, past the
        # allowance: all but one block's is given back, said by the restore's answer when it
        # was done by then, or by a report after it.
        _until_memory(conn, seen, BLOCK, BLOCK)
        seen_all.touch()  # the program may free its blocks and end now
        while True:
            try:
                read_frame(conn)
            except (EOFError, OSError):
                break

    sched = StandInScheduler(harness.socket_path, script)
    # Idle long enough for the steps before the revoke, on a loaded machine too.
    proc = harness.spawn(
        "blocks",
        4,
        BLOCK,
        15.0,
        idle_seconds=0,
        context_bytes=16 * MiB,
        extra={"PROBE_BLOCKS_KEEP_UNTIL": str(seen_all)},
    )
    proc.wait_event("idle_start", 30)
    idle.set()
    run = proc.finish(60).ok()
    sched.join()
    assert run.event("blocks_end")["data_ok"], run.stderr
    assert moved["released"] == (4 * BLOCK, 0), moved
    # The restore wakes the preparer, which may already have given some back.
    assert BLOCK <= moved["restored"][0] <= 4 * BLOCK, moved
    # Once within the allowance, never past it again: 2 blocks, then 1 (until evicted).
    first = seen.index((2 * BLOCK, 2 * BLOCK))
    lowered = seen.index((BLOCK, BLOCK), first)
    assert max(h for h, _s in seen[first : lowered + 1]) <= 2 * BLOCK, seen
