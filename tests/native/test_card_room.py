"""Issue 34, item 1, the shim's part: a driver out-of-memory while the process holds a grant with
a room is a wait for room, never an error returned to the program.

At the default pool (the whole card) the scheduler's accounting and the card can disagree: memory
the pool does not see (another process outside gpushare, contexts larger than their estimate)
makes the driver refuse an allocation that the grant's room allows. Before the fix the shim
returned that CUDA_ERROR_OUT_OF_MEMORY to the program (a notebook's "CUDA out of memory" beside
an idle neighbour, H200, e5353ea). Now the allocation gets its address and no memory, its
device's gate stays shut, and the shim gives the device back and asks again, its REQUEST saying
by how much the driver fell short (``short_bytes``), so that the scheduler evicts that much more.
Where nothing more can move (here: the stand-in's "other processes" never leave), the shim gives
up after a bounded number of grants: the program's next call fails with out of memory and one
line that says why, and no call ever ran on memory that was not there.
"""

from __future__ import annotations

import time

from jupyter_gpushare.protocol import MsgType
from tests.native.test_deferred_backing import BIG, MiB, common
from tests.native.wire import (
    StandInScheduler,
    c_tags,
    expect,
    field_u64,
    frame,
    read_frame,
    u64,
    until_closed,
)

CARD = 1024 * MiB
OTHERS = 512 * MiB  # held by processes the pool does not see: BIG no longer fits the card
ROOM = 8 * 1024 * MiB  # the grant's room: as far as the scheduler knows, BIG fits
# After the refusal, grants that bring nothing back before the shim gives up: ROOM_TRIES (3,
# memory/defer.c) and the one that finds it has tried enough.
RETRIES = 4


def test_a_driver_refusal_under_a_room_waits_and_says_how_short_the_device_was(harness):
    tags = c_tags()
    requests: list[dict[int, bytes]] = []
    releases: list[dict[int, bytes]] = []

    grants: list[float] = []

    def script(conn) -> None:
        """A scheduler that grants every wait once, as the real one does: a REQUEST from a
        client already granted since its last RELEASED only updates its footprint (the shim can
        ask twice when its program's call and its own thread both see the device given back)."""
        expect(conn, MsgType.HELLO)
        conn.sendall(frame(MsgType.WELCOME, []))
        expect(conn, MsgType.REQUEST)
        grant = [(tags["FLAG"], u64(1)), (tags["ROOM_BYTES"], u64(ROOM))]
        conn.sendall(frame(MsgType.GRANT, grant))
        granted = True
        while True:
            try:
                mtype, fields = read_frame(conn)
            except EOFError:  # the program ended (its call failed)
                return
            if mtype == MsgType.RELEASED:
                releases.append(fields)
                granted = False
            elif mtype == MsgType.REQUEST:
                requests.append(fields)
                if not granted:
                    granted = True
                    grants.append(time.monotonic())
                    try:
                        conn.sendall(frame(MsgType.GRANT, grant))
                    except BrokenPipeError:  # its program ended meanwhile
                        return
            elif mtype in (MsgType.GOODBYE, MsgType.IDLE):
                break
        until_closed(conn)

    sched = StandInScheduler(harness.socket_path, script)
    extra = {"GPUSHARE_FAKE_DEVICE_TOTAL": str(CARD), "GPUSHARE_FAKE_OTHER_BYTES": str(OTHERS)}
    b = harness.spawn("grow", 0.3, BIG, 0.3, extra=extra, **common("B"))
    run = b.finish(60)
    sched.join()
    # The allocation itself succeeded (its address, no memory); the program's first call on it
    # waited through the grants and then failed, once the shim gave up.
    allocated = run.event("allocated")
    assert allocated["device_bytes"] < BIG, allocated
    assert allocated["status"]["evicted_bytes"] == BIG, allocated["status"]
    assert run.returncode != 0 and not run.all("first_copy"), run.describe()
    # Each grant was handed back unused (RELEASED, nothing evicted) and asked for again, every
    # REQUEST naming the shortfall: what BIG needs beyond the card's free memory.
    assert len(grants) == RETRIES, (len(grants), run.stderr)
    # The grant that finds it has tried enough is given back without asking, unless the program's
    # failing call ends the program first.
    assert len(releases) in (RETRIES, RETRIES + 1), len(releases)
    assert all(field_u64(f, tags["FLAG"]) == 0 for f in releases)
    free = CARD - OTHERS - allocated["device_bytes"]
    shorts = [
        field_u64(f, tags["SHORT_BYTES"]) if tags["SHORT_BYTES"] in f else 0 for f in requests
    ]
    assert all(s == BIG - free for s in shorts), (shorts, BIG - free)
    assert all(field_u64(f, tags["EVICTED_BYTES"]) == BIG for f in requests)
    # One line says why the call failed; no out-of-memory reached the program at the allocation.
    why = [line for line in run.shim_lines if "cannot come back to device 0" in line]
    assert len(why) == 1, run.stderr
    assert "after the scheduler moved what it could" in why[0]
