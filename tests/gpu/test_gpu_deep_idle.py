"""Deep idle on a real GPU (docs/architecture.md, "Deep idle"): an idle PyTorch process gives
back everything, its CUDA context included, through the driver's process checkpoint API; its next
GPU call wakes it with its data intact.

Targets (issue "Engine v2", item 4): a sleeping kernel holds 0 bytes on the GPU, and its next cell
starts within 1.5 s plus its data at restore speed; many kernels asleep cost the card under 1 GiB
in all. The scheduler runs as the same user as the kernels (the driver checks as ptrace does).
Needs a driver with cuCheckpointProcess* (CUDA 12.8+, r570+); the suite fails, not skips, without
it: the test exists to check it.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from conftest import (
    WORKLOADS,
    Scheduler,
    card_used_mib,
    ms_of,
    process_mib,
    require,
    running_scheduler,
    shimmed_env,
)

from jupyter_gpushare.protocol import Message, MsgType, read_message_sync, write_message_sync

GIB = 1 << 30
DEEP_IDLE_S = 3.0
# What kernels asleep cost the card over its baseline: 0-4 MiB recorded (docs/gpu-verification.md,
# runs 4, 5 and 8, for 1 to 32 kernels); 3x that.
ASLEEP_MIB = 12
ARGS = ("--deep-idle", str(DEEP_IDLE_S))


class Kernel:
    """A sleepy_tensor.py (or sleepy_cells.py) process under the shim, its stderr in a file."""

    def __init__(
        self,
        sched: Scheduler,
        tmp: Path,
        name: str,
        gib: float,
        script: str = "sleepy_tensor.py",
        log: str = "",
    ) -> None:
        self.name = name
        self.err = tmp / f"{name}.err"
        extra = {"GPUSHARE_CLIENT_ID": name, "GPUSHARE_IDLE_SECONDS": "0.5"}
        if log:  # the shim's own log level (its stderr is kept in self.err)
            extra["GPUSHARE_LOG"] = log
        env = shimmed_env(sched.socket, extra)
        with self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKLOADS / script), str(gib)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )
        self.ready: dict[str, Any] = {}

    def wait_ready(self) -> Kernel:
        self.ready = self._line()
        assert self.ready["event"] == "ready", self.ready
        return self

    def _line(self, timeout: float = 120.0) -> dict[str, Any]:
        """The workload's next JSON line; a workload silent for ``timeout`` s is killed: a
        first call that hangs after a sleep must fail the test, not hang the campaign."""
        assert self.proc.stdout is not None
        pool = ThreadPoolExecutor(1)
        try:
            line = pool.submit(self.proc.stdout.readline).result(timeout)
        except FutureTimeout:
            self.kill()
            raise AssertionError(
                f"{self.name}: no line in {timeout:.0f} s (a CUDA call that the shim does not "
                f"gate blocks in the locked driver before any REQUEST?)\n{self.err.read_text()}"
            ) from None
        finally:
            pool.shutdown(wait=False)
        assert line.startswith("{"), f"{self.name}: {line!r}\n{self.err.read_text()}"
        return json.loads(line)

    def go(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        done = self._line()
        assert self.proc.wait(60) == 0, self.err.read_text()
        return done

    def cell(self, alloc_gib: float, block_gib: float, fill: int) -> dict[str, Any]:
        """One cell of sleepy_cells.py: allocate ``alloc_gib`` GiB in tensors of ``block_gib``,
        check them and the held data."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{alloc_gib} {block_gib} {fill} 0\n")
        self.proc.stdin.flush()
        done = self._line()
        assert done["event"] == "done", done
        return done

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def wait_log(sched: Scheduler, pattern: str, count: int = 1, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = sched.log_text()
        if len(re.findall(pattern, log)) >= count:
            return log
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} x{count} not in the log in {timeout}s:\n{sched.log_text()}")


def notebook_busy(sched: Scheduler, client: str, state: str = "busy") -> None:
    """What the Jupyter extension says when the kernel starts a cell (kernel_state busy) or ends
    one (idle). Only kernels Jupyter reports are put to sleep (docs/architecture.md)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(sched.socket))
        body = {"action": "kernel_state", "client": client, "state": state}
        write_message_sync(s, Message(MsgType.CONTROL, {"body": body}))
        reply = read_message_sync(s)
    assert reply is not None and reply.type == MsgType.CONTROL_REPLY, reply


def host_available_gib() -> float:
    """MemAvailable of /proc/meminfo, in GiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / (1 << 20)
    raise AssertionError("no MemAvailable in /proc/meminfo")


