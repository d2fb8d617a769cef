"""The shim with a live scheduler (``python -m jupyter_gpushare scheduler`` in a subprocess): turns
and handoffs between processes that do not fit the pool together, eviction and restore by
prefetch, losing and regaining the scheduler, a holder killed with SIGKILL, idle detection, and
GPUSHARE_DISABLE.

Times: every program line carries CLOCK_MONOTONIC, the same clock as time.monotonic() here, so
orderings across processes are compared directly. Bounds are generous: they separate "waited for a
30 s quantum" from "did not", never milliseconds.
"""

from __future__ import annotations

import datetime
import re
import signal
import time

import pytest

from jupyter_gpushare.scheduler_client import SchedulerClient

MiB = 1 << 20
CONTEXT = 64 * MiB
BIG = 640 * MiB  # two of these (plus contexts) do not fit a 1 GiB pool; one does
SMALL = 128 * MiB
# How long A's host staging of BIG may take to be registered on a loaded machine (up to 9.3 s
# seen on 2 cores with a load average of 8).
STAGING_READY_S = 15.0


def common(**extra):
    return {"context_bytes": CONTEXT, "idle_seconds": 0, "log": "info", **extra}


def logged_bytes(log: str, what: str, client: str) -> list[int]:
    return [int(n) for n in re.findall(rf"{what} client={re.escape(client)} bytes=(\d+)", log)]


def logged_ms(log: str, what: str, client: str, at_least: int = 0) -> list[float]:
    """The durations of the moves of at least `at_least` bytes."""
    pattern = rf"{what} client={re.escape(client)} bytes=(\d+) \([^)]*\) ms=([\d.]+)"
    return [float(ms) for n, ms in re.findall(pattern, log) if int(n) >= at_least]


def test_processes_that_fit_run_side_by_side(harness):
    sched = harness.scheduler(pool="1GiB", quantum=1.0)
    a = harness.spawn("hold", 2.0, SMALL, 20000, **common(client_id="A"))
    b = harness.spawn("hold", 2.0, SMALL, 20000, **common(client_id="B"))
    ra, rb = a.finish(60).ok(), b.finish(60).ok()
    for r in (ra, rb):
        end = r.event("hold_end")
        assert end["data_ok"]
        assert end["status"]["connected"] == 1
        # The first GPU call of a connected process always asks for the device (one wait); when
        # both fit, the grant comes at once.
        assert end["status"]["waits"] <= 1, f"nothing should wait when both fit: {end}"
        assert end["status"]["wait_seconds"] < 0.5, f"nothing should wait when both fit: {end}"
        assert r.event("first_launch")["waited"] < 1.0
    # Both ran at the same time.
    assert ra.event("first_launch")["t_mono"] < rb.event("hold_end")["t_mono"]
    assert rb.event("first_launch")["t_mono"] < ra.event("hold_end")["t_mono"]
    assert not logged_bytes(sched.log, "evicted", "A") and not logged_bytes(
        sched.log, "evicted", "B"
    )


