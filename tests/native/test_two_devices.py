"""Issue 12, fault 3: a process that uses two GPUs is a client of both pools.

The shim registers once per device it uses (docs/protocol.md, "Several devices"): the first under
its client id, each later one under ``<id>/<ordinal>``. Each device is granted, revoked and
waited for on its own; the gate lets a call through only once the device of the call's context
(or stream's context) is held. Runs on the stand-in driver with two devices, which the
scheduler also discovers through the stand-in NVML.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from jupyter_gpushare.scheduler_client import SchedulerClient
from tests.native.probe import run_probe, spawn_probe

DEVICES = {"GPUSHARE_FAKE_DEVICES": "2"}
KERNEL_US = 20000  # 20 ms kernels: ~50 launches a second per device


def _clients_by_device(doc: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    return {d["index"]: d["clients"] for d in doc["devices"]}


def _wait_for(cond: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def _launches(proc: Any, dev: int, after: float, before: float = float("inf")) -> list[float]:
    return [
        e["t_mono"]
        for e in list(proc.events)
        if e.get("event") == "launch" and e["dev"] == dev and after <= e["t_mono"] < before
    ]


def test_a_process_on_two_devices_is_a_client_of_both_pools(harness, shim_probe):
    sched = harness.scheduler(pool="1GiB", quantum=30, fake_devices=2)
    proc = spawn_probe(
        harness, shim_probe, "twodev", 3, KERNEL_US, 1 << 20, client_id="both", extra=DEVICES
    )
    proc.wait_event("launch", where=lambda e: e["dev"] == 1)
    proc.wait_event("launch", where=lambda e: e["dev"] == 0)
    by_dev = _clients_by_device(sched.status())
    ids = {dev: {c["id"]: c for c in clients} for dev, clients in by_dev.items()}
    assert set(ids[0]) == {"both"}, by_dev
    assert set(ids[1]) == {"both/1"}, by_dev
    assert ids[0]["both"]["pid"] == ids[1]["both/1"]["pid"] == proc.pid
    assert ids[0]["both"]["state"] == ids[1]["both/1"]["state"] == "running", by_dev
    proc.finish(60).ok()
    # Both registrations leave with the process.
    doc = sched.status()
    assert not [c for d in doc["devices"] for c in d["clients"]], doc


def test_a_revoke_of_one_device_leaves_the_other_running(harness, shim_probe):
    """Device 1 is revoked (and held by another process for a while): device 0's kernels go on
    without a pause, and not one launch on device 1 gets through until device 1 is granted back:
    device 0's grant does not open device 1."""
    # Room for one context per device: "other" and "both/1" cannot run on device 1 together.
    sched = harness.scheduler(pool="700MiB", quantum=30, fake_devices=2)
    # "both" runs 10 s: long enough to outlast "other" on a loaded host, whose 1.5 s start once
    # it is granted (after the revoke, however late that comes).
    proc = spawn_probe(
        harness, shim_probe, "twodev", 10, KERNEL_US, 1 << 20, client_id="both", extra=DEVICES
    )
    proc.wait_event("launch", where=lambda e: e["dev"] == 1)
    # A second process on device 1 alone (its ordinal 0 there), waiting behind "both/1".
    other_env = {**DEVICES, "CUDA_VISIBLE_DEVICES": "1"}
    other = spawn_probe(
        harness, shim_probe, "grantedlaunches", 1.5, KERNEL_US, client_id="other", extra=other_env
    )
    _wait_for(lambda: any(c["id"] == "other" for c in _clients_by_device(sched.status())[1]))
    t_revoke = time.monotonic()
    SchedulerClient(str(sched.socket_path)).control_sync("release", client="both/1")
    other_done = other.finish(30).ok()
    t_other_exit = time.monotonic()
    launched = other_done.event("launches")["n"]
    assert launched > 10, other_done.describe()  # "other" ran on device 1 meanwhile
    run = proc.finish(60).ok()

    # While "other" held device 1: device 1 of "both" launched nothing after its release ...
    window = (t_revoke + 0.3, t_other_exit - 0.3)
    assert window[1] - window[0] > 0.5, window
    assert _launches(run, 1, *window) == [], "a launch on device 1 passed on device 0's grant"
    # ... and device 0's kernels went on all along, at their own pace.
    dev0 = _launches(run, 0, *window)
    # (Loose bounds for a loaded CI host: a stop would show as one gap of the whole window.)
    assert len(dev0) >= 0.25 * (window[1] - window[0]) / (KERNEL_US / 1e6), dev0
    gaps = [b - a for a, b in itertools.pairwise(dev0)]
    assert max(gaps) < 0.5, gaps
    # The status API (the notebook's wait line) says the process waits, though device 0 runs.
    states = {
        e["state"]
        for e in run.events
        if e.get("event") == "launch" and e["dev"] == 0 and window[0] <= e["t_mono"] < window[1]
    }
    assert states == {3}, states  # GPUSHARE_STATE_WAITING
    # Device 1 came back once "other" was done.
    assert _launches(run, 1, t_other_exit), run.describe()
    log = sched.log
    assert "revoke client=both/1 " in log, log
    assert "revoke client=both " not in log, log  # device 0 was never revoked


def test_both_registrations_come_back_after_a_scheduler_restart(harness, shim_probe):
    """The scheduler dies and comes back: the first device's connection reconnects (as ever), and
    the second device's connects again after it; both devices go on computing."""
    sched = harness.scheduler(pool="1GiB", quantum=30, fake_devices=2)
    proc = spawn_probe(
        harness, shim_probe, "twodev", 6, KERNEL_US, 1 << 20, client_id="both", extra=DEVICES
    )
    proc.wait_event("launch", where=lambda e: e["dev"] == 1)
    sched.kill()
    t_killed = time.monotonic()
    sched.start()
    _wait_for(
        lambda: (
            {c["id"] for d in sched.status()["devices"] for c in d["clients"]} == {"both", "both/1"}
        )
    )
    t_back = time.monotonic()
    run = proc.finish(60).ok()
    assert _launches(run, 0, t_back) and _launches(run, 1, t_back), run.describe()
    assert "lost the scheduler" in run.stderr and t_back - t_killed < 10, run.describe()


def test_without_a_scheduler_both_devices_run_unshared(harness, shim_probe):
    """No scheduler at all: the process runs unshared on both devices (a second device's link,
    which cannot connect, never holds a call back)."""
    run = run_probe(harness, shim_probe, "twodev", 0.5, KERNEL_US, 1 << 20, extra=DEVICES).ok()
    assert _launches(run, 0, 0) and _launches(run, 1, 0), run.describe()