def test_a_sleeping_torch_kernel_holds_nothing_and_wakes_with_its_data(tmp_path: Path) -> None:
    require("torch")
    baseline = card_used_mib()
    with running_scheduler(tmp_path, pool="24GiB", args=ARGS) as sched:
        k = Kernel(sched, tmp_path, "sleepy", 1.0).wait_ready()
        notebook_busy(sched, "sleepy")  # a notebook kernel whose cell has ended
        notebook_busy(sched, "sleepy", "idle")
        try:
            listed = process_mib(k.ready["pid"])  # None: nvidia-smi cannot see our pids
            awake = card_used_mib() - baseline
            assert awake >= 1024 and (listed is None or listed >= 1024), (awake, listed)
            log = wait_log(sched, r"asleep client=sleepy ", timeout=60)
            assert "deep idle is off" not in log, log
            time.sleep(0.5)  # nvidia-smi's view follows the driver's
            held = process_mib(k.ready["pid"])
            asleep = card_used_mib() - baseline
            print(
                f"asleep: the process holds {held} MiB (nvidia-smi; None: not listed), the card "
                f"{asleep} MiB over its baseline (awake: {awake} MiB)"
            )
            assert not held, f"an asleep process holds {held} MiB"
            assert asleep <= ASLEEP_MIB, f"the card still holds {asleep} MiB for an asleep process"
            doc = sched.status()
            (client,) = [c for d in doc["devices"] for c in d["clients"] if c["id"] == "sleepy"]
            assert client["state"] == "asleep", client
            # Its next cell: Jupyter's busy comes first and wakes it, then the cell's first call.
            notebook_busy(sched, "sleepy")
            done = k.go()
        finally:
            k.kill()
        log = sched.log_text()
        assert done["correct"], done
        woke_s = ms_of(log, "woke", "sleepy") / 1000
        restored_s = ms_of(log, "restored", "sleepy") / 1000
        print(
            f"first call after sleep {done['first_call_s']:.3f} s (driver restore + unlock "
            f"{woke_s:.3f} s, memory restore {restored_s:.3f} s)"
        )
        # The target was 1.5 s more than the restores; recorded: 0.28-0.37 s for restores
        # of 0.27-0.34 s (H100, runs 5 and 7). Bound: 3x this run's own restores.
        assert done["first_call_s"] <= 3 * (woke_s + restored_s), (done, woke_s, restored_s)


def test_eight_sleeping_kernels_cost_the_card_under_one_gib(tmp_path: Path) -> None:
    """The issue's 32-kernel scenario, smaller: 8 PyTorch kernels of 1 GiB each, all asleep,
    together cost the card under 1 GiB (awake, their contexts alone take ~4 GiB); each wakes in
    turn with its data, as in Jupyter: its notebook turns busy, then its cell runs."""
    require("torch")
    baseline = card_used_mib()
    # Long enough that all eight are up and measured awake before the first one sleeps.
    args = ("--deep-idle", "20")
    with running_scheduler(tmp_path, pool="24GiB", args=args) as sched:
        kernels: list[Kernel] = []
        try:
            kernels = [Kernel(sched, tmp_path, f"k{i}", 1.0) for i in range(8)]
            for k in kernels:
                k.wait_ready()
                notebook_busy(sched, k.name)
                notebook_busy(sched, k.name, "idle")
            awake = card_used_mib() - baseline
            assert "asleep client=" not in sched.log_text(), "measured too late: one sleeps"
            wait_log(sched, r"asleep client=k\d ", count=8, timeout=90)
            time.sleep(0.5)
            asleep = card_used_mib() - baseline
            print(f"8 kernels: {awake} MiB awake, {asleep} MiB asleep (card, over its baseline)")
            assert awake >= 8 * 1024, awake
            assert asleep <= ASLEEP_MIB, asleep
            for k in kernels:
                notebook_busy(sched, k.name)
                done = k.go()
                assert done["correct"], (k.name, done)
                print(f"{k.name}: first call after sleep {done['first_call_s']:.3f} s")
        finally:
            for k in kernels:
                k.kill()