@pytest.mark.parametrize("memory", ["vmm", "managed"])
def test_turns_and_handoff_when_the_pool_is_too_small(harness, memory):
    sched = harness.scheduler(pool="1GiB", quantum=1.0)
    # Moves take time on the stand-in's streams (4 GB/s: 640 MiB in ~170 ms), so a shim that
    # answered RELEASED before its eviction finished would report too short a move.
    slow = {"GPUSHARE_FAKE_PREFETCH_GBPS": "4", "GPUSHARE_FAKE_COPY_GBPS": "4"}
    mode = common(memory=memory)
    # Explicit memory: B comes once A's host staging is registered (made in the background,
    # docs/architecture.md "Host staging"), so that A's evictions find it ready. An eviction
    # before it copies through pageable memory, as designed (the cold eviction): on 2 loaded
    # cores, 640 MiB of staging took 2-9 s, A's first eviction came ~1 s after its allocation,
    # and a run in which A was evicted only then saw no copy into registered memory at all. A
    # holds long enough to be still at work when B comes after that wait.
    staging_wait = STAGING_READY_S if memory == "vmm" else 0.0
    a = harness.spawn(
        "hold", 4.0 + staging_wait, BIG, 20000, extra=slow, **{**mode, "client_id": "A"}
    )
    a_first = a.wait_event("first_launch", 30)
    if staging_wait:  # (the status's staging_pinned_bytes counts it from before it is made)
        a.wait_stderr("(registered) ready", staging_wait)
    b = harness.spawn("hold", 2.0, BIG, 20000, extra=slow, **{**mode, "client_id": "B"})
    b_start = b.wait_event("hold_start", 30)
    # Under load the stand-in's restore of BIG took 1.2-1.4 s, past the 1 s quantum, until the
    # scheduler's estimate of the clients' moves had learnt it (issue noted, not this test's).
    b_first = b.wait_event("first_copy", 60)
    ra, rb = a.finish(60).ok(), b.finish(60).ok()

    # B's first GPU call blocked until A's turn ended. The scheduler's log gives the causal
    # order without racing A's 1 s quantum: A was revoked and released before B's first grant.
    assert b_first["waited"] >= 0.1, f"B did not wait for A: {b_first}"
    assert a_first["t_mono"] < b_start["t_mono"] < b_first["t_mono"]
    lines = sched.log.splitlines()
    b_grant = next(i for i, line in enumerate(lines) if "grant client=B " in line)
    before = "\n".join(lines[:b_grant])
    assert "revoke client=A " in before and "release client=A " in before, sched.log

    # Both had to wait for the other at some point, and their data survived the moves.
    for r in (ra, rb):
        end = r.event("hold_end")
        assert end["data_ok"], "data did not survive eviction and restore"
        assert end["status"]["connected"] == 1
    assert ra.event("hold_end")["status"]["waits"] >= 1
    assert rb.event("hold_end")["status"]["waits"] >= 1

    sa = ra.stats
    if memory == "managed":
        # A was evicted and restored by explicit prefetches, not by page faults.
        assert sa["prefetch_to_host_bytes"] >= BIG, sa
        assert sa["prefetch_to_device_bytes"] >= BIG, sa
        assert sa["fault_to_device_bytes"] == 0, "memory came back by page faults, not by restore"
    else:
        # A's explicit memory was copied out into registered (pinned) host staging and back,
        # its physical memory released in between, and nothing became managed memory. No
        # eviction of A went through pageable memory (what else A copied to the host is its
        # own 4 MiB check and the checked copies' windows).
        assert sa["copy_to_host_pinned_bytes"] >= BIG, sa
        assert sa["copy_to_host_bytes"] - sa["copy_to_host_pinned_bytes"] < BIG, sa
        assert sa["copy_to_device_pinned_bytes"] >= BIG, sa
        assert sa["prefetch_to_host_bytes"] == 0 and sa["live_managed_bytes"] == 0, sa
        assert sa["calls"]["cuMemCreate"] >= 2 and sa["calls"]["cuMemRelease"] >= 2, sa["calls"]
        assert sa["calls"]["cuMemAddressReserve"] == 1, "the address range must stay the same"

    log = sched.log
    assert any(n >= BIG for n in logged_bytes(log, "evicted", "A")), log
    assert any(n >= BIG for n in logged_bytes(log, "restored", "A")), log
    # The moves were waited for: 640 MiB at 4 GB/s is 168 ms. (A's first grant restores nothing:
    # memory allocated before it is backed then, with nothing to copy.)
    evict_ms = logged_ms(log, "evicted", "A", BIG)
    restore_ms = logged_ms(log, "restored", "A", BIG)
    assert evict_ms and min(evict_ms) >= 120, f"eviction did not wait for the prefetch: {evict_ms}"
    assert restore_ms and min(restore_ms) >= 120, f"restore did not wait: {restore_ms}"


