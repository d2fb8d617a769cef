"""Faults on a real GPU: the scheduler killed and restarted under running PyTorch processes, and
the time from killing a holder to the waiter's first GPU work (docs/reliability.md)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    Result,
    Scheduler,
    kill_holder,
    running_scheduler,
    shimmed_env,
    start_scheduler,
    start_workload,
)

GIB = 1 << 30


@pytest.fixture
def long_turns(tmp_path: Path) -> Iterator[Scheduler]:
    """A scheduler whose turns (120 s) outlast each test's moves: no revoke races the faults."""
    with running_scheduler(tmp_path, quantum=120) as sched:
        yield sched


def wait_for(
    scheduler: Scheduler,
    check,
    what: str,
    timeout: float = 120,
    workloads: tuple[subprocess.Popen, ...] = (),
) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = scheduler.status()
        if check(st):
            return st
        time.sleep(0.3)
    said = []
    for proc in workloads:  # what the programs said: a wait that never ends names its cause
        if proc.poll() is None:
            proc.kill()
        said.append(f"rc={proc.wait()} stderr={proc.communicate()[1][-2000:]!r}")
    raise AssertionError(f"{what}: {scheduler.status()} {' '.join(said)}")


def clients(st: dict) -> dict[str, dict]:
    return {c["id"]: c for d in st["devices"] for c in d["clients"]}


@pytest.fixture
def leftovers() -> Iterator[list[subprocess.Popen]]:
    """Workloads killed at the end whatever happened: one that a failed test left holding 14 GiB
    was counted by the next test's scheduler as unmanaged memory (NVML), shrinking its pool."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_scheduler_restart_under_running_torch(
    long_turns: Scheduler, leftovers: list[subprocess.Popen]
) -> None:
    """14 + 14 GiB in a 24 GiB pool: A holds, B waits; the scheduler is SIGKILLed and started
    again. A computes on throughout and keeps the GPU, B keeps its place, both end correct."""
    scheduler = long_turns
    env_a = shimmed_env(scheduler.socket, {"GPUSHARE_CLIENT_ID": "A"})
    env_b = shimmed_env(scheduler.socket, {"GPUSHARE_CLIENT_ID": "B"})
    a = start_workload("memory_hog.py", "14", "30", "A", env=env_a)
    leftovers.append(a)
    wait_for(
        scheduler,
        lambda st: (
            clients(st).get("A", {}).get("state") == "running"
            and clients(st)["A"]["used_bytes"] > 10 * GIB
        ),
        "A never held 14 GiB",
    )
    b = start_workload("memory_hog.py", "14", "5", "B", env=env_b)
    leftovers.append(b)
    before = wait_for(
        scheduler, lambda st: clients(st).get("B", {}).get("state") == "waiting", "B never waited"
    )
    scheduler.process.send_signal(signal.SIGKILL)
    scheduler.process.wait(10)
    time.sleep(1.0)
    restarted = start_scheduler(scheduler.socket, scheduler.log, quantum=120)
    scheduler.process = restarted.process
    keys = ("managed_bytes", "quota_bytes", "weight")
    corrected = ("used_bytes", "evicted_bytes")

    def as_before(st: dict) -> bool:
        # What the shims said is kept exactly. used_bytes and evicted_bytes also hold NVML's
        # reading of the process where it saw more than the claim (the real context against the
        # estimate: the difference counts as used and, for a kernel off its turn, leaves evicted;
        # features/nvml_check.corrected). The readings start again after the restart, and the
        # snapshot before it may predate B's first: they differed by 100 MiB at most (used, H100,
        # 2026-11-27) and by 6 MiB (B's evicted, H100, 2026-11-28), so within 128 MiB.
        now = clients(st)
        return (
            set(now) == {"A", "B"}
            and now["B"]["state"] == "waiting"
            and all(now[c][k] == clients(before)[c][k] for c in ("A", "B") for k in keys)
            and all(
                abs(now[c][k] - clients(before)[c][k]) <= 128 << 20
                for c in ("A", "B")
                for k in corrected
            )
        )

    after = wait_for(scheduler, as_before, "A and B did not come back as they were", timeout=10)
    assert clients(after)["A"]["state"] == "running"
    out_a, err_a = a.communicate(timeout=300)
    out_b, err_b = b.communicate(timeout=300)
    assert a.returncode == 0, err_a
    assert b.returncode == 0, err_b
    ra, rb = Result(0, out_a, err_a).record, Result(0, out_b, err_b).record
    assert ra["correct"] and rb["correct"], (ra, rb)
    print(
        f"restart: A {ra['iterations']} iterations, correct={ra['correct']}; "
        f"B waited {rb['shim']['wait_seconds']:.2f}s, correct={rb['correct']}"
    )
    assert "grant client=A resumed" in scheduler.log_text()


def test_killed_holder_handover_time(
    long_turns: Scheduler, leftovers: list[subprocess.Popen]
) -> None:
    """SIGKILL of a PyTorch holder to the waiter's first computed result, five times."""
    scheduler = long_turns
    times = []
    for i in range(5):
        a = start_workload("memory_hog.py", "14", "120", f"A{i}", env=shimmed_env(scheduler.socket))
        leftovers.append(a)
        wait_for(
            scheduler,
            lambda st: any(
                c["state"] == "running" and c["used_bytes"] > 10 * GIB for c in clients(st).values()
            ),
            "A never held 14 GiB",
            workloads=(a,),
        )
        b = start_workload("memory_hog.py", "14", "0.5", f"B{i}", env=shimmed_env(scheduler.socket))
        leftovers.append(b)
        wait_for(scheduler, lambda st: any(d["queue"] for d in st["devices"]), "B never waited")
        rb, killed_at = kill_holder(a, b)
        times.append(rb["first_compute"] - killed_at)
        wait_for(scheduler, lambda st: not clients(st), "clients left behind", timeout=30)
    ms = sorted(round(t * 1000, 1) for t in times)
    print(f"SIGKILL of the holder -> the waiter's first result (ms): {ms}")
    # Recorded on an H100 and on H200s: 0.67-0.88 s (docs/gpu-runs/2026-11-22-*). The bound is the
    # worst of those plus 70 % for a loaded machine: a regression to seconds fails.
    assert max(times) < 1.5, ms