def test_thirty_two_sleeping_kernels_each_run_a_60_gib_cell_in_turn(tmp_path: Path) -> None:
    """Issue 11's target: 32 PyTorch kernels holding 1 GiB each, all asleep, cost the card under
    1 GiB (awake, 32 contexts alone take ~16 GiB); then each in turn runs a cell that allocates
    60 GiB of a 70 GiB pool, and none fails; each goes idle and back to sleep after its cell.

    The cells allocate their 60 GiB as 1 GiB tensors, as a model's weights and activations are
    many tensors: the shim prepares host staging for each new block in the background, so one
    60 GiB tensor would have it populate and register 60 GiB of host memory per cell while the
    next cell does the same (test_gpu_memory_engine.py checks what becomes of a block's staging
    when the block is freed first). The host's available memory is checked before each cell, so
    a leak fails the test before it exhausts the machine."""
    require("torch")
    count = 32
    baseline = card_used_mib()
    started = time.monotonic()
    # Short: the kernels are measured awake before Jupyter's first idle, which starts the clock.
    with running_scheduler(tmp_path, pool="70GiB", args=("--deep-idle", "3")) as sched:
        kernels: list[Kernel] = []
        try:
            kernels = [
                Kernel(sched, tmp_path, f"n{i}", 1.0, script="sleepy_cells.py", log="info")
                for i in range(count)
            ]
            for k in kernels:
                k.wait_ready()
            up_s = time.monotonic() - started
            awake = card_used_mib() - baseline
            for k in kernels:
                notebook_busy(sched, k.name)  # a notebook kernel whose cell has ended
                notebook_busy(sched, k.name, "idle")
            slept_from = time.monotonic()
            wait_log(sched, r"asleep client=n\d+ ", count=count, timeout=180)
            sleep_s = time.monotonic() - slept_from
            time.sleep(0.5)  # nvidia-smi's view follows the driver's
            asleep = card_used_mib() - baseline
            print(
                f"{count} kernels of 1 GiB: up in {up_s:.1f} s, {awake} MiB awake, all asleep "
                f"{sleep_s:.1f} s after their idle, then {asleep} MiB (card, over its baseline)"
            )
            assert awake >= count * 1024, awake
            assert asleep <= ASLEEP_MIB, asleep
            cells: list[tuple[str, float, float, float, float]] = []
            host_gib: list[float] = []
            for i, k in enumerate(kernels):
                host_gib.append(host_available_gib())
                assert host_gib[-1] >= 16, f"{host_gib[-1]:.1f} GiB of host memory left: {host_gib}"
                t0 = time.monotonic()
                notebook_busy(sched, k.name)  # Jupyter's busy wakes it, then its cell runs
                done = k.cell(60, 1, i + 1)
                seen_s = time.monotonic() - t0
                notebook_busy(sched, k.name, "idle")
                assert done["correct"], (
                    f"{k.name}: {json.dumps(done)}\n{k.name}'s shim log, its end:\n"
                    + "\n".join(k.err.read_text(errors="replace").splitlines()[-80:])
                )
                assert done["used_during_cell"] >= 60 * GIB, (k.name, done)
                log = sched.log_text()
                woke_s = ms_of(log, "woke", k.name) / 1000
                restored_s = ms_of(log, "restored", k.name) / 1000
                # As for one kernel above (recorded: first calls 0.34-0.54 s, wakes 0.32-0.52 s).
                bound = 3 * (woke_s + restored_s)
                assert done["first_call_s"] <= bound, (k.name, done, woke_s, restored_s)
                cells.append((k.name, woke_s, done["first_call_s"], done["cell_s"], seen_s))
                print(
                    f"{k.name}: wake {woke_s:.3f} s, first call {done['first_call_s']:.3f} s, "
                    f"60 GiB cell {done['cell_s']:.3f} s, busy to done {seen_s:.3f} s; host "
                    f"staging beyond its memory at the end {done['staging_left'] / GIB:.2f} GiB, "
                    f"host memory available before {host_gib[-1]:.1f} GiB"
                )
            wait_log(sched, r"asleep client=n\d+ ", count=2 * count, timeout=120)
            time.sleep(0.5)
            again = card_used_mib() - baseline
            worst = max(cells, key=lambda c: c[4])
            # What the shim's check of each copy into host staging caught and mended (memory/
            # verify.c): reported for the record, since the data above is right either way.
            mended = {
                k.name: n
                for k in kernels
                if (n := k.err.read_text(errors="replace").count("came back wrong"))
            }
            print(f"copies into host staging found wrong and copied again: {mended or 'none'}")
            print(
                f"all {count} cells correct; wakes {min(c[1] for c in cells):.3f}-"
                f"{max(c[1] for c in cells):.3f} s, first calls {min(c[2] for c in cells):.3f}-"
                f"{max(c[2] for c in cells):.3f} s, cells {min(c[3] for c in cells):.3f}-"
                f"{max(c[3] for c in cells):.3f} s (slowest busy to done: {worst[0]} "
                f"{worst[4]:.3f} s); asleep again: {again} MiB; host memory available "
                f"{min(host_gib):.1f}-{max(host_gib):.1f} GiB before the cells; "
                f"{time.monotonic() - started:.0f} s in all"
            )
            assert again <= ASLEEP_MIB, again
        finally:
            for k in kernels:
                k.kill()
