"""Deep idle end to end on the stand-in driver: a real scheduler checkpoints a real shimmed process
through the stand-in's cuCheckpointProcess* (native/tests/fake_checkpoint.c), and wakes it.

The stand-in in the target process serves the checkpoint commands the scheduler's copy of it
sends; it poisons device memory at checkpoint and puts it back at restore, and it reports the
device bytes the process holds (its context's GPUSHARE_FAKE_CONTEXT_BYTES included), so "asleep"
is checked as the card would show it and "data intact" as the program reads its memory back.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest

from tests.native.jupyter_state import kernel_state

MiB = 1 << 20
CONTEXT = 64 * MiB
DATA = 32 * MiB
IDLE_S = 1.5  # deep_idle_seconds of these tests


@pytest.fixture
def ckpt(harness: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The stand-in's checkpoint rendezvous (a short directory: socket paths are limited)."""
    d = Path(harness.sock_dir) / "ck"
    d.mkdir()
    monkeypatch.setenv("GPUSHARE_FAKE_CHECKPOINT_DIR", str(d))  # for device_bytes() here
    return {"GPUSHARE_FAKE_CHECKPOINT_DIR": str(d), "GPUSHARE_FAKE_CONTEXT_BYTES": str(CONTEXT)}


def device_bytes(harness: Any, pid: int) -> int:
    """What the target's stand-in driver says the process holds on the device (-1: no answer)."""
    lib = ctypes.CDLL(str(harness.build.fake_dir / "libcuda.so.1"))
    lib.fakecuda_process_device_bytes.restype = ctypes.c_longlong
    return int(lib.fakecuda_process_device_bytes(ctypes.c_int(pid)))


def start(harness: Any, ckpt: dict[str, str], deep_idle: float, library: str = "libcuda.so.1"):
    return harness.scheduler(
        pool="1GiB",
        args=(
            "--deep-idle",
            str(deep_idle),
            f"--GPUShareScheduler.checkpoint_library={harness.build.fake_dir / library}",
        ),
        env={"GPUSHARE_FAKE_CHECKPOINT_DIR": ckpt["GPUSHARE_FAKE_CHECKPOINT_DIR"]},
    )


def spawn(harness: Any, ckpt: dict[str, str], idle: float, client: str = "A"):
    return harness.spawn(
        "deep_idle",
        DATA,
        idle,
        extra=ckpt,
        client_id=client,
        context_bytes=CONTEXT,
        idle_seconds=0.3,
        log="info",
    )


def as_notebook(harness: Any, sched: Any, client: str = "A") -> None:
    """Make the client a notebook kernel as the scheduler sees one: Jupyter reported a cell of it
    (deep idle sleeps only those, which a busy wakes before the cell's first CUDA call)."""
    sched.wait_log(f"join client={client}", 20)
    kernel_state(harness, client, "busy")
    kernel_state(harness, client, "idle")


def client_status(sched: Any, client: str) -> dict[str, Any]:
    for dev in sched.status()["devices"]:
        for c in dev["clients"]:
            if c["id"] == client:
                return c
    raise AssertionError(f"no client {client} in the status")


def test_an_idle_process_sleeps_holds_nothing_and_its_next_call_wakes_it(harness, ckpt):
    sched = start(harness, ckpt, IDLE_S)
    a = spawn(harness, ckpt, 8.0)
    as_notebook(harness, sched)
    a.wait_event("idle_start", 20)
    awake = device_bytes(harness, a.pid)
    assert awake >= CONTEXT + DATA, awake  # its context and its memory, before any eviction
    sched.wait_log("asleep client=A", 20)
    # Evicted first (its data went through the memory engine), then the context went too.
    log = sched.log
    assert log.index("evicted client=A") < log.index("asleep client=A"), log
    assert device_bytes(harness, a.pid) == 0
    assert client_status(sched, "A")["state"] == "asleep"
    tick = a.wait_event("tick", 10, where=lambda e: e["status"]["state"] == "asleep")
    assert tick["status"]["state_code"] == 6
    run = a.finish(60).ok()
    woken = run.event("woken")
    assert woken["data_ok"], "data did not survive eviction, checkpoint, restore"
    assert woken["status"]["state"] == "holding"
    log = sched.wait_log("woke client=A")
    # The grant went out only after the restore and the unlock.
    held = log.index("grant_held client=A")
    assert held < log.index("woke client=A") < log.index("grant client=A restore=1", held), log
    assert woken["first_call_s"] < 5.0, woken


