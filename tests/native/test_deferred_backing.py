"""Memory a waiting process allocates is not backed on the device until its grant (issue 11: a
waiter's fresh memory must never need evicting). On the stand-in, whose cuMemCreate memory is
counted in live_device_bytes: B allocates while A holds the device; B's physical memory does not
grow until B's grant, the scheduler sees none of it resident meanwhile, and B is never evicted."""

from __future__ import annotations

import re
import time

MiB = 1 << 20
CONTEXT = 64 * MiB
BIG = 640 * MiB  # two of these (plus contexts) do not fit a 1 GiB pool


def common(client: str) -> dict:
    return {"context_bytes": CONTEXT, "idle_seconds": 5, "log": "info", "client_id": client}


def resident_of(sched, client: str) -> int:
    device = sched.status()["devices"][0]
    return sum(c["used_bytes"] - c["evicted_bytes"] for c in device["clients"] if c["id"] == client)


def test_a_waiters_allocation_is_backed_only_at_its_grant(harness):
    sched = harness.scheduler(pool="1GiB", quantum=5.0)
    a = harness.spawn("hold", 3.0, BIG, 20000, **common("A"))
    a.wait_event("first_copy", 30)
    b = harness.spawn("hold", 0.5, BIG, 20000, **common("B"))
    allocated = b.wait_event("allocated", 30)
    assert allocated["device_bytes"] < BIG, "a waiter's allocation was backed on the device"
    assert allocated["status"]["evicted_bytes"] == BIG, allocated["status"]
    assert allocated["status"]["state"] != "holding"
    # While B waits, the scheduler sees B's memory as not resident (B's report says it is all
    # off the device) and counts none of it in the device's resident bytes.
    deadline = time.monotonic() + 2.0  # A holds 3 s: B is still waiting meanwhile
    entry: dict = {}
    while time.monotonic() < deadline:
        device = sched.status()["devices"][0]
        entry = next((c for c in device["clients"] if c["id"] == "B"), {})
        if entry.get("used_bytes", 0) >= BIG and entry.get("evicted_bytes") == BIG:
            break
        time.sleep(0.05)
    assert entry.get("evicted_bytes") == BIG, entry
    assert entry["state"] != "holding", entry
    assert device["resident_bytes"] < 2 * BIG, device
    first = b.wait_event("first_copy", 60)
    assert first["waited"] > 0.5, "B should have waited for A"
    assert first["device_bytes"] >= BIG, first
    assert first["status"]["evicted_bytes"] == 0, first["status"]
    # The shim's own record of its grant's RESTORED (what the wait line says): one, of 0 bytes.
    assert (first["status"]["restores"], first["status"]["last_restore_bytes"]) == (1, 0)
    rb, ra = b.finish(60).ok(), a.finish(60).ok()
    assert rb.event("hold_end")["data_ok"] and ra.event("hold_end")["data_ok"]
    # B's first grant found nothing to copy back, and B was never evicted before it.
    first_grant = sched.log.index("grant client=B ")
    assert "evicted client=B" not in sched.log[:first_grant], sched.log
    assert re.search(r"restored client=B bytes=0 ", sched.log), sched.log
    # Backing at the grant copied nothing: only B's own 4 MiB write went to the device.
    assert rb.stats["copy_to_device_bytes"] < BIG, rb.stats
