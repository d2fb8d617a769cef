"""The explicit memory engine on a real GPU (docs/architecture.md, "Memory"): evictions and
restores at the bus's speed with the data intact, pre-copy, and CUDA IPC between shimmed
processes (torch.multiprocessing, CuPy).

Bounds carry their margin: the targets (issue "Engine v2") are eviction >= 40 GB/s and restore
>= 45 GB/s on an H100 (PCIe Gen5, pinned copies 54-55 GB/s); these tests fail below 30 and 35
GB/s, the benchmark (bench/handoff.py) records the exact figures.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time

from conftest import (
    WORKLOADS,
    Result,
    Scheduler,
    require,
    run_workload,
    running_scheduler,
    shimmed_env,
    start_workload,
    workload_env,
)

GIB = 1 << 30
MOVE = re.compile(r"(evicted|restored) client=(\S+) bytes=(\d+) \([^)]*\) ms=([\d.]+)")


def b_arrives_and_a_survives(scheduler: Scheduler, a: subprocess.Popen, what: str) -> None:
    """B (14 GiB for 2 s) runs to a correct end; then A, whose memory made B's room, ends with
    its data intact."""
    b_env = shimmed_env(scheduler.socket, {"GPUSHARE_CLIENT_ID": "B"})
    b = run_workload("memory_hog.py", "14", "2", "B", env=b_env)
    assert b.returncode == 0 and b.record["correct"], b.stderr
    out_a, err_a = a.communicate(timeout=120)
    assert a.returncode == 0, err_a
    assert Result(0, out_a, err_a).record["correct"], f"A's data did not survive {what}"


def rates(log: str, kind: str, at_least: int = 8 * GIB) -> list[float]:
    return [
        int(n) / (float(ms) / 1000)
        for k, _c, n, ms in MOVE.findall(log)
        if k == kind and int(n) >= at_least and float(ms) > 0
    ]


def test_busy_kernels_move_at_the_bus_speed_and_keep_their_data(scheduler: Scheduler) -> None:
    """14 + 14 GiB on a 24 GiB pool, both computing: every quantum's end evicts one of them (a
    busy kernel: no pre-copy helps) and restores the other. memory_hog checks every element."""
    require("torch")
    a = start_workload("memory_hog.py", "14", "20", "A", env=shimmed_env(scheduler.socket))
    time.sleep(4)
    b = start_workload("memory_hog.py", "14", "20", "B", env=shimmed_env(scheduler.socket))
    out_a, err_a = a.communicate(timeout=300)
    out_b, err_b = b.communicate(timeout=300)
    assert a.returncode == 0, err_a
    assert b.returncode == 0, err_b
    for out, err in ((out_a, err_a), (out_b, err_b)):
        rec = Result(0, out, err).record
        assert rec["correct"], rec
        # Explicit memory: counted as evictable, none of it managed by the driver.
        assert rec["shim"]["managed_bytes"] >= 14 * GIB, rec["shim"]
    log = scheduler.log_text()
    evict, restore = rates(log, "evicted"), rates(log, "restored")
    assert evict and restore, log
    print(
        f"eviction {statistics.median(evict) / 1e9:.1f} GB/s (n={len(evict)}, "
        f"min {min(evict) / 1e9:.1f}), restore {statistics.median(restore) / 1e9:.1f} GB/s "
        f"(n={len(restore)})"
    )
    assert statistics.median(evict) >= 30e9, evict
    assert statistics.median(restore) >= 35e9, restore


def test_torch_multiprocessing_ipc(scheduler: Scheduler) -> None:
    """Sharing CUDA tensors between shimmed processes works with explicit memory (the shim's own
    IPC handle, memory/ipc.c): the child sees the parent's values, the parent sees the child's
    write, and the shared memory is pinned while the child maps it, evictable after. Under
    GPUSHARE_MEMORY=device the driver's own IPC is used, and works too."""
    require("torch")
    t0 = time.monotonic()
    explicit = run_workload("torch_ipc.py", env=shimmed_env(scheduler.socket), timeout=120)
    assert explicit.returncode == 0, explicit.stderr
    rec = explicit.record
    print(
        f"torch IPC shared in {rec.get('shared_seconds')} s, {time.monotonic() - t0:.1f} s in all"
    )
    assert rec["ok"], rec
    assert "gpushare: cuIpc" not in explicit.stderr, explicit.stderr
    assert rec["pinned_while_imported"] > rec["pinned_after_importer_left"], rec
    device = run_workload(
        "torch_ipc.py",
        env=shimmed_env(scheduler.socket, {"GPUSHARE_MEMORY": "device"}),
        timeout=120,
    )
    assert device.returncode == 0, device.stderr
    assert device.record["ok"], device.record


