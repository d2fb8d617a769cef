"""The scheduler killed (SIGKILL) and restarted while real shimmed processes run.

A holder keeps running unshared meanwhile and gets its grant back; a waiter keeps waiting (at most
GPUSHARE_RECONNECT_WAIT) and queues again from the moment it began to wait; both re-register their
memory; the new scheduler's state equals the old one's. No process dies. docs/reliability.md.
"""

from __future__ import annotations

import time

import pytest

MiB = 1 << 20
CONTEXT = 64 * MiB
BIG = 640 * MiB  # two of these do not fit the 1 GiB pool: they take turns


def common(**extra):
    return {"context_bytes": CONTEXT, "idle_seconds": 0, "log": "info", **extra}


def clients_of(doc):
    dev = doc["devices"][0]
    return dev, {c["id"]: c for c in dev["clients"]}


def wait_status(sched, check, timeout=20.0):
    deadline = time.monotonic() + timeout
    doc = sched.status()
    while not check(doc):
        if time.monotonic() > deadline:
            raise AssertionError(f"status never matched: {doc}\n{sched.log}")
        time.sleep(0.1)
        doc = sched.status()
    return doc


def snapshot(doc):
    """What must survive a restart: holders, queue, states, memory, quotas, weights."""
    dev, clients = clients_of(doc)
    keys = ("state", "used_bytes", "managed_bytes", "pinned_bytes", "evicted_bytes")
    keys += ("quota_bytes", "weight", "pid", "user", "label")
    return {
        "holders": dev["holders"],
        "queue": dev["queue"],
        "resident": dev["resident_bytes"],
        "clients": {cid: {k: c[k] for k in keys} for cid, c in clients.items()},
    }


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_scheduler_restart_keeps_holder_waiter_and_memory(harness, how):
    """A crash (SIGKILL: the socket is left behind) or a restart by a service manager (SIGTERM:
    the scheduler stops cleanly, leaving a marker that it had clients)."""
    sched = harness.scheduler(pool="1GiB", quantum=60.0)
    a = harness.spawn("hold", 40.0, BIG, 20000, **common(client_id="A", weight=2))
    a.wait_event("first_launch", 30)
    b = harness.spawn("hold", 0.5, BIG, 20000, **common(client_id="B", memory_limit="900MiB"))
    b.wait_event("hold_start", 30)
    before = snapshot(
        wait_status(
            sched,
            lambda d: (
                clients_of(d)[1].get("B", {}).get("state") == "waiting"
                and clients_of(d)[1]["A"]["used_bytes"] == BIG + CONTEXT
            ),
        )
    )
    assert before["holders"] == ["A"] and before["queue"] == ["B"], before

    killed_at = time.monotonic()
    if how == "SIGKILL":
        sched.kill()
    else:
        sched.stop()
    # The holder runs on, unshared, once its shim has seen the scheduler go (however long a
    # loaded machine takes); the waiter keeps waiting for the scheduler.
    lost = a.wait_event(
        "tick", 30, where=lambda e: e["t_mono"] > killed_at and e["status"]["connected"] == 0
    )
    assert lost["status"]["state"] == "unshared", lost
    time.sleep(1.0)
    assert not [e for e in b.events if e["event"] == "first_copy"], "B ran while A held"

    log_size = len(sched.log)
    sched.start()
    assert "had clients; holding grants back" in sched.wait_log("resume client=B", after=log_size)
    after = snapshot(
        wait_status(
            sched,
            lambda d: (
                {c["id"] for c in clients_of(d)[1].values()} == {"A", "B"}
                and clients_of(d)[1]["B"]["state"] == "waiting"
            ),
        )
    )
    assert after == before, f"state before the restart:\n{before}\nafter:\n{after}"
    assert "grant client=A resumed" in sched.log[log_size:]
    # A kept the device throughout: its launches never stopped, and it never waited again.
    back = a.wait_event(
        "tick", 30, where=lambda e: e["t_mono"] > lost["t_mono"] and e["status"]["connected"] == 1
    )
    assert back["status"]["state"] == "holding", back
    assert back["launches"] > lost["launches"]
    assert not [e for e in b.events if e["event"] == "first_copy"], "B ran while A held"

    # The queue goes on as before: when A ends, B gets the device.
    a.kill()
    first = b.wait_event("first_copy", 30)
    rb = b.finish(60).ok()
    assert rb.event("hold_end")["data_ok"]
    assert first["waited"] > 1.0
    assert "connected to the scheduler" in b.stderr


def test_waiter_runs_unshared_after_the_reconnect_bound(harness):
    sched = harness.scheduler(pool="1GiB", quantum=60.0)
    a = harness.spawn("hold", 30.0, BIG, 20000, **common(client_id="A"))
    a.wait_event("first_launch", 30)
    # B allocates while it waits: its memory has an address but is backed only when it runs.
    # Mapping is made slow (0.3 s) so a call let through before the backing ends fails every time.
    slow_map = {"fake_map_delay_us": 300_000}
    b = harness.spawn(
        "hold", 0.3, BIG, 20000, **common(client_id="B", reconnect_wait=1.5, **slow_map)
    )
    b.wait_event("hold_start", 30)
    sched.wait_log("request client=B")
    killed_at = time.monotonic()
    sched.kill()
    first = b.wait_event("first_copy", 30)
    waited = first["t_mono"] - killed_at
    assert 1.2 < waited < 8.0, f"B should wait ~1.5 s for the scheduler, then run: {waited:.2f}"
    assert b.finish(30).ok().event("hold_end")["data_ok"]
    assert "did not come back within 1.5 s" in b.stderr
    assert "backed 640.00 MiB allocated while waiting" in b.stderr
    a.kill()


def test_an_idle_holder_is_still_known_idle_after_the_restart(harness):
    """The shim's idle report is said again to the new scheduler: a resumed holder whose work
    has ended hands the GPU over at once, not after its quantum."""
    sched = harness.scheduler(pool="1GiB", quantum=30.0)
    a = harness.spawn("idle", 40.0, 0.3, BIG, **common(client_id="A", idle_seconds=1))
    a.wait_event("idle_start", 30)
    sched.wait_log("idle client=A")
    sched.kill()
    log_size = len(sched.log)
    sched.start()
    sched.wait_log("grant client=A resumed", after=log_size)
    b = harness.spawn("hold", 0.3, BIG, 20000, **common(client_id="B"))
    first = b.wait_event("first_copy", 30)
    assert first["waited"] < 10.0, "B waited for A's quantum: A's idleness was lost"
    assert b.finish(60).ok().event("hold_end")["data_ok"]
    assert "idle client=A" in sched.log[log_size:]
    a.kill()