def test_a_busy_notebook_wakes_a_sleeping_kernel_before_its_first_call(harness, ckpt):
    sched = start(harness, ckpt, IDLE_S)
    # The program makes its next call after 20 s: on a loaded machine the eviction and the
    # checkpoint alone took several seconds, and the busy must come before that call.
    a = spawn(harness, ckpt, 20.0)
    as_notebook(harness, sched)
    sched.wait_log("asleep client=A", 60)
    assert device_bytes(harness, a.pid) == 0
    kernel_state(harness, "A", "busy")
    sched.wait_log("woke client=A", 30)
    # Awake again while the program has made no GPU call yet: its context is back.
    assert device_bytes(harness, a.pid) >= CONTEXT
    assert client_status(sched, "A")["state"] != "asleep"
    a.wait_event("tick", 10, where=lambda e: e["status"]["state"] != "asleep")
    run = a.finish(60).ok()
    assert run.event("woken")["data_ok"]


def test_a_program_jupyter_does_not_report_is_never_put_to_sleep(harness, ckpt):
    """Only a notebook kernel sleeps: a plain program's first call after a sleep may be one the
    shim does not gate, which the locked driver blocks before the shim can ask for a wake."""
    sched = start(harness, ckpt, IDLE_S)
    a = spawn(harness, ckpt, 4.0)
    a.wait_event("idle_start", 20)
    a.wait_event("tick", 10, where=lambda e: e["status"]["idle_seconds"] > 2 * IDLE_S + 0.5)
    assert device_bytes(harness, a.pid) >= CONTEXT
    run = a.finish(60).ok()
    assert run.event("woken")["data_ok"]
    assert "asleep client=" not in sched.log


def test_zero_turns_deep_idle_off(harness, ckpt):
    sched = start(harness, ckpt, 0)
    a = spawn(harness, ckpt, 4.0)
    sched.wait_log("deep idle is off (deep_idle_seconds = 0)")
    a.wait_event("idle_start", 20)
    a.wait_event("tick", 10, where=lambda e: e["status"]["idle_seconds"] > 3.0)
    assert device_bytes(harness, a.pid) >= CONTEXT
    run = a.finish(60).ok()
    assert run.event("woken")["data_ok"]
    assert "asleep client=" not in sched.log


def test_a_driver_without_the_api_turns_it_off_with_one_log_line(harness, ckpt):
    # The stand-in NVML library has no cuCheckpointProcess* symbols: a driver before 12.8.
    sched = start(harness, ckpt, IDLE_S, library="libnvidia-ml.so.1")
    a = spawn(harness, ckpt, 4.0)
    run = a.finish(60).ok()
    assert run.event("woken")["data_ok"]
    lines = [line for line in sched.log.splitlines() if "deep idle is off" in line]
    assert len(lines) == 1, lines
    assert "cuCheckpointProcessLock" in lines[0] and "CUDA 12.8" in lines[0], lines
    assert "asleep client=" not in sched.log


def test_a_driver_that_refuses_the_checkpoint_turns_it_off_once_and_the_kernel_runs_on(
    harness, ckpt
):
    # Managed memory (the shim's older mode) is what the real driver refuses with 801.
    sched = start(harness, ckpt, IDLE_S)
    a = harness.spawn(
        "deep_idle",
        DATA,
        5.0,
        extra=ckpt,
        client_id="A",
        context_bytes=CONTEXT,
        idle_seconds=0.3,
        memory="managed",
        log="info",
    )
    as_notebook(harness, sched)
    sched.wait_log("deep idle is off", 20)
    run = a.finish(60).ok()
    assert run.event("woken")["data_ok"]
    lines = [line for line in sched.log.splitlines() if "deep idle is off" in line]
    assert len(lines) == 1 and "CUDA_ERROR_NOT_SUPPORTED (801)" in lines[0], lines
    assert "asleep client=" not in sched.log