def test_scheduler_loss_and_return(harness):
    sched = harness.scheduler(pool="1GiB", quantum=1.0)
    p = harness.spawn("hold", 30.0, SMALL, 20000, **common(client_id="P"))
    p.wait_event("tick", 30, where=lambda e: e["status"]["connected"] == 1)
    sched.wait_log("join client=P")

    killed_at = time.monotonic()
    sched.kill()
    lost = p.wait_event(
        "tick",
        30,
        where=lambda e: e["t_mono"] > killed_at and e["status"]["connected"] == 0,
    )
    assert lost["status"]["state"] == "unshared", lost
    # Still running, unshared: launches go on.
    later = p.wait_event("tick", 30, where=lambda e: e["launches"] > lost["launches"] + 10)
    assert later["status"]["connected"] == 0 or later["t_mono"] > killed_at

    log_size = len(sched.log)
    restarted_at = time.monotonic()
    sched.start()
    back = p.wait_event(
        "tick",
        30,
        where=lambda e: e["t_mono"] > restarted_at and e["status"]["connected"] == 1,
    )
    assert back["t_mono"] - restarted_at < 20, "the shim did not reconnect promptly"
    sched.wait_log("join client=P", after=log_size)
    doc = sched.status()
    clients = [c for d in doc["devices"] for c in d["clients"]]
    assert [c["id"] for c in clients] == ["P"]
    assert clients[0]["pid"] == p.pid

    p.signal(signal.SIGTERM)
    r = p.finish(30)
    # SIGTERM: the shim says GOODBYE; the program is ended by the signal.
    assert r.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM, 0), r.describe()
    assert "scheduler" in r.stderr.lower(), "losing the scheduler was not reported"


def logged_at(log: str, text: str) -> float:
    """The time of day (seconds, the scheduler's local clock) of the first log line with
    ``text``."""
    for line in log.splitlines():
        if text in line:
            found = re.match(r"\[\w (\d\d):(\d\d):(\d\d\.\d+) ", line)
            assert found, line
            hours, minutes, seconds = found.groups()
            return int(hours) * 3600 + int(minutes) * 60 + float(seconds)
    raise AssertionError(f"{text!r} not in the scheduler log:\n{log}")


def time_of_day(t: float) -> float:
    local = datetime.datetime.fromtimestamp(t)
    return local.hour * 3600 + local.minute * 60 + local.second + local.microsecond / 1e6


SLOW_MAP_S = 2.0  # the slow waiter's mapping of its memory at its grant (stand-in knob)


@pytest.mark.parametrize("slow_waiter", [False, True], ids=["plain", "slow-waiter"])
def test_kill_9_of_the_holder_lets_the_waiter_in_promptly(harness, slow_waiter):
    """A holder killed hands over as soon as its process is gone: the scheduler grants the
    waiter within three status round trips measured right then (its own reaction time on this
    machine now), not at a timeout or a poll.

    The waiter's first copy after the kill, which an older bound compared with an ordinary
    handover (3x plus 0.5 s: 9-74x the 7-59 ms recorded), also holds the waiter's own work:
    backing and writing 640 MiB, which two CPU hogs stretch to seconds, unevenly from one
    handover to the next (the bound failed once so). The slow-waiter case makes that work slow
    on purpose, deterministically: B's memory is mapped at its grant, and the stand-in takes
    SLOW_MAP_S for the mapping. Its first copy comes that much later; its grant does not."""
    sched = harness.scheduler(pool="1GiB", quantum=30.0)
    a = harness.spawn("hold", 120.0, BIG, 20000, **common(client_id="A"))
    a.wait_event("first_launch", 30)
    slow = {"GPUSHARE_FAKE_MAP_DELAY_US": str(int(SLOW_MAP_S * 1e6))} if slow_waiter else {}
    b = harness.spawn("hold", 0.5, BIG, 20000, extra=slow, **common(client_id="B"))
    b.wait_event("hold_start", 30)
    sched.wait_log("request client=B")
    # C waits behind B: B's ordinary end (a GOODBYE) is the handoff to compare with.
    c = harness.spawn("hold", 0.5, BIG, 20000, **common(client_id="C"))
    c.wait_event("hold_start", 30)
    sched.wait_log("request client=C")
    assert "grant client=B" not in sched.log, "B must wait: A's 30 s quantum is not over"
    killed_at = time.monotonic()
    a.kill()  # returns once the process is reaped: its socket is closed by then
    gone = time.time()
    client = SchedulerClient(str(sched.socket_path))
    trips = []
    for _ in range(3):
        t0 = time.monotonic()
        client.status_sync()
        trips.append(time.monotonic() - t0)
    first = b.wait_event("first_copy", 60)
    rb = b.finish(60).ok()
    assert rb.event("hold_end")["data_ok"]
    rc = c.finish(60).ok()
    assert rc.event("hold_end")["data_ok"]
    log = sched.wait_log("leave client=A")
    assert "leave client=A (connection closed)" in log, log
    late = (logged_at(log, "grant client=B") - time_of_day(gone) + 43200) % 86400 - 43200
    after_kill = first["t_mono"] - killed_at
    after_end = rc.event("first_copy")["t_mono"] - rb.event("hold_end")["t_mono"]
    print(
        f"granted {late * 1000:.0f} ms after the killed holder was reaped (status round trips "
        f"{', '.join(f'{t * 1000:.0f}' for t in trips)} ms); first copy {after_kill:.3f} s "
        f"after the kill, {after_end:.3f} s after an ordinary end"
    )
    # Log times have 1 ms steps; 20 ms more for the scheduler's wake-up beside the test's.
    assert late < 3 * max(trips) + 0.02, (late, trips, log)
    if slow_waiter:  # the waiter's own work is on the first copy's path, not the grant's
        assert rb.calls("cuMemMap") >= 1 and after_kill >= SLOW_MAP_S, after_kill


