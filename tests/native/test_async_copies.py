"""Copies that have not finished (issue 24): on a real device cuMemcpyDtoHAsync returns before
the copy engine has read the memory, so an eviction must wait for each block's copy before it
unmaps that block. The stand-in copied at the call, so an eviction that unmapped first passed every
data check; with GPUSHARE_FAKE_ASYNC_COPIES=1 it completes a copy only at a later
synchronisation, and a copy whose device memory was unmapped before then is lost (its host side
reads 0xDB), which the data check at the end sees."""

from __future__ import annotations

MiB = 1 << 20
CONTEXT = 64 * MiB
BIG = 640 * MiB  # two do not fit a 1 GiB pool: B's arrival evicts A
ASYNC = {"GPUSHARE_FAKE_ASYNC_COPIES": "1"}


def common(client: str) -> dict:
    return {"context_bytes": CONTEXT, "idle_seconds": 5, "log": "info", "client_id": client}


def test_an_eviction_waits_for_its_copy_before_it_unmaps(harness):
    sched = harness.scheduler(pool="1GiB", quantum=1.0)
    # A is busy for 3 s: no pre-copy, so its quantum-end eviction copies every block out.
    a = harness.spawn("hold", 3.0, BIG, 20000, extra=ASYNC, **common("A"))
    a.wait_event("first_copy", 30)
    b = harness.spawn("hold", 0.5, BIG, 20000, extra=ASYNC, **common("B"))
    rb, ra = b.finish(60).ok(), a.finish(60).ok()
    sched.wait_log("evicted client=A")
    assert rb.event("hold_end")["data_ok"]
    # The eviction's copies were queued, not made at the call, and none was lost to an unmap.
    assert ra.stats["async_copies_queued"] >= 1, ra.stats
    assert ra.stats["async_copies_lost"] == 0, ra.stats
    assert ra.event("hold_end")["data_ok"], "the eviction unmapped before its copy completed"
