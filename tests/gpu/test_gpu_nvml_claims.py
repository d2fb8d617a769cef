"""A memory claim below what NVML sees the process hold is corrected, on a real GPU (issue #15,
item 7; docs/reliability.md, "A hostile local user").

The shim is told its context costs 1 byte (``GPUSHARE_CONTEXT_BYTES=1``), so its claim leaves out
the real CUDA context (hundreds of MiB), which NVML's per-process figure includes: the scheduler
must match the process by its ``SO_PEERCRED`` pid with NVML's list and count NVML's figure.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Scheduler, running_scheduler, shimmed_env, start_workload

MIB = 1 << 20


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[Scheduler]:
    with running_scheduler(tmp_path, quantum=60) as sched:
        yield sched


def nvml_bytes(pid: int) -> int:
    """What NVML sees ``pid`` hold on GPU 0 (0: not listed)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid and isinstance(proc.usedGpuMemory, int):
                return int(proc.usedGpuMemory)
        return 0
    finally:
        pynvml.nvmlShutdown()


def test_an_under_claimed_context_is_counted_as_nvml_sees_it(scheduler: Scheduler) -> None:
    from jupyter_gpushare.scheduler.shell.devices import nvml_pids_comparable

    if not nvml_pids_comparable():
        pytest.skip(
            "this machine runs the tests in a pid namespace of its own (a container): "
            "NVML's pids are the host's, and the scheduler does not cross-check"
        )
    env = shimmed_env(scheduler.socket, {"GPUSHARE_CLIENT_ID": "U", "GPUSHARE_CONTEXT_BYTES": "1"})
    hog = start_workload("memory_hog.py", "0.0625", "20", "U", env=env)  # 64 MiB
    try:
        deadline = time.monotonic() + 60
        seen = used = 0
        while time.monotonic() < deadline:
            (client,) = [c for d in scheduler.status()["devices"] for c in d["clients"]] or [{}]
            seen = nvml_bytes(hog.pid)
            used = int(client.get("used_bytes", 0))
            if seen > 128 * MIB and used >= seen:
                break
            time.sleep(0.5)
        print(
            f"NVML sees {seen / MIB:.0f} MiB for the process; the scheduler counts {used / MIB:.0f}"
        )
        assert seen > 128 * MIB, "NVML never listed the process with its context"
        assert used >= seen, (used, seen)
        log = scheduler.log_text()
        assert "memory claim corrected client=U" in log, log[-3000:]
    finally:
        hog.kill()
        hog.wait(timeout=30)


def test_taking_turns_with_the_cross_check_on(tmp_path: Path) -> None:
    """14 + 14 GiB in a 24 GiB pool with 2 s turns: A is evicted for B and back. With NVML's
    per-process figures checked each second, an honest client must not be over-counted (its
    claim covers what NVML sees, context aside), so the two still take turns and end correct.
    Prints what NVML sees of the evicted holder: whether NVML counts managed memory that is on
    the host decides whether an eviction lie could be caught the same way (docs/reliability.md)."""
    from conftest import Result

    with running_scheduler(tmp_path, quantum=2) as sched:

        def hog(tag: str, seconds: str) -> subprocess.Popen:
            env = shimmed_env(sched.socket, {"GPUSHARE_CLIENT_ID": tag})
            return start_workload("memory_hog.py", "14", seconds, tag, env=env)

        a = hog("A", "12")
        time.sleep(3)
        b = hog("B", "6")
        seen: list[tuple[str, int, int, int]] = []  # (state, evicted, pinned, NVML) of A
        while a.poll() is None or b.poll() is None:
            clients = {c["id"]: c for d in sched.status()["devices"] for c in d["clients"]}
            if "A" in clients and a.poll() is None:
                c = clients["A"]
                seen.append((c["state"], c["evicted_bytes"], c["pinned_bytes"], nvml_bytes(a.pid)))
            time.sleep(0.5)
        out_a, err_a = a.communicate(timeout=60)
        out_b, err_b = b.communicate(timeout=60)
        ra, rb = (
            Result(a.returncode, out_a, err_a).record,
            Result(b.returncode, out_b, err_b).record,
        )
        evicted = [s for s in seen if s[1] > 0]
        print(f"A while evicted (state, evicted, pinned, NVML bytes): {evicted[:5]}")
        print(f"A while resident: {[s for s in seen if s[1] == 0][:5]}")
        assert a.returncode == 0 and b.returncode == 0, (err_a[-2000:], err_b[-2000:])
        assert ra["correct"] and rb["correct"], (ra, rb)
        assert evicted, "A was never evicted: the two did not take turns"
        # Counted as pinned (never moved) only what the claim left out: the context's error.
        assert max(s[2] for s in seen) < 2 << 30, seen
