"""Issue 21 item 2: memory that would only be evicted is never backed. B holds the device beside A
from a small first cell; its room is the pool less A's memory. B then allocates more than that
room: the allocation succeeds without physical memory, B gives the device back and waits (its
status says waiting, the scheduler's too), and once A has left B is granted again and the memory
is backed, copying nothing. Before the fix, B's allocation was backed beside A's, B was revoked
("memory grew past the pool") and its fresh memory copied to the host (6.2 s for 14 GiB on an
H100, docs/gpu-verification.md)."""

from __future__ import annotations

import re
import time

from jupyter_gpushare.protocol import MsgType

# A's and B's BIG together (plus contexts) do not fit the 1 GiB pool.
from tests.native.test_deferred_backing import BIG, CONTEXT, MiB, common
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


def b_waits_unbacked_then_runs(sched, a, b) -> None:
    """From B's allocation past its room to the end of both runs (see the module docstring)."""
    allocated = b.wait_event("allocated", 30)
    # The allocation succeeded, and none of it is on the device: it counts as on the host.
    assert allocated["device_bytes"] < BIG, "memory past the grant's room was backed"
    assert allocated["status"]["evicted_bytes"] == BIG, allocated["status"]
    blocked = b.wait_event("blocked", 30)
    assert blocked["status"]["state"] == "waiting", blocked["status"]
    assert blocked["device_bytes"] < BIG, blocked
    # The scheduler sees a waiter whose new memory is not resident, not a holder past the pool.
    entry: dict = {}
    deadline = time.monotonic() + 5.0  # A holds 8 s from its first copy: B still waits
    while time.monotonic() < deadline:
        device = sched.status()["devices"][0]
        entry = next((c for c in device["clients"] if c["id"] == "B"), {})
        if entry.get("state") == "waiting" and entry.get("evicted_bytes") == BIG:
            break
        time.sleep(0.05)
    assert entry.get("state") == "waiting" and entry.get("evicted_bytes") == BIG, entry
    assert device["resident_bytes"] < 2 * BIG, device
    first = b.wait_event("first_copy", 60)
    assert first["waited"] > 1.0, "B's copy into its new memory should have waited for A"
    assert first["device_bytes"] >= BIG, first
    assert first["status"]["state"] == "holding" and first["status"]["evicted_bytes"] == 0
    # Its grant's RESTORED found nothing to copy back: the memory was never written.
    assert (first["status"]["restores"], first["status"]["last_restore_bytes"]) == (1, 0)
    rb, ra = b.finish(60).ok(), a.finish(60).ok()
    assert rb.event("hold_end")["data_ok"] and ra.event("hold_end")["data_ok"]
    # Nothing of B's was ever copied to the host (no eviction of memory never written), and the
    # scheduler never revoked B for growing past the pool.
    assert rb.stats["copy_to_host_bytes"] <= 4 * MiB, rb.stats  # only its own 4 MiB read-back
    assert rb.stats["copy_to_device_bytes"] <= 4 * MiB, rb.stats  # only its own 4 MiB write
    assert "evicted client=" not in sched.log, sched.log  # A left; nobody was evicted
    assert "grew past the pool" not in sched.log, sched.log
    assert re.search(r"restored client=B bytes=0 ", sched.log), sched.log
    assert any("past its grant's room" in line for line in rb.shim_lines), rb.stderr


def test_an_allocation_past_the_grants_room_waits_unbacked_for_a_grant_with_room(harness):
    """B is granted while A holds its memory: B's grant's room is the pool less A's."""
    # A's quantum outlasts its cell: B waits for A to leave, not for A's eviction.
    sched = harness.scheduler(pool="1GiB", quantum=30.0)
    a = harness.spawn("hold", 8.0, BIG, 20000, **common("A"))
    a.wait_event("first_copy", 30)
    b = harness.spawn("grow", 0.3, BIG, 0.3, **common("B"))
    granted = b.wait_event("granted", 30)
    assert granted["status"]["state"] == "holding", granted["status"]  # beside A: it fitted
    b_waits_unbacked_then_runs(sched, a, b)


