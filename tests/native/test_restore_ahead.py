"""Restore ahead (issue 21 item 6; docs/protocol.md, "Restore ahead"): a RESTORE_AHEAD brings a
process's evicted memory back while it does not hold the device. Its launches stay gated until
the GRANT, which then has nothing left to restore. Taking the room back before the process runs
copies the blocks out again: a restore does not mark them clean (a write by a call the gate does
not count, a copy into device memory, would then be lost: tests/native/test_contexts.py). The
scheduler is a stand-in that sends the messages itself."""

from __future__ import annotations

import socket
import threading
import time

from jupyter_gpushare.protocol import MsgType
from tests.native.wire import (
    StandInScheduler,
    c_tags,
    expect,
    field_u64,
    frame,
    granted_until_idle,
    u64,
    until_closed,
)

MiB = 1 << 20
BLOCK = 64 * MiB
BLOCKS = 4
TAGS = c_tags()
FLAG, EVICTED, MOVED, PRECOPIED = (
    TAGS["FLAG"],
    TAGS["EVICTED_BYTES"],
    TAGS["BYTES_MOVED"],
    TAGS["PRECOPIED_BYTES"],
)
STAGED = BLOCKS * BLOCK
#: The stand-in holds the program's request this long before granting it.
HOLD_S = 0.5


def test_a_restore_ahead_moves_the_memory_back_while_launches_wait_for_the_grant(harness):
    seen: dict[str, object] = {}
    idle = threading.Event()

    def script(conn: socket.socket) -> None:
        granted_until_idle(conn, idle)
        conn.sendall(frame(MsgType.REVOKE, [(FLAG, u64(1))]))
        seen["released"] = expect(conn, MsgType.RELEASED)
        # idle and evicted: its memory comes back ahead of any turn
        conn.sendall(frame(MsgType.RESTORE_AHEAD, []))
        seen["ahead"] = expect(conn, MsgType.RESTORED)
        # someone needs the room after all: the restored blocks leave without a copy
        conn.sendall(frame(MsgType.EVICT, []))
        seen["evicted"] = expect(conn, MsgType.EVICTED)
        conn.sendall(frame(MsgType.RESTORE_AHEAD, []))
        seen["ahead2"] = expect(conn, MsgType.RESTORED)
        expect(conn, MsgType.REQUEST)  # the program reads its memory: it waits at the gate
        time.sleep(HOLD_S)
        seen["granted_at"] = time.monotonic()
        conn.sendall(frame(MsgType.GRANT, [(FLAG, u64(1))]))
        seen["grant_restore"] = expect(conn, MsgType.RESTORED)
        until_closed(conn)

    sched = StandInScheduler(harness.socket_path, script)
    # Staging made at once, and ready before the eviction: a staging made later (the cold path's
    # pageable copy replaced) would give up the restored blocks' host copy, as it gives up a
    # pre-copy (memory/prepare.c).
    quick = {"GPUSHARE_STAGING_QUIET": "0"}
    proc = harness.spawn(
        "blocks", BLOCKS, BLOCK, 3.0, idle_seconds=0.3, context_bytes=64 * MiB, extra=quick
    )
    proc.wait_event("tick", 30, where=lambda e: e["status"]["staging_pinned_bytes"] >= STAGED)
    idle.set()
    run = proc.finish(60).ok()
    sched.join()
    everything = BLOCKS * BLOCK
    assert field_u64(seen["released"], EVICTED) == everything, (seen, run.stderr)
    ahead = seen["ahead"]
    assert field_u64(ahead, FLAG) == 1  # the answer to the RESTORE_AHEAD, not to a grant
    assert field_u64(ahead, MOVED) == everything, (ahead, run.stderr)
    assert field_u64(ahead, EVICTED) == 0
    assert field_u64(ahead, PRECOPIED) == 0  # not taken for clean (see the docstring)
    assert field_u64(seen["evicted"], MOVED) == everything, run.stderr  # copied out again
    assert field_u64(seen["evicted"], EVICTED) == everything
    assert field_u64(seen["ahead2"], MOVED) == everything
    # The grant found nothing left to restore, and the program's read (a gated call) ran after
    # it: the memory moved while its launches waited.
    assert field_u64(seen["grant_restore"], MOVED) == 0
    assert field_u64(seen["grant_restore"], FLAG) == 0
    end = run.event("blocks_end")
    assert end["data_ok"], run.stderr
    assert end["t_mono"] > seen["granted_at"], (end, seen["granted_at"])
    # Copied out twice (both evictions), back twice (both restores ahead).
    assert run.stats["copy_to_host_bytes"] >= 2 * everything, run.stats
    assert run.stats["copy_to_device_bytes"] >= 2 * everything, run.stats
