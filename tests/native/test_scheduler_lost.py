"""Issue 12, fault 8: a scheduler that is lost or hangs.

A waiter that runs unshared after GPUSHARE_RECONNECT_WAIT brings its evicted memory back only if
the card has room for it (another kernel may hold the GPU and most of its memory); a scheduler
that hangs with its connection open does not keep waiters waiting for ever."""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

from tests.native.probe import spawn_probe

MiB = 1 << 20


def find_client(status: Any, cid: str) -> dict[str, Any] | None:
    if isinstance(status, dict):
        if status.get("id") == cid and "state" in status:
            return status
        values = list(status.values())
    elif isinstance(status, list):
        values = status
    else:
        return None
    for v in values:
        found = find_client(v, cid)
        if found:
            return found
    return None


def test_a_waiter_running_unshared_never_restores_past_the_free_memory(harness, shim_probe):
    sched = harness.scheduler(pool="1GiB", quantum=0.4)
    common = {"context_bytes": "16MiB", "idle_seconds": 0}
    spawn_probe(harness, shim_probe, "launches", 10, 20000, 700 * MiB, client_id="other", **common)
    waiter = spawn_probe(
        harness,
        shim_probe,
        "evicted",
        600 * MiB,
        0,
        6,
        client_id="w",
        reconnect_wait=0.5,
        # What the waiter's cuMemGetInfo sees of the other process's 700 MiB on the card.
        extra={"GPUSHARE_FAKE_OTHER_BYTES": "700MiB", "GPUSHARE_FAKE_DEVICE_TOTAL": "1GiB"},
        **common,
    )
    deadline = time.monotonic() + 30
    while True:
        c = find_client(sched.status(), "w")
        if c and c["state"] == "waiting" and c["evicted_bytes"] > 0:
            break
        assert time.monotonic() < deadline, f"w was never evicted and waiting: {c}"
        time.sleep(0.05)
    sched.kill()
    run = waiter.finish(60).ok()
    assert any("not restoring 600.00 MiB" in line for line in run.shim_lines), run.describe()
    restored = sum(
        float(m.group(1)) * MiB
        for line in run.shim_lines
        if (m := re.search(r"restored ([\d.]+) MiB to the device", line))
    )
    # Every byte that went back to the device went back at a grant, none after the loss.
    assert run.stats["prefetch_to_device_bytes"] == restored, run.describe()


def test_a_hung_scheduler_does_not_block_a_waiter_for_ever(harness, shim_probe):
    sched = harness.scheduler(pool="1GiB", quantum=30)
    holder = spawn_probe(harness, shim_probe, "launches", 8, 20000, 0, context_bytes="700MiB")
    holder.wait_stderr("granted the device")
    waiter = spawn_probe(harness, shim_probe, "once", context_bytes="700MiB", reconnect_wait=0.5)
    time.sleep(0.5)  # the waiter asked for the device and waits
    assert sched.popen is not None
    os.killpg(sched.popen.pid, signal.SIGSTOP)  # hangs with its connections open
    try:
        stopped = time.monotonic()
        ran = waiter.wait_event("ran", timeout=15)
        assert ran["t_mono"] > 0
        assert time.monotonic() - stopped < 10
        run = waiter.finish(30).ok()
        assert any("answered nothing" in line for line in run.shim_lines), run.describe()
        assert any("running unshared" in line for line in run.shim_lines), run.describe()
    finally:
        os.killpg(sched.popen.pid, signal.SIGCONT)
