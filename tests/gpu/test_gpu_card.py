"""The real card and the real host (issue 34): the default pool (the whole card), notebooks of
60-80 GiB, more device memory than the host can stage.

Every other GPU test makes memory pressure with a pool below the card; these use the scheduler's
default pool (the card less ``pool_reserve``). Each test watches the host's MemAvailable and fails
if a workload dies by a signal (the kernel's OOM killer sends SIGKILL). Each prints one
``CARD-RESULT`` JSON line (and appends it to ``$OUT/card-results.jsonl`` when OUT is set): the
figures docs/gpu-verification.md and docs/performance.md take, with the target each is held to.

Targets (issue 34, item 5), each as a ratio beside a plain run in the same test:
- an idle 80 GiB notebook and an 80 GiB newcomer: the newcomer's cell at most 2x its solo time
  plus the move at the bus's speed (cold: 80 GiB at 50 GB/s, about 1.7 s; pre-copied: 0.1 s);
- three 60 GiB processes busy twice: all finish with exact data, nothing killed, the host's
  memory never exhausted;
- eight 4 GiB sleepers woken at once: all run within 3 s.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import WORKLOADS, Scheduler, require, running_scheduler, shimmed_env

GIB = 1 << 30
BUS_BPS = 50e9  # a D2H copy into registered host memory, H100/H200 (docs/performance.md)


def record(name: str, **figures: Any) -> None:
    line = json.dumps({"test": name, **figures}, sort_keys=True)
    print(f"CARD-RESULT {line}")
    out = os.environ.get("OUT")
    if out:
        with (Path(out) / "card-results.jsonl").open("a") as f:
            f.write(line + "\n")


class HostWatch:
    """Samples /proc/meminfo's MemAvailable every 0.2 s while the test runs."""

    def __init__(self) -> None:
        self.lowest = float("inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def available() -> int:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.lowest = min(self.lowest, self.available())
            self._stop.wait(0.2)

    def __enter__(self) -> HostWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


class Tenant:
    """card_tenant.py under the shim, driven line by line."""

    def __init__(self, sched: Scheduler, tmp: Path, name: str, gib: int) -> None:
        self.name = name
        self.err = tmp / f"{name}.stderr"
        env = shimmed_env(sched.socket, {"GPUSHARE_CLIENT_ID": name, "GPUSHARE_LOG": "info"})
        with self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKLOADS / "card_tenant.py"), str(gib)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.started = self.wait("started")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def wait(self, event: str, timeout: float = 300.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{self.name}: no {event} in {timeout:.0f} s") from None
            if not line:
                raise AssertionError(
                    f"{self.name} ended ({self.proc.wait()}) before {event}:\n"
                    + self.err.read_text()
                )
            if line.startswith("{"):
                got = json.loads(line)
                if got.get("event") == event:
                    return got

    def do(self, command: str, event: str, timeout: float = 300.0) -> dict[str, Any]:
        self.send(command)
        return self.wait(event, timeout)

    def exit(self) -> int:
        if self.proc.poll() is None:
            self.send("exit")
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def status_of(sched: Scheduler, client: str) -> dict[str, Any]:
    doc = sched.status()
    return next((c for d in doc["devices"] for c in d["clients"] if c["id"] == client), {})


def wait_for(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen in {timeout:.0f} s: {what}")
        time.sleep(0.2)


def not_killed(*codes: int) -> None:
    killed = [c for c in codes if c == -signal.SIGKILL]
    assert not killed, f"a workload was SIGKILLed (the host's OOM killer?): {codes}"


@pytest.mark.parametrize("when", ["cold", "precopied"])
def test_an_idle_80_gib_notebook_and_an_80_gib_newcomer(tmp_path: Path, when: str) -> None:
    """Default pool. A holds 80 GiB and goes idle; B's cell allocates 80 GiB (together past the
    card). Before issue 34 B's cell failed at once with CUDA out of memory (H200, e5353ea)."""
    require("torch")
    with running_scheduler(tmp_path, pool="", quantum=5.0) as sched, HostWatch() as host:
        solo = Tenant(sched, tmp_path, "solo", 80)
        alone = solo.do("alloc", "allocated")["seconds"]
        assert solo.exit() == 0
        a = Tenant(sched, tmp_path, "A", 80)
        b: Tenant | None = None
        try:
            a.do("alloc", "allocated")
            # its cell ended (the shim's own idle window): an idle holder keeps its grant
            wait_for("A idle", lambda: status_of(sched, "A").get("idle") is True, 60)
            if when == "precopied":
                wait_for(
                    "A pre-copied",
                    lambda: status_of(sched, "A").get("precopied_bytes", 0) >= 79 * GIB,
                    240,
                )
            b = Tenant(sched, tmp_path, "B", 80)
            took = b.do("alloc", "allocated", 180)["seconds"]
            b_ok = b.do("check", "checked", 120)["correct"]
            # A's 80 GiB come back once B has left: while B's 80 GiB stay, the host (128 GiB,
            # a budget of ~100) cannot stage both notebooks at once, and A waits, saying so
            # (seen at 2bfe97e: A waited 180 s behind idle B). B's notebook ends first.
            b_code = b.exit()
            a_check = a.do("check", "checked", 180)
            codes = (b_code, a.exit())
        finally:
            a.kill()
            if b is not None:
                b.kill()
    not_killed(*codes)
    move = 0.1 if when == "precopied" else 80 * GIB / BUS_BPS
    target = 2 * alone + move
    record(
        f"idle80_newcomer80_{when}",
        solo_s=round(alone, 3),
        newcomer_s=round(took, 3),
        ratio=round(took / alone, 2),
        target_s=round(target, 3),
        met=took <= target,
        a_restore_first_call_s=round(a_check["first_call_s"], 3),
        host_lowest_available_gib=round(host.lowest / GIB, 1),
    )
    assert b_ok and a_check["correct"], (b_ok, a_check)
    assert codes == (0, 0), codes
    assert host.lowest > 0


def test_three_60_gib_processes_at_the_default_pool_all_finish(tmp_path: Path) -> None:
    """Three processes of 60 GiB (180 GiB: more than the card, and more than the one-GPU
    machine's 128 GiB of host memory could stage), each busy 4 s twice with a pause between.
    Before issue 34 each shim staged its whole memory on the host and the OOM killer took one."""
    require("torch")
    with running_scheduler(tmp_path, pool="", quantum=5.0) as sched, HostWatch() as host:
        tenants = [Tenant(sched, tmp_path, f"p{i}", 60) for i in range(3)]
        results: dict[str, Any] = {}
        try:

            def life(t: Tenant) -> None:
                t0 = time.monotonic()
                t.do("alloc", "allocated", 600)
                t.do("busy 4", "busy_done", 600)
                time.sleep(1.0)
                t.do("busy 4", "busy_done", 600)
                results[t.name] = (t.do("check", "checked", 600)["correct"], time.monotonic() - t0)

            threads = [threading.Thread(target=life, args=(t,)) for t in tenants]
            for th in threads:
                th.start()
            for th in threads:
                th.join(900)
            codes = tuple(t.exit() for t in tenants)
        finally:
            for t in tenants:
                t.kill()
        doc = sched.status()
    not_killed(*codes)
    record(
        "three_60gib",
        seconds={k: round(v[1], 1) for k, v in results.items()},
        correct={k: v[0] for k, v in results.items()},
        host_lowest_available_gib=round(host.lowest / GIB, 1),
        host=doc.get("host"),
    )
    assert codes == (0, 0, 0), codes
    assert all(ok for ok, _ in results.values()) and len(results) == 3, results


def test_eight_4_gib_sleepers_woken_at_once_all_run_within_3_s(tmp_path: Path) -> None:
    """Default pool: eight kernels of 4 GiB sleep deeply (context checkpointed), then all eight
    notebooks run a cell at once. On an H200 with a 40 GiB pool and a 30 GiB newcomer they ran at
    0.1, 3.1, 16.1 (x5) and 31.2 s (e5353ea): served one at a time."""
    require("torch")
    from test_gpu_deep_idle import Kernel, notebook_busy, wait_log

    with running_scheduler(tmp_path, pool="", args=("--deep-idle", "3")) as sched:
        kernels: list[Any] = []
        try:
            kernels = [Kernel(sched, tmp_path, f"k{i}", 4.0) for i in range(8)]
            for k in kernels:
                k.wait_ready()
                notebook_busy(sched, k.name)
                notebook_busy(sched, k.name, "idle")
            wait_log(sched, r"asleep client=k\d ", count=8, timeout=120)
            done: dict[str, Any] = {}
            t0 = time.monotonic()

            def wake(k: Any) -> None:
                notebook_busy(sched, k.name)
                # its cell's first GPU call ran first_call_s after the cell began (the wake, the
                # restore and the call); the check of its data comes after and is not counted
                begun = time.monotonic() - t0
                result = k.go()
                done[k.name] = (result, begun + result["first_call_s"])

            threads = [threading.Thread(target=wake, args=(k,)) for k in kernels]
            for th in threads:
                th.start()
            for th in threads:
                th.join(300)
        finally:
            for k in kernels:
                k.kill()
    ends = sorted(round(v[1], 2) for v in done.values())
    first_calls = sorted(round(v[0]["first_call_s"], 2) for v in done.values())
    record(
        "eight_sleepers_wake",
        first_call_at_s=ends,
        first_call_s=first_calls,
        target_s=3.0,
        met=bool(ends) and ends[-1] <= 3.0,
    )
    assert len(done) == 8 and all(v[0]["correct"] for v in done.values()), done
    assert ends[-1] <= 3.0, ends
