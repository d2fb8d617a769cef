"""MPS mode on a real GPU: killing one MPS client in the middle of a kernel while another computes.

NVIDIA's MPS documentation warns that a client that dies with work in flight can leave the MPS
server and its other clients in an undefined state, and that a client must synchronise before it
exits or be removed with ``terminate_client`` before it is killed. This module measures that, with
the scheduler's own MPS manager (jupyter_gpushare/scheduler/features/mps.py) driving a real
``nvidia-cuda-mps-control``:

* the bystander B (``mps_worker.py steady``) repeats an exactly checkable matrix product;
* the victim A (``mps_worker.py spin``) holds 1 GiB and runs a kernel that spins on every SM;
* A is ended mid-kernel (1) with ``terminate_client`` before SIGKILL, (2) with SIGTERM under the
  shim (which synchronises before the process ends), (3) with a plain SIGKILL;
* afterwards: were all of B's products correct, did B see an error, does the MPS server still run
  and does a fresh client compute correctly?

Plus the scheduler's MPS mode end to end (``gpushare scheduler --mps``: the daemon, ``mps_env``,
``mps_terminate``) and what ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` does to plain and to managed
(shim) allocations.

Everything is written to ``$OUT/mps/mps_result.json`` (or the test's tmp directory) as it
happens, so a run cut short still says how far it got. Without ``nvidia-cuda-mps-control``, or
when its daemon cannot start, the JSON says why and the tests are skipped. About 2-3 minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import WORKLOADS, Scheduler, shimmed_env, workload_env

from jupyter_gpushare.scheduler.features.mps import MPSError, MPSManager, find_control_binary

OUT = Path(os.environ["OUT"]) / "mps" if os.environ.get("OUT") else None
RESULT: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
#: B's exact product size (n x n float32; 3 x 64 MiB), the victim's memory: far below the card.
N = 4096
VICTIM_GIB = 1.0
SHARE = 50  # percent of the SMs each of A and B may use (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)


def out_dir() -> Path:
    global OUT
    if OUT is None:
        OUT = Path(tempfile.mkdtemp(prefix="gpushare-mps-"))
    OUT.mkdir(parents=True, exist_ok=True)
    return OUT


def save() -> None:
    RESULT["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path = out_dir() / "mps_result.json"
    path.write_text(json.dumps(RESULT, indent=2, default=str))


def mps_binary() -> str | None:
    return find_control_binary()


def gpu_uuid() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "0"
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return lines[0] if out.returncode == 0 and lines else "0"


# ---------------------------------------------------------------------------------------------
# Processes


class Worker:
    """mps_worker.py in a subprocess; its JSON lines are collected as they come."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        self.args = list(args)
        self.popen = subprocess.Popen(
            [sys.executable, str(WORKLOADS / "mps_worker.py"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.pid = self.popen.pid
        self.events: list[dict[str, Any]] = []
        self.stderr_lines: list[str] = []
        self.cond = threading.Condition()
        self.threads = [
            threading.Thread(target=self._read, args=(self.popen.stdout, True), daemon=True),
            threading.Thread(target=self._read, args=(self.popen.stderr, False), daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _read(self, stream: Any, is_stdout: bool) -> None:
        for line in stream:
            with self.cond:
                if is_stdout and line.startswith("{"):
                    with contextlib.suppress(json.JSONDecodeError):
                        self.events.append(json.loads(line))
                elif not is_stdout:
                    self.stderr_lines.append(line.rstrip())
                self.cond.notify_all()

    def wait(self, event: str, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for e in self.events:
                    if e.get("event") == event:
                        return e
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not self._reading()):
                    return None
                self.cond.wait(min(left, 0.1))

    def _reading(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def finish(self, timeout: float) -> int | None:
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        for t in self.threads:
            t.join(5)
        return rc

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)

    def stderr_tail(self, n: int = 15) -> list[str]:
        with self.cond:
            return self.stderr_lines[-n:]


def rate(windows: list[list[float]], t0: float, t1: float) -> float | None:
    """B's products per second between t0 and t1, from its (time, iterations) points."""
    pts = [(t, i) for t, i in windows if t0 <= t <= t1]
    if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
        return None
    return round((pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]), 2)


def as_client(env: dict[str, str], client: dict[str, Any]) -> dict[str, str]:
    """``env`` made an MPS client's: what mps_env / client_env said to unset and to set."""
    env = dict(env)
    for key in client["unset"]:
        env.pop(key, None)
    env.update(client["env"])
    return env


def mps_env(manager: MPSManager, **kw: Any) -> dict[str, str]:
    return as_client(workload_env(), manager.client_env(**kw))


def allocations(env: dict[str, str], *gib: str) -> dict[str, Any] | None:
    """mps_worker.py alloc: which of the sizes could be allocated and filled."""
    w = Worker("alloc", *gib, env=env)
    w.finish(120)
    done = w.wait("done", 1)
    if done is not None:
        done["stderr"] = w.stderr_tail(5)
    return done


# ---------------------------------------------------------------------------------------------
# Fixtures


def start_manager(binary: str, device: str) -> tuple[MPSManager, str]:
    """An MPS daemon for the GPU, in a fresh short directory; a skip (with the reason in the
    JSON) when it cannot start."""
    runtime = tempfile.mkdtemp(prefix="gsmps-", dir="/tmp")
    mgr = MPSManager(runtime, binary=binary, terminate_timeout=30.0)
    try:
        asyncio.run(mgr.start([device]))
    except MPSError as exc:
        RESULT["available"] = False
        RESULT["reason"] = f"the MPS control daemon cannot start: {exc}"
        save()
        shutil.rmtree(runtime, ignore_errors=True)
        pytest.skip(RESULT["reason"])
    return mgr, runtime


@pytest.fixture(scope="module")
def binary() -> str:
    """nvidia-cuda-mps-control, once a daemon of it has served one client correctly; else the
    JSON says why and every test here is skipped."""
    found = mps_binary()
    RESULT["binary"] = found
    RESULT["searched"] = ["PATH", "/usr/local/nvidia/bin", "/usr/bin", "/usr/local/bin"]
    if found is None:
        RESULT["available"] = False
        RESULT["reason"] = "nvidia-cuda-mps-control is not installed on this machine"
        save()
        pytest.skip(RESULT["reason"])
    mgr, runtime = start_manager(found, gpu_uuid())
    try:
        first = probe(mps_env(mgr))
        first["mps_state"] = server_state(mgr)
        RESULT["first_client"] = first
        if not first["ok"]:
            RESULT["available"] = False
            daemon = next(iter(mgr.daemons.values()))
            RESULT["logs"] = mps_logs(daemon.log_dir)
            RESULT["reason"] = "the MPS daemon started but no MPS server served a client"
            save()
            pytest.skip(RESULT["reason"])
    finally:
        asyncio.run(mgr.stop())
        shutil.rmtree(runtime, ignore_errors=True)
    RESULT["available"] = True
    save()
    return found


@pytest.fixture(scope="module")
def manager(binary: str) -> Iterator[MPSManager]:
    """The module's MPS daemon (after the scheduler's own, in the first test, has quit)."""
    device = gpu_uuid()
    mgr, runtime = start_manager(binary, device)
    RESULT["available"] = True
    RESULT["daemon"] = mgr.describe()
    save()
    try:
        yield mgr
    finally:
        daemon = mgr.daemons.get(device)
        if daemon is not None:
            RESULT["logs"] = mps_logs(daemon.log_dir)
        asyncio.run(mgr.stop())
        save()
        shutil.rmtree(runtime, ignore_errors=True)


def mps_logs(log_dir: str) -> dict[str, list[str]]:
    logs = {}
    for name in ("control.log", "server.log"):
        path = Path(log_dir) / name
        if path.exists():
            logs[name] = path.read_text(errors="replace").splitlines()[-60:]
    return logs


def server_state(manager: MPSManager) -> dict[str, Any]:
    async def query() -> dict[str, Any]:
        daemon = next(iter(manager.daemons.values()))
        servers = await manager.server_pids(daemon)
        status = {}
        for s in servers:
            # ACTIVE, or FAULT after a client broke the server (newer drivers; recorded raw).
            res = await manager.control(daemon, f"get_server_status {s}")
            status[s] = (res.stdout + res.stderr).strip()[:200]
        return {
            "servers": servers,
            "clients": {s: await manager.client_pids(daemon, s) for s in servers},
            "status": status,
        }

    return asyncio.run(query())


def probe(env: dict[str, str]) -> dict[str, Any]:
    """A fresh client computes for 2 s: does the MPS server still serve correct results?"""
    w = Worker("steady", "2", str(N), env=env)
    rc = w.finish(120)
    done = w.wait("done", 1) or {}
    return {
        "rc": rc,
        "iters": done.get("iters"),
        "mismatches": done.get("mismatches"),
        "error": done.get("error"),
        "ok": rc == 0
        and done.get("error") is None
        and done.get("mismatches") == 0
        and (done.get("iters") or 0) > 0,
        "stderr": w.stderr_tail(8) if rc != 0 else [],
    }


def kill_scenario(
    manager: MPSManager,
    name: str,
    mode: str,
    victim_env: dict[str, str],
    bystander_env: dict[str, str],
    spin_seconds: float,
    kill_after: float = 2.0,
) -> dict[str, Any]:
    """B computes; A starts a long kernel; A is ended per ``mode`` 2 s into it; B goes on 5 s."""
    rec: dict[str, Any] = {"mode": mode, "spin_seconds": spin_seconds}
    RESULT.setdefault("scenarios", {})[name] = rec
    stop = Path(tempfile.mkdtemp(prefix="gsstop-")) / "stop"
    b = Worker("steady", "120", str(N), str(stop), env=bystander_env)
    a: Worker | None = None
    try:
        ready = b.wait("ready", 120)
        assert ready is not None, f"B did not start: {b.stderr_tail()}"
        time.sleep(1.5)  # B alone: the baseline rate
        a = Worker("spin", str(spin_seconds), str(VICTIM_GIB), env=victim_env)
        launched = a.wait("launched", 120)
        assert launched is not None, f"A did not launch: {a.stderr_tail()}"
        rec["victim_launch"] = launched
        time.sleep(kill_after)
        rec["before"] = server_state(manager)
        rec["victim_was_client"] = any(a.pid in c for c in rec["before"]["clients"].values())
        rec["bystander_was_client"] = any(b.pid in c for c in rec["before"]["clients"].values())
        t_kill = time.time()
        if mode == "terminate_then_sigkill":
            t0 = time.monotonic()
            rec["terminate"] = asyncio.run(manager.terminate_process(a.pid, tree=True))
            rec["terminate_seconds"] = round(time.monotonic() - t0, 3)
            rec["victim_alive_after_terminate"] = a.popen.poll() is None
            a.popen.send_signal(signal.SIGKILL)
        elif mode == "sigterm_under_shim":
            a.popen.send_signal(signal.SIGTERM)
        else:
            a.popen.send_signal(signal.SIGKILL)
        rc = a.finish(60)
        rec["victim"] = {
            "rc": rc,
            "exit_after_kill_s": round(time.time() - t_kill, 3),
            "events": [e for e in a.events if e.get("event") != "progress"],
            "stderr": a.stderr_tail(10),
        }
        time.sleep(5.0)  # B goes on after the victim's end
        # Asked while B still runs: an MPS server may leave once it has no client.
        rec["after"] = server_state(manager)
        rec["bystander_still_client"] = any(b.pid in c for c in rec["after"]["clients"].values())
        stop.touch()
        rc_b = b.finish(120)
        done = b.wait("done", 5) or {}
        windows = done.get("windows") or []
        t_launch = float(launched.get("t", t_kill))
        rec["bystander"] = {
            "rc": rc_b,
            "iters": done.get("iters"),
            "mismatches": done.get("mismatches"),
            "error": done.get("error"),
            "max_gap_s": done.get("max_gap_s"),
            "rate_alone": rate(windows, float(ready["t"]), t_launch),
            "rate_beside_victim": rate(windows, t_launch, t_kill),
            "rate_after": rate(windows, t_kill + 1.0, t_kill + 5.0),
            "stderr": b.stderr_tail(10) if rc_b != 0 or done.get("error") else [],
        }
        rec["bystander_correct"] = (
            rc_b == 0 and done.get("error") is None and done.get("mismatches") == 0
        )
        before, after = set(rec["before"]["servers"]), set(rec["after"]["servers"])
        rec["server_survived"] = bool(before & after)
        rec["probe"] = probe(bystander_env)
        return rec
    finally:
        for w in (a, b):
            if w is not None:
                w.kill()
        save()


# ---------------------------------------------------------------------------------------------
# Tests, in order: the least destructive first (a plain SIGKILL may break the server)


def start_scheduler(tmp: Path, *args: str) -> Scheduler:
    sock = tmp / "gpushare.sock"
    log = tmp / "scheduler.log"
    with log.open("w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter_gpushare", "scheduler", "--socket", str(sock),
             "--pool", "24GiB", "--quantum", "2", "--log-level", "INFO", *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"scheduler did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return Scheduler(sock, log, proc)


def stop_scheduler(sched: Scheduler) -> None:
    sched.process.send_signal(signal.SIGTERM)
    try:
        sched.process.wait(20)
    except subprocess.TimeoutExpired:
        sched.process.kill()


def test_scheduler_mps_mode_end_to_end(binary: str) -> None:
    """`gpushare scheduler --mps`: its daemon, mps_env for a kernel, mps_terminate before a kill.
    Runs before the module's own daemon exists (one MPS setup on the GPU at a time)."""
    from jupyter_gpushare.scheduler_client import SchedulerClient

    rec: dict[str, Any] = {}
    RESULT["scheduler_mode"] = rec
    tmp = Path(tempfile.mkdtemp(prefix="gssch-", dir="/tmp"))
    # The GPU named explicitly: the scheduler need not depend on NVML discovery here.
    sched = start_scheduler(tmp, "--mps", f"--GPUShareScheduler.mps_devices={gpu_uuid()}")
    victim: Worker | None = None
    try:
        client = SchedulerClient(str(sched.socket), timeout=60)
        doc = sched.status()
        rec["status_mps"] = doc.get("mps")
        assert doc.get("mps") and doc["mps"]["daemons"], doc
        reply = asyncio.run(
            client.control("mps_env", client="e2e", weight=1.0, quota=4 << 30, compute_share=SHARE)
        )
        rec["mps_env"] = reply
        assert reply["enabled"] and reply["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
        env = as_client(workload_env(), reply)
        # The hard limit: 1 GiB fits under 4 GiB, 6 GiB must not (plain device memory).
        rec["alloc"] = allocations(env, "1", "6")
        victim = Worker("spin", "30", str(VICTIM_GIB), env=env)
        rec["victim_launch"] = victim.wait("launched", 120)
        assert rec["victim_launch"] is not None, victim.stderr_tail()
        time.sleep(1.0)
        t0 = time.monotonic()
        reply = asyncio.run(client.control("mps_terminate", pid=victim.pid))
        rec["mps_terminate"] = reply
        rec["mps_terminate_seconds"] = round(time.monotonic() - t0, 3)
        victim.popen.send_signal(signal.SIGKILL)
        rec["victim_rc"] = victim.finish(60)
        save()
        assert reply["ok"] and [r["client"] for r in reply["terminated"]] == [victim.pid], reply
        assert rec["alloc"] and rec["alloc"]["results"][0]["ok"], rec["alloc"]
        rec["pinned_limit_enforced"] = not rec["alloc"]["results"][1]["ok"]
    finally:
        if victim is not None:
            victim.kill()
        stop_scheduler(sched)
        rec["scheduler_log"] = sched.log_text().splitlines()[-40:]
        rec["scheduler_rc"] = sched.process.returncode
        save()
        shutil.rmtree(tmp, ignore_errors=True)
    # The scheduler quit its daemon when it stopped.
    assert "MPS control daemon for" in "\n".join(rec["scheduler_log"])


def test_terminate_client_then_sigkill(manager: MPSManager) -> None:
    env = mps_env(manager, compute_share=SHARE)
    rec = kill_scenario(manager, "terminate_then_sigkill", "terminate_then_sigkill", env, env, 30)
    print(json.dumps(rec, indent=1, default=str))
    assert rec["victim_was_client"] and rec["bystander_was_client"], rec["before"]
    assert rec["terminate"] and all(r["ok"] for r in rec["terminate"]), rec["terminate"]
    assert rec["bystander_correct"], rec["bystander"]
    assert rec["server_survived"], (rec["before"], rec["after"])
    assert rec["probe"]["ok"], rec["probe"]


def test_sigterm_under_the_shim_synchronises(manager: MPSManager, scheduler: Scheduler) -> None:
    """A and B under the shim (managed memory, gated by the scheduler) as MPS clients: SIGTERM
    mid-kernel; the shim waits for the kernel (3 s, ended within its 5 s bound) before the
    process ends."""
    env = as_client(
        shimmed_env(scheduler.socket, {"GPUSHARE_LOG": "info"}),
        manager.client_env(compute_share=SHARE),
    )
    # The victim logs at debug: "said goodbye to the scheduler" shows its quit path ran.
    victim_env = {**env, "GPUSHARE_LOG": "debug"}
    rec = kill_scenario(
        manager, "sigterm_under_shim", "sigterm_under_shim", victim_env, env, 3.0, kill_after=1.0
    )
    print(json.dumps(rec, indent=1, default=str))
    assert rec["victim_was_client"] and rec["bystander_was_client"], rec["before"]
    assert rec["victim"]["rc"] == -signal.SIGTERM, rec["victim"]
    # Killed 1 s into a 3 s kernel: the process ended only once its kernel had finished.
    assert rec["victim"]["exit_after_kill_s"] >= 1.5, rec["victim"]
    assert rec["bystander_correct"], rec["bystander"]
    assert rec["server_survived"] and rec["probe"]["ok"], rec


def test_pinned_memory_limit(manager: MPSManager, scheduler: Scheduler) -> None:
    """What CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (2 GiB) does to device memory and to the shim's
    managed memory. Recorded, asserted only for device memory."""
    rec: dict[str, Any] = {}
    RESULT["pinned_limit"] = rec
    client = manager.client_env(quota_bytes=2 << 30)
    rec["device_memory"] = allocations(as_client(workload_env(), client), "1", "3")
    rec["managed_memory_under_shim"] = allocations(
        as_client(shimmed_env(scheduler.socket), client), "1", "3"
    )
    save()
    print(json.dumps(rec, indent=1, default=str))
    assert rec["device_memory"] is not None, "the allocation probe did not finish"
    results = rec["device_memory"]["results"]
    assert results[0]["ok"] and not results[1]["ok"], results


def test_plain_sigkill_without_terminate(manager: MPSManager) -> None:
    """The unsafe way, last: recorded, not asserted (the MPS documentation leaves the outcome
    undefined; this says what it was on this machine)."""
    env = mps_env(manager, compute_share=SHARE)
    rec = kill_scenario(manager, "plain_sigkill", "sigkill", env, env, 30)
    print(json.dumps(rec, indent=1, default=str))
    assert rec["victim_was_client"] and rec["bystander_was_client"], rec["before"]
