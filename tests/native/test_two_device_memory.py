"""Issue 12, fault 3: a process's memory on two GPUs is accounted, reported and moved per device.

Each allocation counts on the device of the context it was made in; each device's registration
(``<id>`` for the first, ``<id>/<ordinal>`` for a later one) reports that device's memory only,
has its own quota, and a revoke that evicts one device moves that device's memory only, in that
device's context, and brings it back to the same addresses (docs/architecture.md, "Several
devices"). Runs on the stand-in driver with two devices, each with memory of its own
(``fakecuda_resident_bytes``), and a live scheduler that discovers both through the stand-in NVML.
"""

from __future__ import annotations

import itertools
import re
import time
from typing import Any

import pytest

from tests.native.probe import spawn_probe

MiB = 1 << 20
CONTEXT = 64 * MiB
ON_DEV0 = 128 * MiB
ON_DEV1 = 320 * MiB  # with "other"'s as much, device 1's 512 MiB pool fits only one of them
DEVICES = {"GPUSHARE_FAKE_DEVICES": "2"}
KERNEL_US = 20000


def _client(sched: Any, client_id: str) -> dict[str, Any] | None:
    for dev in sched.status()["devices"]:
        for c in dev["clients"]:
            if c["id"] == client_id:
                return {**c, "device_index": dev["index"]}
    return None


