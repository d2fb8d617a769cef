"""Issue 12, faults 3 and 4: several contexts, and contexts that go away.

A release drains every context of the process, not only the first one it saw; a context that is
destroyed or reset takes what the shim cached in it along (the private stream of the memory
engine), so later evictions work."""

from __future__ import annotations

import re
import time

from jupyter_gpushare.scheduler_client import SchedulerClient
from tests.native.probe import spawn_probe, trace


def test_a_release_waits_for_the_work_of_every_context(harness, shim_probe, tmp_path):
    harness.scheduler(pool="1GiB", quantum=30)
    path = tmp_path / "trace"
    proc = spawn_probe(
        harness,
        shim_probe,
        "twoctx",
        400000,  # 0.4 s of work on device 1's context
        extra={"GPUSHARE_FAKE_DEVICES": "2", "GPUSHARE_FAKE_TRACE": str(path)},
    )
    run = proc.finish(60).ok()
    released = run.event("released")
    assert released["rc"] == 0, run.describe()
    # The release returned only once device 1's kernel had finished.
    assert released["seconds"] >= 0.9 * released["kernel_seconds"], released
    synced = {s["dev"] for s in trace(path) if s.get("thread") == "gpushare"}
    assert synced == {0, 1}, trace(path)


def _control(sock: str, action: str, **body: object) -> dict:
    return SchedulerClient(sock).control_sync(action, **body)


def test_an_eviction_after_a_primary_context_reset_succeeds(harness, shim_probe):
    sched = harness.scheduler(pool="1GiB", quantum=30)
    proc = spawn_probe(harness, shim_probe, "reset", client_id="resetter", context_bytes="16MiB")
    for step in (1, 2):
        proc.wait_event("ready", where=lambda e, step=step: e["step"] == step)
        time.sleep(0.2)
        reply = _control(str(sched.socket_path), "evict", client="resetter")
        assert reply.get("ok", True), reply
    run = proc.finish(60).ok()
    released = [line for line in run.shim_lines if "revoked (" in line or "released (" in line]
    assert len(released) == 2, run.describe()
    # Both revokes moved the live 64 MiB to the host: the second one too, after the reset (the
    # table's cleanup of the first context's allocations is the memory engine's: at least 64 MiB).
    moved = [re.search(r"evicted ([\d.]+) MiB", line) for line in released]
    assert all(m and float(m.group(1)) >= 64 for m in moved), run.describe()
    assert not [line for line in run.shim_lines if "eviction failed" in line], run.describe()