def test_cupy_ipc(scheduler: Scheduler) -> None:
    """CuPy's own IPC calls (cudaIpcGetMemHandle / OpenMemHandle / CloseMemHandle) on explicit
    memory between two shimmed processes: values seen and written both ways."""
    require("cupy")
    run = run_workload("cupy_ipc.py", env=shimmed_env(scheduler.socket), timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.record["ok"], run.record


def test_an_idle_kernel_is_precopied_and_leaves_in_milliseconds(scheduler: Scheduler) -> None:
    """A computes 2 s then idles 40 s (its shim says IDLE after 1 s): the scheduler asks for a
    pre-copy; when B arrives and needs the room, A's eviction is an unmap, and A's data is
    intact when it computes again."""
    require("torch")
    env = shimmed_env(scheduler.socket, {"GPUSHARE_IDLE_SECONDS": "1", "GPUSHARE_CLIENT_ID": "A"})
    a = start_workload("memory_hog.py", "14", "2", "A", "40", env=env)
    deadline = time.monotonic() + 120

    def precopied() -> int:
        clients = [c for d in scheduler.status()["devices"] for c in d["clients"]]
        return max((c.get("precopied_bytes", 0) for c in clients if c["id"] == "A"), default=0)

    while precopied() < 13 * GIB:  # the shim reports the background copy's progress in MEMORY
        assert time.monotonic() < deadline, scheduler.log_text()
        assert a.poll() is None or a.returncode == 0
        time.sleep(0.5)
    b_arrives_and_a_survives(scheduler, a, "pre-copy + eviction")
    log = scheduler.log_text()
    ms = [float(m) for k, c, n, m in MOVE.findall(log) if k == "evicted" and c == "A"]
    assert ms, log
    print(f"A evicted in {ms[0]:.1f} ms after its pre-copy")
    # No copy happened, only the driver's unmap and release of 14 GiB: 10.0 ms on an H100 (run 7,
    # docs/gpu-verification.md; 205-312 ms before, when the unmap waited behind host staging
    # being made). A copy at the bus's speed would take 278 ms (55 GB/s). Bound: 3x the record.
    assert ms[0] < 30, ms


def test_a_block_freed_while_its_staging_is_made_leaves_no_host_memory(
    scheduler: Scheduler,
) -> None:
    """The shim prepares each new block's host staging in the background (memory/prepare.c). A
    cell that allocates 6 GiB and frees it at once (a temporary, then empty_cache) frees the block
    while its staging is still being populated: that staging must be released once made, or each
    such cell leaves 6 GiB of the host populated and registered for the life of the kernel (in
    issue 11's scenario, 60 GiB cells in 32 kernels exhaust the host)."""
    require("torch")
    run = subprocess.run(
        [sys.executable, str(WORKLOADS / "sleepy_cells.py"), "1"],
        # One cell: 6 GiB as one tensor, then up to 30 s for the staging. Its exact sum makes an
        # int64 copy (12 GiB): with the 1 GiB held and the context, 19.5 GiB of the 24 GiB pool
        # (8 GiB, on the H100, asked for 25.5 GiB and was refused).
        input="6 6 7 30\n",
        capture_output=True,
        text=True,
        env=shimmed_env(scheduler.socket),
        timeout=180,
    )
    assert run.returncode == 0, run.stderr
    done = Result(0, run.stdout, run.stderr).record
    assert done["event"] == "done" and done["correct"], done
    print(
        f"6 GiB cell {done['cell_s']:.3f} s; host staging beyond the process's memory "
        f"{done['staging_left'] / GIB:.2f} GiB after {done['staging_wait_s']:.1f} s"
    )
    assert done["staging_left"] == 0, f"{done['staging_left'] / GIB:.2f} GiB of staging leaked"


GRANT = re.compile(r"grant client=(\S+) restore=\d \S+ \([^)]*\) waited_ms=([\d.]+)")


def test_room_is_kept_for_the_next_arrival(tmp_path) -> None:
    """keep_free 12 GiB on a 24 GiB pool (docs/architecture.md, "Room for the next arrival"): A
    (14 GiB) computes 2 s then idles; once its pre-copy is complete the scheduler evicts it for
    room before anyone asks (an unmap). B (14 GiB) then arrives and is granted within the issue's
    100 ms of asking, with nothing to evict; A's data is intact when it computes again."""
    require("torch")
    with running_scheduler(tmp_path, args=("--keep-free", "12GiB")) as scheduler:
        env = shimmed_env(
            scheduler.socket, {"GPUSHARE_IDLE_SECONDS": "1", "GPUSHARE_CLIENT_ID": "A"}
        )
        a = start_workload("memory_hog.py", "14", "2", "A", "40", env=env)
        deadline = time.monotonic() + 120
        # An idle holder is revoked with eviction; one that released already is evicted.
        room = re.compile(r"(revoke client=A evict=1|evict client=A) .*room for the next arrival")
        while not room.search(scheduler.log_text()):
            assert time.monotonic() < deadline, scheduler.log_text()
            assert a.poll() is None or a.returncode == 0
            time.sleep(0.2)
        b_arrives_and_a_survives(scheduler, a, "its eviction for room")
        log = scheduler.log_text()
    waits = [float(ms) for client, ms in GRANT.findall(log) if client == "B"]
    assert waits, log
    evicted_a = [float(m) for k, c, n, m in MOVE.findall(log) if k == "evicted" and c == "A"]
    print(f"B granted {waits[0]:.1f} ms after it asked; A's room eviction took {evicted_a}")
    # The room was made before B existed: A's eviction is logged before B joins, and none after.
    joined_b = log.index("join client=B ")
    assert room.search(log[:joined_b]), log
    assert not room.search(log[joined_b:]), log
    # With nothing to evict, B's grant is a handoff without memory to move: 0.4 ms on an H100
    # (runs 5 and 7, 2026-11-24), 0.3 ms on an H200 (2026-11-27); room made in the wait instead:
    # 9.6 ms. Bound: 3x the slower record.
    assert waits[0] <= 3 * 0.4, log


def test_a_burst_of_allocations_is_not_slowed_by_host_staging(tmp_path) -> None:
    """40 cudaMallocs of 1 GiB in a burst, then their exact sum and their free. Each new block's
    host staging is made in the background (memory/prepare.c), after the program's allocations
    pause: made beside the burst, it held the memory-map lock the program's own mappings need,
    and on an H100 (2026-11-24) the burst took 25.4 s under the shim against 0.015 s without.
    After the fix (run 7): alloc 0.014 / 0.018 s, sum 0.085 / 0.114 s, free 0.015 / 0.015 s
    (shim / plain); unshimmed runs spread by 20% (run 6: 0.015, 0.094, 0.015). Bound per part:
    1.5x the unshimmed time plus 30 ms (for a 15 ms part, 3-4x what was measured; the
    regression was a thousand times that).

    The pause is 0.5 s here (GPUSHARE_STAGING_QUIET; 0.1 s by default): the sum takes 0.085-0.092
    s, so with the default the free came 0.1 s after the last allocation, at the moment staging
    started, or just before it. On an H100 (2026-11-28) a free that met staging's start took
    0.090 s against 0.015 s: it waits for the driver behind the first block's registration. This
    test is about the program's own calls inside the pause, so the pause is made to outlast
    them (docs/gpu-verification.md, 2026-11-28 (c), records the free that met staging)."""
    require("torch")
    with running_scheduler(tmp_path, pool="70GiB") as sched:
        plain = run_workload("alloc_burst.py", "40", env=workload_env())
        assert plain.returncode == 0, plain.stderr
        shared = run_workload(
            "alloc_burst.py",
            "40",
            env=shimmed_env(sched.socket, {"GPUSHARE_STAGING_QUIET": "0.5"}),
        )
        assert shared.returncode == 0, shared.stderr
    a, b = plain.record, shared.record
    assert a["correct"] and b["correct"], (a, b)
    assert b["shim"] is not None and b["shim"]["connected"] == 1, b["shim"]
    parts = ", ".join(f"{p[:-2]} {a[p]:.3f} / {b[p]:.3f} s" for p in ("alloc_s", "sum_s", "free_s"))
    print(f"40 x 1 GiB (plain / shim): {parts}")
    for part in ("alloc_s", "sum_s", "free_s"):
        assert b[part] <= 1.5 * a[part] + 0.03, (part, a[part], b[part])