def _wait_for(sched: Any, cond: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not met in time: {sched.status()}"
        time.sleep(0.05)


def _used(sched: Any, client_id: str) -> int | None:
    c = _client(sched, client_id)
    return None if c is None else int(c["used_bytes"])


def _launches(run: Any, dev: int, after: float, before: float = float("inf")) -> list[dict]:
    return [
        e
        for e in run.events
        if e.get("event") == "launch" and e["dev"] == dev and after <= e["t_mono"] < before
    ]


def _twomem(harness: Any, probe: Any, seconds: float, free1_after: float, **gpushare: Any) -> Any:
    """shim_probe twomem as client "both": ON_DEV0 on device 0, ON_DEV1 on device 1."""
    args = ("twomem", seconds, KERNEL_US, ON_DEV0, ON_DEV1, free1_after)
    extra = gpushare.pop("extra", DEVICES)
    return spawn_probe(
        harness, probe, *args, client_id="both", context_bytes=CONTEXT, extra=extra, **gpushare
    )


def _wait_usage(sched: Any, first: int, second: int) -> None:
    """Until the registrations of devices 0 and 1 report these bytes used."""
    _wait_for(
        sched,
        lambda: _used(sched, "both") == first and _used(sched, "both/1") == second,
        f"devices 0 and 1 reporting {first} and {second} bytes",
    )


@pytest.mark.parametrize("memory", ["vmm", "managed"])
def test_evicting_one_device_moves_only_its_memory(harness, shim_probe, memory):
    sched = harness.scheduler(pool="512MiB", quantum=1.0, fake_devices=2)
    both = _twomem(harness, shim_probe, 8, 0, memory=memory)
    allocated = {
        dev: both.wait_event("allocated", where=lambda e, d=dev: e["dev"] == d) for dev in (0, 1)
    }
    both.wait_event("launch", where=lambda e: e["dev"] == 1)
    # Each registration reports its own device's memory, to the byte.
    _wait_usage(sched, CONTEXT + ON_DEV0, CONTEXT + ON_DEV1)
    assert _client(sched, "both")["device_index"] == 0
    assert _client(sched, "both/1")["device_index"] == 1

    # Another process needs device 1's room: "both/1" is revoked and evicted at its quantum's end.
    other_env = {**DEVICES, "CUDA_VISIBLE_DEVICES": "1"}
    other = spawn_probe(
        harness,
        shim_probe,
        "grantedlaunches",  # 1.5 s from its grant, however late the loaded host makes it
        1.5,
        KERNEL_US,
        ON_DEV1,
        client_id="other",
        context_bytes=CONTEXT,
        extra=other_env,
    )
    _wait_for(
        sched,
        lambda: (_client(sched, "both/1") or {}).get("evicted_bytes") == ON_DEV1,
        "device 1's memory evicted",
    )
    during = _client(sched, "both")
    assert during["evicted_bytes"] == 0 and during["used_bytes"] == CONTEXT + ON_DEV0, during
    other.finish(60).ok()
    run = both.finish(60).ok()
    # The eviction as the process met it: device 0's first launch that found none of device 1's
    # memory resident (the status read above can lag it by seconds on a loaded host, past the
    # restore).
    gone = [e for e in _launches(run, 0, 0.0) if e["resident"][1] == 0]
    assert gone, run.describe()
    t_evicted = gone[0]["t_mono"]

    # The eviction moved device 1's bytes, and only them.
    moved = [(who, int(n)) for who, n in re.findall(r"evicted client=(\S+) bytes=(\d+)", sched.log)]
    assert ("both/1", ON_DEV1) in moved, sched.log
    assert all(who != "both" for who, _ in moved), sched.log
    # On the stand-in's devices, from the eviction until device 1 was given back (the two take
    # turns at 1 s quanta): device 0 kept its memory and ran on; device 1 held nothing of this
    # process's until the restore made its memory there again, before its next launch.
    t_back = min(e["t_mono"] for e in _launches(run, 1, t_evicted))
    window = _launches(run, 0, t_evicted, t_back)
    assert len(window) > 5, run.describe()
    assert {e["resident"][0] for e in window} == {ON_DEV0}, window
    on_dev1 = [e["resident"][1] for e in window]
    away = on_dev1.index(ON_DEV1) if ON_DEV1 in on_dev1 else len(on_dev1)
    assert away >= 3 and set(on_dev1[:away]) == {0}, on_dev1
    assert set(on_dev1[away:]) <= {ON_DEV1}, on_dev1  # once back, all of it
    # (Device 1's part only: on a loaded host its turn can come after device 0's thread has
    # ended its 8 s and freed device 0's memory; device 0 kept it all through the window, above.)
    assert _launches(run, 1, t_back)[0]["resident"][1] == ON_DEV1, run.describe()
    gaps = [b["t_mono"] - a["t_mono"] for a, b in itertools.pairwise(window)]
    assert max(gaps) < 0.5, gaps
    # Contents and addresses survived: each device's pattern, at the pointer it was allocated at.
    for dev in (0, 1):
        verified = [e for e in run.all("verified") if e["dev"] == dev]
        assert verified and verified[0]["ok"], run.describe()
        assert verified[0]["ptr"] == allocated[dev]["ptr"]
    assert "device 1: restored 320.00 MiB" in run.stderr, run.describe()


def test_each_device_reports_exactly_what_it_holds_after_a_free(harness, shim_probe, tmp_path):
    sched = harness.scheduler(pool="1GiB", quantum=30, fake_devices=2)
    # Device 1 frees once told, and the process stays until told: each state is seen, not raced.
    proc = _twomem(harness, shim_probe, 3, 1.0, extra={**DEVICES, "PROBE_STEP_DIR": str(tmp_path)})
    _wait_usage(sched, CONTEXT + ON_DEV0, CONTEXT + ON_DEV1)
    (tmp_path / "free1").touch()
    proc.wait_event("freed", where=lambda e: e["dev"] == 1)
    # Device 1's memory is gone from device 1's registration; device 0's is untouched.
    _wait_usage(sched, CONTEXT + ON_DEV0, CONTEXT)
    proc.wait_event("done", 30)
    _wait_usage(sched, CONTEXT, CONTEXT)
    (tmp_path / "done").touch()
    run = proc.finish(60).ok()
    assert all(e["ok"] for e in run.all("verified")) and len(run.all("verified")) == 2


def test_the_quota_holds_on_each_device_on_its_own(harness, shim_probe, tmp_path):
    quota = 300 * MiB
    each = 160 * MiB  # one fits each device's quota with its context; two do not
    sched = harness.scheduler(pool="1GiB", quantum=30, fake_devices=2)
    proc = spawn_probe(
        harness,
        shim_probe,
        "twoquota",
        each,
        client_id="both",
        context_bytes=CONTEXT,
        memory_limit="300MiB",
        extra={**DEVICES, "PROBE_STEP_DIR": str(tmp_path)},
    )
    q = proc.wait_event("quota")
    assert q["rc0"] == 0 and q["rc1"] == 0, q  # device 1's allocation is not device 0's quota
    assert q["rc1_again"] == 2, q  # CUDA_ERROR_OUT_OF_MEMORY: over device 1's quota
    # Each device's view is its own quota, less what the process holds there.
    assert q["total0"] == q["total1"] == quota, q
    assert q["free0"] == q["free1"] == quota - CONTEXT - each, q
    # The probe holds each step until told (PROBE_STEP_DIR): the scheduler's view is never raced.
    _wait_usage(sched, CONTEXT + each, CONTEXT + each)
    (tmp_path / "quota").touch()
    proc.wait_event("freed1")
    _wait_usage(sched, CONTEXT + each, CONTEXT)
    (tmp_path / "freed1").touch()
    proc.wait_event("freed0")
    _wait_usage(sched, CONTEXT, CONTEXT)
    (tmp_path / "freed0").touch()
    run = proc.finish(30).ok()
    refusal = "would take this process to 384.00 MiB on device 1, over its quota of 300.00 MiB"
    assert refusal in run.stderr, run.describe()
