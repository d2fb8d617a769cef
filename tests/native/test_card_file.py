"""The stand-in driver models one card and one host for every process of a test
(GPUSHARE_FAKE_CARD_FILE, native/tests/fake_card.c), as a real card does: plain programs (no
shim) that together pass the device's total get CUDA_ERROR_OUT_OF_MEMORY from the driver; a killed
process's memory is freed; cuMemGetInfo and NVML answer for the whole card; pinned host memory
past GPUSHARE_FAKE_HOST_LIMIT is refused; the card file keeps the peaks a test asserts on.

The harness gives every test a card file (``harness.card_file``); ``read_card`` reads it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.native.card_file import process_start, read_card

MiB = 1 << 20
GiB = 1 << 30
TOTAL = 1 * GiB
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
CARD = {"GPUSHARE_FAKE_DEVICE_TOTAL": str(TOTAL)}
SLOTS_AT = 448  # the card file's layout (native/tests/fake_card.c)
DEVICE0_USED = 64 + 8


def holder(harness: Any, nbytes: int, seconds: float = 60.0, extra: dict[str, str] | None = None):
    """A plain program (no shim) holding ``nbytes`` of device memory, idle for ``seconds``."""
    proc = harness.spawn("idle", seconds, 0.05, nbytes, shim=False, extra={**CARD, **(extra or {})})
    proc.wait_event("idle_start", 30)
    return proc


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout}s"
        time.sleep(0.02)


# Each path the stand-in allocates device memory through (cudart_like's names), refused alike.
REFUSED_PATHS = ["alloc", "pitch", "async", "pool", "create", "array"]


@pytest.mark.parametrize("path", REFUSED_PATHS)
def test_two_plain_processes_past_the_card_the_second_gets_out_of_memory(harness, path):
    a = holder(harness, 700 * MiB)
    run = harness.run("alloc", path, 512 * MiB, shim=False, extra=CARD)
    assert run.event("alloc")["rc"] == OUT_OF_MEMORY, run.describe()
    card = read_card(harness.card_file)
    assert card.used_by(a.pid) == 700 * MiB
    assert card.devices[0].used == 700 * MiB
    assert card.devices[0].peak == 700 * MiB  # the refused bytes never counted
    assert card.devices[0].refused == 1
    # What fits beside it is given: the card is 1 GiB, not the first process's 700 MiB.
    fits = harness.run("alloc", "create", 300 * MiB, shim=False, extra=CARD).ok()
    assert fits.event("alloc")["rc"] == 0 and fits.event("data")["ok"]
    card = read_card(harness.card_file)
    assert card.devices[0].peak == 1000 * MiB
    assert fits.returncode == 0 and card.devices[0].used == 700 * MiB  # given back at its free


def test_without_a_card_file_each_process_has_a_device_of_its_own(harness):
    """The knob is what makes one card: turned off, the same second allocation is given."""
    alone = {**CARD, "GPUSHARE_FAKE_CARD_FILE": ""}
    holder(harness, 700 * MiB, extra=alone)
    run = harness.run("alloc", "alloc", 512 * MiB, shim=False, extra=alone).ok()
    assert run.event("alloc")["rc"] == 0
    assert not Path(harness.card_file).exists()


def test_managed_memory_never_passes_the_card(harness):
    """Managed memory is not refused (the real driver pages it), but what does not fit beside
    the other process stays on the host: the card never holds more than its total."""
    a = holder(harness, 700 * MiB)
    run = harness.run("alloc", "managed", 512 * MiB, shim=False, extra=CARD).ok()
    assert run.event("alloc")["rc"] == 0 and run.event("data")["ok"]
    card = read_card(harness.card_file)
    assert card.devices[0].peak == 700 * MiB, card
    assert card.used_by(a.pid) == 700 * MiB


def test_a_killed_process_memory_is_freed(harness):
    a = holder(harness, 700 * MiB)
    assert read_card(harness.card_file).used_by(a.pid) == 700 * MiB
    a.signal(signal.SIGKILL)  # not reaped yet: a zombie holds no device memory
    wait_until(lambda: process_start(a.pid) == 0, 10, "the killed process's exit")
    run = harness.run("alloc", "create", 700 * MiB, shim=False, extra=CARD).ok()
    assert run.event("alloc")["rc"] == 0
    card = read_card(harness.card_file)
    assert a.pid not in card.processes, card.processes
    assert card.devices[0].peak == 700 * MiB  # the dead process's bytes were gone first


def test_a_reused_pid_is_another_process(harness):
    """A slot whose pid now belongs to another process (its start time differs) is a dead
    process's: its memory is freed. Planted here with this test's own pid and start time 1."""
    harness.run("hold", 0.05, 64 * MiB, shim=False, extra=CARD).ok()  # makes the file
    slot = struct.Struct("=iIQQQ8Q8Q")
    with open(harness.card_file, "r+b") as f:
        f.seek(SLOTS_AT + 7 * slot.size)
        f.write(slot.pack(os.getpid(), 0, 1, 0, 0, 900 * MiB, *[0] * 7, 900 * MiB, *[0] * 7))
        f.seek(DEVICE0_USED)
        f.write(struct.pack("=Q", 900 * MiB))
    assert read_card(harness.card_file).devices[0].used == 900 * MiB
    run = harness.run("alloc", "alloc", 700 * MiB, shim=False, extra=CARD).ok()
    assert run.event("alloc")["rc"] == 0
    assert os.getpid() not in read_card(harness.card_file).processes


def test_a_process_that_exits_gives_its_slot_back(harness):
    harness.run("hold", 0.05, 64 * MiB, shim=False, extra=CARD).ok()
    card = read_card(harness.card_file)
    assert card.processes == {} and card.devices[0].used == 0
    assert card.devices[0].peak == 64 * MiB


def test_cumemgetinfo_and_nvml_see_the_whole_card(harness):
    a = holder(harness, 300 * MiB, extra={"GPUSHARE_FAKE_CONTEXT_BYTES": str(40 * MiB)})
    held = 340 * MiB  # its memory and its context
    run = harness.run("meminfo", 200 * MiB, shim=False, extra=CARD).ok()
    before, after = run.all("meminfo")
    assert before["total"] == TOTAL
    assert before["free"] == TOTAL - held, before
    assert after["free"] == TOTAL - held - 200 * MiB, after
    nvml_before, nvml_after = run.all("nvml")
    assert nvml_before["v1"]["used"] == held and nvml_before["v2"]["free"] == TOTAL - held
    assert nvml_after["v1"]["used"] == held + 200 * MiB
    assert nvml_before["processes"] == {"rc": 0, "list": [[a.pid, held]]}
    assert sorted(map(tuple, nvml_after["processes"]["list"])) == sorted(
        [(a.pid, held), (run.event("start")["pid"], 200 * MiB)]
    )


def test_the_schedulers_nvml_binding_lists_the_card_s_processes(harness):
    """pynvml (what the scheduler's NVML check reads) sees each process with its bytes."""
    a = holder(harness, 300 * MiB)
    code = (
        "import json, pynvml\n"
        "pynvml.nvmlInit()\n"
        "h = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
        "procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)\n"
        "mem = pynvml.nvmlDeviceGetMemoryInfo(h)\n"
        "seen = [[p.pid, p.usedGpuMemory] for p in procs]\n"
        "print(json.dumps({'procs': seen, 'used': mem.used}))\n"
    )
    env = harness.env(shim=False, extra=CARD)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen == {"procs": [[a.pid, 300 * MiB]], "used": 300 * MiB}


def test_pinned_host_memory_past_the_host_limit_is_refused(harness):
    host = {"GPUSHARE_FAKE_HOST_LIMIT": str(1 * GiB)}
    a = harness.spawn("pin", 700 * MiB, 60, shim=False, extra=host)
    assert a.wait_event("pinned", 30)["rc"] == 0
    refused = harness.run("pin", 512 * MiB, 0, shim=False, extra=host)
    assert refused.event("pinned")["rc"] == OUT_OF_MEMORY, refused.describe()
    assert refused.returncode == 1
    harness.run("pin", 300 * MiB, 0, shim=False, extra=host).ok()
    card = read_card(harness.card_file)
    assert card.host_limit == 1 * GiB
    assert card.processes[a.pid].host == 700 * MiB
    assert card.host_used == 700 * MiB
    assert card.host_peak == 1000 * MiB  # never past the limit
    assert card.host_refused == 1


def test_the_peak_is_what_the_processes_held_together(harness):
    """A test reads the card's true peak instead of sampling: 300 MiB held while another process
    took 500 MiB and gave them back is a peak of 800 MiB, and the card holds 300 MiB after."""
    a = holder(harness, 300 * MiB)
    harness.run("alloc", "async", 500 * MiB, shim=False, extra=CARD).ok()
    card = read_card(harness.card_file)
    assert card.devices[0].peak == 800 * MiB
    assert card.devices[0].used == 300 * MiB == card.live_used()
    assert card.processes[a.pid].device_peak[0] == 300 * MiB


@pytest.fixture
def checkpoints(harness: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    d = Path(harness.sock_dir) / "ck"
    d.mkdir()
    monkeypatch.setenv("GPUSHARE_FAKE_CHECKPOINT_DIR", str(d))  # for this process's calls
    return {**CARD, "GPUSHARE_FAKE_CHECKPOINT_DIR": str(d)}


def test_a_checkpointed_process_frees_the_card_until_its_restore(harness, checkpoints):
    """As the real driver: a checkpoint frees the process's device memory; its restore takes it
    again, and is refused while another process holds the room."""
    a = holder(harness, 600 * MiB, extra=checkpoints)
    lib = ctypes.CDLL(str(harness.build.fake_dir / "libcuda.so.1"))
    pid = ctypes.c_int(a.pid)
    assert lib.cuCheckpointProcessLock(pid, None) == 0
    assert lib.cuCheckpointProcessCheckpoint(pid, None) == 0
    assert read_card(harness.card_file).used_by(a.pid) == 0
    b = holder(harness, 600 * MiB)  # fits now
    assert lib.cuCheckpointProcessRestore(pid, None) == OUT_OF_MEMORY
    b.kill()
    assert lib.cuCheckpointProcessRestore(pid, None) == 0
    assert lib.cuCheckpointProcessUnlock(pid, None) == 0
    card = read_card(harness.card_file)
    assert card.used_by(a.pid) == 600 * MiB
    assert card.devices[0].peak == 600 * MiB