def test_a_holders_room_shrinks_when_memory_comes_beside_it(harness):
    """B is granted alone (its room: the whole pool); A is granted beside it and fills most of
    the pool. The scheduler tells B its smaller room (ROOM): B's next big allocation waits
    unbacked, where the room of B's grant would have had it backed beside A's, then evicted."""
    sched = harness.scheduler(pool="1GiB", quantum=30.0)
    go = harness.tmp / "grow-now"
    b = harness.spawn("grow", 0.3, BIG, 0.3, extra={"PROBE_GROW_AFTER": str(go)}, **common("B"))
    granted = b.wait_event("granted", 30)
    assert granted["status"]["state"] == "holding", granted["status"]
    a = harness.spawn("hold", 8.0, BIG, 20000, **common("A"))
    a.wait_event("first_copy", 30)

    def b_room() -> int:
        rooms = re.findall(r"room client=B bytes=(\d+)", sched.log)
        return int(rooms[-1]) if rooms else 1 << 40

    deadline = time.monotonic() + 10.0  # A's memory reaches the scheduler, then B's room
    while time.monotonic() < deadline and b_room() >= BIG:
        time.sleep(0.05)
    assert b_room() == (1 << 30) - BIG - 64 * MiB, sched.log  # the pool less A's 704 MiB
    go.touch()
    b_waits_unbacked_then_runs(sched, a, b)


def test_what_the_shim_says_when_it_goes_past_its_room(harness):
    """The wire, against a stand-in scheduler: past its room the holder says RELEASED (flag 0:
    nothing evicted, the new memory on the host) and REQUEST (its new memory in evicted_bytes),
    sends no MEMORY as a holder first, drops a REVOKE that crosses its release, and is backed
    by the next GRANT even without the restore flag: nothing copied, the data right."""
    tags = c_tags()
    said: dict[str, dict[int, bytes]] = {}

    def script(conn) -> None:
        expect(conn, MsgType.HELLO)
        conn.sendall(frame(MsgType.WELCOME, []))
        expect(conn, MsgType.REQUEST)
        room = [(tags["FLAG"], u64(0)), (tags["ROOM_BYTES"], u64(CONTEXT + 32 * MiB))]
        conn.sendall(frame(MsgType.GRANT, room))
        while True:  # MEMORY reports before the allocation say nothing of it
            mtype, fields = read_frame(conn)
            if mtype != MsgType.MEMORY:
                break
            assert field_u64(fields, tags["USED_BYTES"]) < BIG, fields
        assert mtype == MsgType.RELEASED, mtype
        said["released"] = fields
        said["request"] = expect(conn, MsgType.REQUEST)
        conn.sendall(frame(MsgType.REVOKE, [(tags["FLAG"], u64(1))]))  # crossed: dropped
        time.sleep(0.5)
        conn.sendall(frame(MsgType.GRANT, [(tags["FLAG"], u64(0))]))  # no room: no limit
        until_closed(conn)

    sched = StandInScheduler(harness.socket_path, script)
    b = harness.spawn("grow", 0.3, BIG, 0.3, **common("B"))
    run = b.finish(60).ok()
    sched.join()
    assert field_u64(said["released"], tags["FLAG"]) == 0
    assert field_u64(said["released"], tags["EVICTED_BYTES"]) == BIG
    assert field_u64(said["request"], tags["EVICTED_BYTES"]) == BIG
    assert field_u64(said["request"], tags["USED_BYTES"]) == CONTEXT + BIG
    assert run.event("hold_end")["data_ok"]
    first = run.event("first_copy")
    assert first["device_bytes"] >= BIG and first["status"]["evicted_bytes"] == 0, first
    assert run.stats["copy_to_host_bytes"] <= 4 * MiB, run.stats  # the REVOKE evicted nothing
