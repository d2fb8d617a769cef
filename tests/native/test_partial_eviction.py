"""Partial eviction (issue 21 item 3): a REVOKE or EVICT with evict_bytes (tag 44) frees at least
that many bytes, not the whole process; the least recently used blocks go first (blocks are
stamped when made, restored or backed at a grant: docs/architecture.md, "Partial eviction"), and
the GRANT with restore that follows brings back only what was evicted. The scheduler is a
stand-in that sends the field itself, whatever the policy does with it."""

from __future__ import annotations

import socket
import threading

from tests.native.wire import StandInScheduler, c_tags, evict_while_idle, field_u64, u64

MiB = 1 << 20
BLOCK = 64 * MiB
TAGS = c_tags()
FLAG, EVICTED, MOVED, EVICT_BYTES = (
    TAGS["FLAG"],
    TAGS["EVICTED_BYTES"],
    TAGS["BYTES_MOVED"],
    TAGS["EVICT_BYTES"],
)


def test_an_eviction_frees_what_was_asked_least_recently_used_first(harness):
    seen: dict[str, int] = {}
    idle = threading.Event()

    def script(conn: socket.socket) -> None:
        # Room for 1.5 blocks: two whole blocks go (the oldest two), not four.
        got = evict_while_idle(conn, idle, [(FLAG, u64(1)), (EVICT_BYTES, u64(BLOCK * 3 // 2))])
        seen["evicted"] = field_u64(got["released"], EVICTED)
        seen["moved"] = field_u64(got["released"], MOVED)
        seen["restored"] = field_u64(got["restored"], MOVED)  # only what was evicted

    sched = StandInScheduler(harness.socket_path, script)
    proc = harness.spawn("blocks", 4, BLOCK, 2.0, idle_seconds=0.3, context_bytes=64 * MiB)
    proc.wait_event("idle_start", 30)
    idle.set()
    run = proc.finish(60).ok()
    sched.join()
    assert seen["evicted"] == 2 * BLOCK, (seen, run.stderr)
    assert seen["moved"] == 2 * BLOCK, seen  # nothing was pre-copied: both were copied out
    assert seen["restored"] == 2 * BLOCK, seen  # only the evicted blocks come back
    assert run.event("blocks_end")["data_ok"], run.stderr
    # The blocks that stayed were never copied out: the host received two blocks' worth.
    assert run.stats["copy_to_host_bytes"] < 3 * BLOCK, run.stats