def test_idle_holder_gives_the_device_away_before_its_quantum(harness):
    sched = harness.scheduler(pool="1GiB", quantum=30.0)
    a = harness.spawn("idle", 20.0, 0.5, BIG, **common(client_id="A", idle_seconds=1))
    a.wait_event("idle_start", 30)
    b = harness.spawn("hold", 0.5, BIG, 20000, **common(client_id="B"))
    b_first = b.wait_event("first_copy", 30)
    assert b_first["waited"] < 10.0, "B waited for A's quantum although A was idle"
    rb = b.finish(60).ok()
    assert rb.event("hold_end")["data_ok"]
    log = sched.log
    assert "idle client=A" in log, log
    # A, idle, does not hold the device any more.
    idle_tick = a.wait_event("tick", 30, where=lambda e: e["status"]["state"] == "idle")
    assert idle_tick["status"]["connected"] == 1
    a.kill()


def test_disable_does_not_talk_to_the_scheduler(harness):
    sched = harness.scheduler(pool="1GiB", quantum=1.0)
    run = harness.run("saxpy", 4096, disable="1", client_id="D").ok()
    assert run.event("saxpy")["ok"]
    assert run.calls("cuMemAllocManaged") == 0
    assert "client=D" not in sched.log
    doc = sched.status()
    assert not [c for d in doc["devices"] for c in d["clients"]]


def test_interrupt_while_waiting_returns_not_permitted(harness):
    """A Jupyter interrupt (SIGINT) of a call blocked at the gate: the program's own handler runs,
    then the call returns CUDA_ERROR_NOT_PERMITTED instead of waiting for the grant."""
    harness.scheduler(pool="1GiB", quantum=30.0)
    a = harness.spawn("hold", 60.0, BIG, 20000, **common(client_id="A"))
    a.wait_event("first_launch", 30)
    b = harness.spawn("--sigint-handler", "hold", 0.5, BIG, **common(client_id="B"))
    b.wait_event("hold_start", 30)
    time.sleep(1.0)
    assert not [e for e in b.events if e["event"] == "first_copy"], "B must be waiting"
    interrupted_at = time.monotonic()
    b.signal(signal.SIGINT)
    rb = b.finish(30)
    err = rb.event("error")
    assert err["rc"] == 800, f"expected CUDA_ERROR_NOT_PERMITTED: {err}"
    assert err["t_mono"] - interrupted_at < 5.0
    assert rb.last("exit")["sigints"] == 1, "the program's SIGINT handler did not run"
    a.kill()


def test_memory_view_under_a_scheduler_is_the_pool(harness):
    harness.scheduler(pool="1GiB", quantum=1.0)
    run = harness.run("meminfo", SMALL, **common(client_id="M")).ok()
    before, after = run.all("meminfo")
    assert before["total"] == after["total"] == 1 << 30
    assert before["free"] == (1 << 30) - CONTEXT
    assert after["free"] == (1 << 30) - CONTEXT - SMALL
    st = run.event("status")["status"]
    assert st["pool_bytes"] == 1 << 30 and st["connected"] == 1
