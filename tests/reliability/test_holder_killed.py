"""A holder killed with SIGKILL: its grant goes at once, the waiter runs, and nothing stays
attributed to it. Real shimmed processes on the stand-in driver, a real scheduler process.

The time measured is the whole path: SIGKILL → the kernel closes the holder's socket → the
scheduler's Leave → GRANT to the waiter → the waiter's blocked copy returns (its ``first_copy``
event, stamped with CLOCK_MONOTONIC, the clock of time.monotonic() here). The target is 100 ms;
the assertion is looser (1 s) because CI machines have 2 loaded CPUs; the measured figures are
printed and recorded in docs/reliability.md.
"""

from __future__ import annotations

import time

import pytest

MiB = 1 << 20
CONTEXT = 64 * MiB
KILLS = 5
BOUND_S = 1.0


def common(**extra):
    return {"context_bytes": CONTEXT, "idle_seconds": 0, "log": "info", **extra}


@pytest.mark.parametrize(
    ("pool", "holder"),
    # The holder's memory and its context, with a waiter's context, are over the pool. The
    # stand-in driver's device memory is host memory, and the kernel frees a killed process's
    # memory before it closes its sockets: the larger holder shows that cost.
    [("256MiB", 160 * MiB), ("1GiB", 928 * MiB)],
)
def test_sigkill_of_the_holder_hands_over_fast_and_accounts_exactly(harness, pool, holder):
    """Each round: a holder, a waiter whose first GPU call is a launch (no memory of its own to
    fill, so the time measured is the handover, not the waiter's memset)."""
    sched = harness.scheduler(pool=pool, quantum=120.0)
    times: list[float] = []
    for i in range(KILLS):
        proc = harness.spawn("hold", 120.0, holder, 20000, **common(client_id=f"H{i}"))
        proc.wait_event("first_launch", 30)
        waiter = harness.spawn("hold", 120.0, 0, 20000, **common(client_id=f"W{i}"))
        waiter.wait_event("hold_start", 30)
        sched.wait_log(f"request client=W{i} ")
        time.sleep(0.2)
        assert not [e for e in waiter.events if e["event"] == "first_launch"], "must wait"
        killed_at = time.monotonic()
        proc.kill()
        first = waiter.wait_event("first_launch", 30)
        times.append(first["t_mono"] - killed_at)
        # Nothing stays attributed to the killed holder; the pool holds the waiter only.
        dev = sched.status()["devices"][0]
        assert {c["id"] for c in dev["clients"]} == {f"W{i}"}, dev
        assert dev["holders"] == [f"W{i}"], dev
        assert dev["resident_bytes"] == CONTEXT, dev
        waiter.kill()
        deadline = time.monotonic() + 10
        while sched.status()["devices"][0]["clients"] and time.monotonic() < deadline:
            time.sleep(0.05)
        dev = sched.status()["devices"][0]
        assert dev["clients"] == [] and dev["resident_bytes"] == 0, dev
    ms = sorted(round(t * 1000, 1) for t in times)
    print(f"SIGKILL of a {holder >> 20} MiB holder -> waiter's grant (ms): {ms}")
    assert max(times) < BOUND_S, f"handover took {ms} ms"
