"""Cold eviction (issue 21 item 1): an eviction soon after a large allocation, before or while the
block's host staging is made. NEEDS A GPU (PyTorch and a CUDA device; about 2x ``--size`` of GPU
memory and 2x of host memory).

For each delay D (default 0.5 s, 2 s, 5 s): a scheduler whose pool holds one working set but not
two (``--pool``, default 32 GiB); process A's cell allocates ``--size`` (default 20 GiB) with
PyTorch under the shim and fills it, its cell ends at once (idle); D seconds after A's allocation
returned, process B's cell starts and allocates the same. A must be evicted for B to run. The
scheduler's pre-copy of idle kernels is off (``precopy_idle = False``), so A's eviction is a copy,
never an unmap that would not measure the bus (issue 24: an unmap is not a bandwidth).

Reported per delay: the eviction's bytes and seconds as the shim measured them (the scheduler's
log), its GB/s, and the handoff: from B's cell start to B's allocation done and filled (which
includes A's eviction and B's own allocation), and B's own allocation alone (``own_alloc_s``:
the same cell in a process with the pool to itself, after the handoff, so that its host staging
does not warm the host for A's cold eviction). Targets (docs/performance.md): >= 20 GB/s at
0.5 s, >= 40 GB/s from 2 s; a handoff <= 1 s at every delay.

    python -m bench.cold_eviction --out results/cold_eviction.json [--size 20GiB] [--pool 32GiB]
        [--delays 0.5,2,5] [--repeats 3] [--env GPUSHARE_STAGING_THREADS=8 ...]

``--env`` passes shim settings to both processes (e.g. GPUSHARE_BOUNCE_BYTES=0 to measure the
path without the ring, GPUSHARE_STAGING_QUIET=0.5 for the old pause).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from jupyter_gpushare.units import parse_size

from .common import GiB, memory_moves, record, shim_env, wait_for, write_json
from .common import scheduler as start_scheduler
from .procs import WorkerProc


def own_allocation(sched: Any, size: int, env: dict[str, str]) -> float:
    """Seconds for B's part of the handoff alone: a process whose context exists starts a cell
    and allocates and fills ``size`` with the pool empty (A and B gone), nothing to evict. Made
    after the handoff, so that its host staging cannot warm the host for A's cold eviction."""
    wait_for(
        lambda: all(f"leave client={c} " in sched.log_text() for c in ("A", "B")),
        30,
        "A and B to leave the scheduler",
        interval=0.05,
    )
    solo = WorkerProc(shim_env(sched.socket, "solo", GPUSHARE_IDLE_SECONDS="0", **env), "solo")
    try:
        solo.read(120)
        solo.call("init")
        sched.control("kernel_state", client="solo", state="busy")
        t0 = time.monotonic()
        ans = solo.call("alloc", bytes=size)
        if not ans.get("ok", True):
            raise RuntimeError(f"solo: allocation failed: {ans.get('error')}")
        return time.monotonic() - t0
    finally:
        solo.close()


def one(workdir: Path, size: int, pool: int, delay: float, env: dict[str, str]) -> dict[str, Any]:
    args = ("--pool", str(pool), "--keep-free", "0", "--GPUShareScheduler.precopy_idle=False")
    with start_scheduler(workdir, *args) as sched:
        a = WorkerProc(shim_env(sched.socket, "A", GPUSHARE_IDLE_SECONDS="0", **env), "A")
        b = WorkerProc(shim_env(sched.socket, "B", GPUSHARE_IDLE_SECONDS="0", **env), "B")
        try:
            a.read(120)
            b.read(120)
            b.call("init")  # B's context exists before its cell: the handoff is the memory's
            sched.control("kernel_state", client="B", state="idle")
            sched.control("kernel_state", client="A", state="busy")
            a.call("alloc", bytes=size)
            allocated = time.monotonic()
            sched.control("kernel_state", client="A", state="idle")
            time.sleep(max(0.0, allocated + delay - time.monotonic()))
            before = len(memory_moves(sched.log_text()))
            t0 = time.monotonic()
            sched.control("kernel_state", client="B", state="busy")
            ans = b.call("alloc", bytes=size)
            if not ans.get("ok", True):
                raise RuntimeError(f"B: allocation failed: {ans.get('error')}")
            handoff = time.monotonic() - t0
            wait_for(
                lambda: any(
                    m["client"] == "A" and m["kind"] == "evict"
                    for m in memory_moves(sched.log_text())[before:]
                ),
                30,
                "A's eviction in the scheduler's log",
                interval=0.05,
            )
        finally:
            a.close()
            b.close()
        moves = memory_moves(sched.log_text())[before:]
        own = own_allocation(sched, size, env)
    ev = next(m for m in moves if m["client"] == "A" and m["kind"] == "evict")
    gbps = ev["bytes"] / ev["seconds"] / 1e9 if ev["seconds"] > 0 else 0.0
    return {
        "delay_s": delay,
        "evicted_bytes": ev["bytes"],
        "evict_s": ev["seconds"],
        "evict_gbps": gbps,
        "handoff_s": handoff,
        "own_alloc_s": own,
        "handoff_less_own_s": handoff - own,
        "started_after_alloc_s": t0 - allocated,
        "moves": moves,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--size", default="20GiB")
    p.add_argument("--pool", default="32GiB")
    p.add_argument("--delays", default="0.5,2,5")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for both shims")
    p.add_argument("--workdir", type=Path, default=Path("bench-work/cold_eviction"))
    ns = p.parse_args(argv)
    size, pool = parse_size(ns.size), parse_size(ns.pool)
    env = dict(kv.split("=", 1) for kv in ns.env)
    runs: list[dict[str, Any]] = []
    for delay in (float(d) for d in ns.delays.split(",")):
        for _ in range(ns.repeats):
            r = one(ns.workdir, size, pool, delay, env)
            runs.append(r)
            print(
                f"cold eviction {size / GiB:g} GiB at {delay:g} s: {r['evict_gbps']:.1f} GB/s "
                f"({r['evict_s'] * 1e3:.0f} ms), handoff {r['handoff_s'] * 1e3:.0f} ms "
                f"(B's own allocation alone {r['own_alloc_s'] * 1e3:.0f} ms)",
                file=sys.stderr,
            )
    write_json(
        ns.out,
        record("cold_eviction", None, size=size, pool=pool, env=env, runs=runs),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
