"""Interactive multi-user replay (benchmark 4): real processes, one GPU, a pool below the card.

Each user of a seeded trace (:mod:`bench.trace`) is a real PyTorch process
(``python -m bench.worker replay``) that holds its working set on the GPU and plays its cells:
think, then "busy" to the scheduler (what Jupyter's server extension says when a cell starts),
the cell's GPU burst (one pass over the working set and bf16 matmuls sized to the cell's GPU
time), "idle" when it ends. Before the clock starts every user has loaded its working set,
operands and libraries (a running notebook) and given the device back. Modes:

* ``gpushare``: under the shim, the default policy (interactive-first ordering), pool ``--pool``;
* ``gpushare-fair``: the same with ``c.GPUShareScheduler.ordering = "fair"`` (every kernel that
  fits co-runs: the ordering before interactive-first);
* ``colocate``: no shim; a plain process first occupies the card beyond the pool size
  (cudaMalloc, never managed memory), so the users share exactly the pool's room; a cell whose
  allocation does not fit fails (out of memory) and is counted;
* ``fixed-quantum``: under the shim, the scheduler's fixed-quantum lock (30 s quantum, idle
  check every 5 s);
* ``dedicated`` (one GPU per user, the ideal) is computed, not run: every cell takes its solo
  time, measured by calibration on the same GPU (seconds per matmul iteration, seconds per GiB
  of working-set pass), so its slowdown is 1 by construction and its GPU busy fraction is the
  trace's demand divided by the number of GPUs.

A cell's slowdown is its latency (cell start as the user pressed "run" to its last kernel's
end) divided by its solo time. The same traces run through the simulator
(:mod:`bench.simulator`) with the calibrated costs, to compare simulated and real, with the
references (equal sharing, ideal LAS, clairvoyant SRPT) on the same cells.

At real time (``run_campaign --only replay-real``) the trace is :func:`bench.trace.scaled` by
``TIME_SCALE``: think times of minutes, cells of seconds, every timer of every policy at its
real value; nothing is compressed.

A *warm start* (``run(..., warm=True)``; the nbmix replay, :mod:`bench.replay_nbmix`): the users
load their memory one at a time in the trace's order, each once the previous one's memory has
settled (no holder, no waiter, every resident client's memory pre-copied: what an idle pool
holds in steady state), and the clock starts after the last; the simulator plays the same
warm-up (:class:`bench.simulator.Simulation` with ``warm=True``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .common import GiB, MiB, child_env, memory_moves, shim_env
from .common import scheduler as start_scheduler
from .handoff import bandwidths
from .procs import WorkerProc
from .simulator import SimConfig, Simulation, capacity_sweep, summarize
from .trace import TIME_SCALE, TraceConfig, User, generate, scaled, to_json
from .worker import operand_bytes

MODES = ("gpushare", "gpushare-fair", "colocate", "fixed-quantum")
#: Simulated references shown beside the real modes, on the same trace.
SIM_REFERENCES = ("equal-share", "las", "srpt")
#: The agreement asked of simulator and real replay (relative, on p50 and p95 slowdown).
AGREEMENT = 0.15
#: Seconds between a notebook user's GPU bursts in real use (the replay compresses it).
REALISTIC_THINK = 4.0 * TIME_SCALE
#: A warm start waits at most this long for one user's memory to settle, and says so.
SETTLE_S = 15.0
#: Seconds between progress lines (and checkpoints) while a replay plays.
PROGRESS_S = 30.0
CAPACITY_USERS = [2, 4, 6, 8, 12, 16, 24, 32]


def calibrate(log: Any) -> dict[str, Any]:
    w = WorkerProc(child_env(), "calibrate")
    try:
        w.read(120)
        # A fresh process's context alone (the card otherwise empty): what a user's CUDA
        # context really takes, for co-location's ballast.
        w.call("init", timeout=120)
        first = w.call("meminfo")
        cal = w.call("calibrate", ws_bytes=4 * GiB, timeout=300)
        free = w.call("meminfo")
    finally:
        w.close()
    log(
        f"calibration: {cal['t_iter'] * 1e3:.3f} ms per matmul iteration, "
        f"{cal['touch_s_per_gib'] * 1e3:.3f} ms per GiB of working set; "
        f"{free['free'] / GiB:.1f} GiB free of {free['total'] / GiB:.1f}"
    )
    ctx = max(0, int(first["total"]) - int(first["free"]))
    log(f"calibration: a fresh CUDA context takes {ctx / MiB:.0f} MiB on the card")
    return {
        "t_iter": cal["t_iter"],
        "touch_s_per_gib": cal["touch_s_per_gib"],
        "context_bytes_real": ctx,
        # free beside one bare context (``free`` is read with the calibration's 4 GiB held)
        "free_fresh": int(first["free"]),
        **free,
    }


def _shim_context_bytes() -> int:
    """What the shim counts for a context (GPUSHARE_CONTEXT_BYTES: bytes or a size)."""
    from jupyter_gpushare.units import parse_size

    v = os.environ.get("GPUSHARE_CONTEXT_BYTES")
    try:
        return int(parse_size(v)) if v else 512 * MiB
    except ValueError:
        return 512 * MiB


class UtilizationSampler:
    """NVML's GPU utilisation, sampled every ``interval`` s on a thread (none without NVML).

    NVML counts a sample period busy when any kernel ran in it, so this is an upper bound of
    the GPU's busy time; the report's busy fraction (solo GPU time of completed cells over the
    run's length) is the work done. Both are recorded.
    """

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml: Any = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:
            self._nvml = None

    def start(self) -> None:
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            except Exception:
                return
            self.samples.append((time.monotonic(), int(util)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def mean(self, t0: float, t1: float) -> float | None:
        xs = [u for t, u in self.samples if t0 <= t <= t1]
        return sum(xs) / len(xs) / 100.0 if xs else None


def settled(status: dict[str, Any]) -> bool:
    """The pool at rest: nobody holds or waits, and every client's resident memory has a host
    copy (the scheduler pre-copies idle kernels), so that what it holds is what an idle pool
    holds in steady state."""
    for dev in status.get("devices", []):
        if dev.get("holders") or dev.get("queue"):
            return False
        for c in dev.get("clients", []):
            resident = int(c.get("managed_bytes", 0)) - int(c.get("evicted_bytes", 0))
            if resident > 0 and int(c.get("precopied_bytes", 0)) < resident:
                return False
    return True


def _warm_up(procs: dict[str, WorkerProc], sched: Any, log: Any) -> dict[str, Any]:
    """Load the users one at a time (the trace's order), each after the last has settled."""
    waits: dict[str, float] = {}
    unsettled = []
    pools = []  # after each load: every client's (managed, evicted, pre-copied) MiB
    for name, p in procs.items():
        p.write_line("load")
        p.read(300)  # "ready": loaded, idle, the device given back
        t = time.monotonic()
        while not settled(status := sched.status()):
            if time.monotonic() - t > SETTLE_S:
                unsettled.append(name)
                break
            time.sleep(0.05)
        waits[name] = round(time.monotonic() - t, 3)
        pools.append(
            {
                c["id"]: [
                    c.get(k, 0) >> 20 for k in ("managed_bytes", "evicted_bytes", "precopied_bytes")
                ]
                for dev in status.get("devices", [])
                for c in dev.get("clients", [])
            }
        )
    log(
        f"warm start: {len(procs)} users loaded one at a time; settled in "
        f"{sum(waits.values()):.1f} s"
        + (f"; NOT settled after {', '.join(unsettled)}" if unsettled else "")
    )
    return {"settle_s": waits, "unsettled": unsettled, "pool_mib_after_each": pools}


def _collect(
    procs: dict[str, WorkerProc],
    deadline: float,
    t0: float,
    on_progress: Any,
    every: float = PROGRESS_S,
) -> list[dict[str, Any]]:
    """Every user's cell records until all have ended or the deadline; ``on_progress(cells,
    elapsed)`` every ``every`` seconds."""
    cells: list[dict[str, Any]] = []
    ended: set[str] = set()
    note = time.monotonic() + every
    while len(ended) < len(procs) and time.monotonic() < deadline:
        for name, p in procs.items():
            while name not in ended:
                try:
                    rec = p.read(0)
                except TimeoutError:
                    break
                except RuntimeError:
                    ended.add(name)  # the process ended: all its cells are in
                    break
                rec["user"] = name
                cells.append(rec)
        if on_progress is not None and time.monotonic() >= note:
            note += every
            on_progress(list(cells), time.monotonic() - t0)
        time.sleep(0.1)
    return cells


def _play(
    mode: str,
    users: list[Any],
    trace_cfg: TraceConfig,
    cal: dict[str, Any],
    pool: int,
    grace: float,
    workdir: Path,
    log: Any,
    warm: bool = False,
    on_progress: Any = None,
    progress_s: float = PROGRESS_S,
    chunk_bytes: int = 0,
) -> dict[str, Any]:
    specdir = Path(tempfile.mkdtemp(prefix=f"gsb-{mode}-"))
    iters_per_s = 1.0 / cal["t_iter"]
    sched_cm = None
    ballast = None
    procs: dict[str, WorkerProc] = {}
    cells: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    sampler = UtilizationSampler()
    t0 = time.monotonic()
    try:
        if mode == "colocate":
            # The ballast leaves the pool free, plus what each user's real CUDA context takes
            # beyond the shim's count of one (under gpushare the pool holds each client's
            # context as GPUSHARE_CONTEXT_BYTES): both modes give the users the same room for
            # data. Every user creates its context before any loads data (worker.replay), so a
            # context always fits and what fails is a cell's memory.
            counted = _shim_context_bytes()
            extra_ctx = max(0, int(cal.get("context_bytes_real", 0)) - counted)
            free = pool + len(users) * extra_ctx
            extra["context_allowance_bytes"] = extra_ctx
            ballast = WorkerProc(child_env(), "ballast")
            ballast.read(120)
            ans = ballast.call("ballast", free=free, timeout=120)
            extra["ballast_bytes"] = ans["bytes"]
            socket = ""
        else:
            policy = "fixed-quantum" if mode == "fixed-quantum" else "gpushare"
            ordering = "fair" if mode == "gpushare-fair" else "interactive"
            sched_cm = start_scheduler(
                workdir, "--pool", str(pool), "--policy", policy,
                f"--GPUShareScheduler.ordering={ordering}",
            )  # fmt: skip
            sched = sched_cm.__enter__()
            socket = str(sched.socket)
        for u in users:
            spec = {
                "socket": socket,
                "client": u.name,
                "horizon": trace_cfg.horizon,
                "iters_per_s": iters_per_s,
                "working_set": u.working_set,
                "cells": u.cells,
                "warm": bool(warm and socket),
                "chunk_bytes": chunk_bytes,
            }
            path = specdir / f"{u.name}.json"
            path.write_text(json.dumps(spec))
            env = shim_env(Path(socket), u.name) if socket else child_env()
            procs[u.name] = WorkerProc(env, u.name, ("replay", str(path)))
        if mode == "colocate":
            for p in procs.values():
                p.read(180)  # "context": every user has its CUDA context ...
            for p in procs.values():
                p.write_line("load")  # ... before any loads its data
        if warm and sched_cm is not None:
            for p in procs.values():
                p.read(180)  # "context": every user is up before the first loads
            extra["warm_start"] = _warm_up(procs, sched, log)
        else:
            for p in procs.values():
                p.read(180)  # "ready": context up, device given back
        if sched_cm is not None:
            extra["clients_at_start"] = sched.clients()
        t0 = time.monotonic() + 0.5
        sampler.start()
        for p in procs.values():
            p.write_line(repr(t0))
        log(f"replay {mode}: the clock started ({trace_cfg.horizon:g} s of arrivals)")

        def progress(so_far: list[dict[str, Any]], elapsed: float) -> None:
            if on_progress is not None:  # the checkpoint first: the line says it is written
                on_progress(_cell_results(so_far, users, cal, min(elapsed, trace_cfg.horizon)))
            log(f"replay {mode}: {elapsed:.0f} s, {len(so_far)} cells done")

        cells = _collect(procs, t0 + trace_cfg.horizon + grace, t0, progress, progress_s)
        sampler.stop()
        for name, p in procs.items():
            if p.proc.poll() not in (None, 0):  # a user that crashed: say why in the record
                extra.setdefault("worker_errors", {})[name] = p.exit_report()
            p.kill()
        if sched_cm is not None:
            extra["moves"] = memory_moves(sched.log_text())
    finally:
        sampler.stop()
        for p in procs.values():
            p.kill()
        if ballast is not None:
            ballast.kill()
        if sched_cm is not None:
            sched_cm.__exit__(None, None, None)
    out = _cell_results(cells, users, cal, trace_cfg.horizon)
    summary = summarize(out, trace_cfg.horizon)
    summary["nvml_utilization"] = sampler.mean(t0, t0 + summary["makespan"])
    log(
        f"replay {mode}: p50 {summary['slowdown_p50']:.2f}x, p95 {summary['slowdown_p95']:.2f}x, "
        f"{summary['failed']} failed, {summary['unfinished']} unfinished of {summary['cells']}, "
        f"GPU busy {summary['gpu_busy_fraction'] * 100:.0f}%"
    )
    return {"mode": mode, "summary": summary, "cells": out, **extra}


def _cell_results(
    cells: list[dict[str, Any]], users: list[Any], cal: dict[str, Any], horizon: float
) -> list[dict[str, Any]]:
    """The users' cell records with their solo times, and the cells that arrived by
    ``horizon`` but did not finish (their users' next cell): unfinished."""
    by_user = {u.name: u for u in users}
    out: list[dict[str, Any]] = []
    last_end: dict[str, float] = {}
    for c in cells:
        u = by_user[c["user"]]
        cell = u.cells[c["cell"]]
        solo = solo_seconds(cell["gpu"], u.working_set, cal)
        out.append({**c, "solo": solo})
        last_end[c["user"]] = max(last_end.get(c["user"], 0.0), c["end"])
    for u in users:
        done = [c for c in cells if c["user"] == u.name]
        nxt = len(done)
        if nxt < len(u.cells):
            arrival = last_end.get(u.name, 0.0) + u.cells[nxt]["think"]
            if arrival <= horizon:
                out.append(
                    {
                        "user": u.name,
                        "cell": nxt,
                        "arrival": arrival,
                        "end": None,
                        "ok": False,
                        "error": "unfinished",
                        "solo": solo_seconds(u.cells[nxt]["gpu"], u.working_set, cal),
                    }
                )
    return out


def warm_pool(real_clients: dict[str, Any], simulated: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Whose memory was on the GPU when the clock started, really (the scheduler's status) and
    in the simulator: each user's resident and evicted bytes, and whether the same users had
    memory evicted."""
    real = {
        name: {
            "resident": max(0, int(c.get("managed_bytes", 0)) - int(c.get("evicted_bytes", 0))),
            "evicted": int(c.get("evicted_bytes", 0)),
        }
        for name, c in real_clients.items()
    }
    evicted_real = sorted(n for n, c in real.items() if c["evicted"] > 0)
    evicted_sim = sorted(n for n, c in simulated.items() if c["evicted"] > 0)
    return {
        "real": real,
        "simulated": simulated,
        "evicted_real": evicted_real,
        "evicted_simulated": evicted_sim,
        "same": evicted_real == evicted_sim,
    }


def solo_seconds(gpu: float, working_set: int, cal: dict[str, Any]) -> float:
    """A cell's time on a dedicated GPU: the whole matmul iterations it runs, plus one pass."""
    iters = max(1, round(float(gpu) / cal["t_iter"]))
    return iters * cal["t_iter"] + working_set / GiB * cal["touch_s_per_gib"]


def run(
    workdir: Path,
    trace_cfg: TraceConfig | None = None,
    pool_gib: float = 40.0,
    modes: tuple[str, ...] = MODES,
    grace: float = 30.0,
    log: Any = print,
    checkpoint: Any = None,
    sweeps: bool = True,
    users: list[User] | None = None,
    warm: bool = False,
    cal: dict[str, Any] | None = None,
    progress_s: float = PROGRESS_S,
    chunk_bytes: int = 0,
) -> dict[str, Any]:
    """The replay's record. ``checkpoint(partial)``, if given, receives the record so far after
    each mode and every ``PROGRESS_S`` seconds while one plays (its cells so far), so that a run
    cut short (the device's time limit) still leaves results.
    ``sweeps``: also the capacity sweeps and what-ifs of the compressed replay (bench/capacity.py
    does the real-time ones). ``users``: play these instead of the trace's (a scenario such as
    bench/train_beside.py's; ``trace_cfg`` then gives the horizon and the user count).
    ``warm``: start from a warm pool (the module docstring), the simulator too. ``cal``: a
    calibration already made in this run (:func:`calibrate`). ``progress_s``: seconds between
    progress lines and checkpoints while a mode plays. ``chunk_bytes``: the workers hold their
    working sets in allocations of this size (0: one each), the simulator's engine evicts
    blocks of it (bench.worker.chunks)."""
    trace_cfg = trace_cfg or TraceConfig()
    given = users
    users = given if given is not None else generate(trace_cfg)
    pool = int(pool_gib * GiB)
    cal = cal or calibrate(log)
    # Never ask for more managed memory than the card has free (all users at once, with a
    # generous 1.5 GiB each for context, matmul operands and library workspaces).
    demand = sum(u.working_set for u in users) + int(1.5 * GiB) * len(users)
    free = cal.get("free_fresh") or cal.get("free")
    if free and demand > free:
        raise SystemExit(
            f"the users' memory ({demand / GiB:.1f} GiB) exceeds the card's free memory "
            f"({free / GiB:.1f} GiB): fewer users or smaller working sets"
        )
    biggest = max(u.working_set for u in users) + int(1.5 * GiB)
    if biggest > pool:
        raise SystemExit(
            f"a user needs up to {biggest / GiB:.1f} GiB, more than the pool ({pool_gib} GiB): "
            "the shim would refuse its allocations; choose a larger pool"
        )
    if pool >= demand:
        log(f"note: the pool ({pool_gib} GiB) holds every user at once: no memory pressure")
    runs: dict[str, Any] = {}

    def save(partial_runs: dict[str, Any]) -> None:
        if checkpoint is not None:
            checkpoint(
                {
                    "partial": True,
                    "trace": to_json(trace_cfg, users),
                    "pool_bytes": pool,
                    "calibration": cal,
                    "grace_s": grace,
                    "warm_start": warm,
                    "runs": partial_runs,
                }
            )

    for m in modes:

        def playing(cells: list[dict[str, Any]], m: str = m) -> None:
            # The cells so far: what a run cut by the device's time limit keeps of this mode.
            run = {"mode": m, "in_progress": True, "cells": cells}
            save({**runs, m: run})

        try:  # a mode that breaks is reported; the others still run
            runs[m] = _play(
                m, users, trace_cfg, cal, pool, grace, workdir, log, warm, playing, progress_s,
                chunk_bytes,
            )  # fmt: skip
        except Exception as exc:
            log(f"replay {m}: FAILED: {type(exc).__name__}: {exc}")
            runs[m] = {"mode": m, "error": f"{type(exc).__name__}: {exc}"}
        save(dict(runs))
    # (d) one dedicated GPU per user: every cell at its solo time (see the module docstring).
    ded_cells = []
    for u in users:
        t = 0.0
        for i, cell in enumerate(u.cells):
            arrival = t + cell["think"]
            if arrival > trace_cfg.horizon:
                break
            solo = solo_seconds(cell["gpu"], u.working_set, cal)
            ded_cells.append(
                {"user": u.name, "cell": i, "arrival": arrival, "end": arrival + solo, "ok": True,
                 "error": "", "solo": solo}
            )  # fmt: skip
            t = arrival + solo
    ded = summarize(ded_cells, trace_cfg.horizon)
    ded["gpu_busy_fraction"] /= trace_cfg.users
    ded["gpus"] = trace_cfg.users
    runs["dedicated"] = {"mode": "dedicated", "summary": ded, "cells": ded_cells}
    # The simulator on the same traces, with the costs measured here.
    moves = runs.get("gpushare", {}).get("moves", [])
    bw = bandwidths(moves)
    # A context as the shim counts it (GPUSHARE_CONTEXT_BYTES): the pinned, never-evicted part
    # of each client. Not used_bytes: that holds the working set and operands too (the first
    # campaign took it, and simulated 6.6 GiB "contexts").
    ctx = [
        int(c.get("pinned_bytes", 0))
        for c in runs.get("gpushare", {}).get("clients_at_start", {}).values()
        if c.get("pinned_bytes")
    ]
    sim_cfg = SimConfig(
        pool_bytes=pool,
        total_bytes=int(cal.get("total") or SimConfig.total_bytes),
        context_bytes=int(statistics.median(ctx)) if ctx else 512 * MiB,
        evict_bw=bw["evict_warm"]["median"] or bw["evict_cold"]["median"] or 10e9,
        restore_bw=bw["restore"]["median"] or 48e9,
        touch_s_per_gib=cal["touch_s_per_gib"],
        grace=grace,
        # The real workers also hold their matmul operands (bench/worker.py: a, b and the
        # product, bf16 N x N each) beside their working sets: they move too.
        extra_bytes=operand_bytes(),
        **({"block_bytes": chunk_bytes} if chunk_bytes else {}),
    )
    sim = {}
    sim_cells = {}  # the simulated latency of each real cell, for the per-cell comparison
    warm_pools = {}  # a warm start's pool when the clock started, real and simulated
    for m in (*(m for m in modes if "summary" in runs[m]), "dedicated", *SIM_REFERENCES):
        played = copy.deepcopy(given) if given is not None else generate(trace_cfg)
        simulation = Simulation(played, m, trace_cfg.horizon, sim_cfg, warm=warm)
        cells = simulation.run()
        if simulation.warm_pool and "clients_at_start" in runs[m]:
            warm_pools[m] = warm_pool(runs[m]["clients_at_start"], simulation.warm_pool)
        if m in ("gpushare", "gpushare-fair"):
            sim_cells[m] = [
                {k: c[k] for k in ("user", "cell", "arrival", "end", "ok", "solo")} for c in cells
            ]
        s = summarize(cells, trace_cfg.horizon)
        if m == "dedicated":
            s["gpu_busy_fraction"] /= trace_cfg.users
        sim[m] = s
        log(
            f"simulated {m}: p50 {s['slowdown_p50']:.2f}x, p95 {s['slowdown_p95']:.2f}x, "
            f"{s['failed']} failed"
        )
    agreement = {}
    for m in ("gpushare", "gpushare-fair"):
        if "summary" in runs.get(m, {}) and m in sim:
            real, simulated = runs[m]["summary"], sim[m]
            agreement[m] = {
                q: {
                    "real": real[f"slowdown_{q}"],
                    "simulated": simulated[f"slowdown_{q}"],
                    "relative": simulated[f"slowdown_{q}"] / real[f"slowdown_{q}"] - 1,
                }
                for q in ("p50", "p95")
            }
            agreement[m]["within"] = all(
                abs(agreement[m][q]["relative"]) <= AGREEMENT for q in ("p50", "p95")
            )
    common = {
        "trace": to_json(trace_cfg, users),
        "time_scale": TIME_SCALE,
        "warm_start": warm,
        "pool_bytes": pool,
        "calibration": cal,
        "grace_s": grace,
        "runs": runs,
        "sim_config": {k: v for k, v in sim_cfg.__dict__.items() if k != "ordering"},
        "simulated": sim,
        "simulated_cells": sim_cells,
        "agreement": agreement,
        "warm_pool": warm_pools,
    }
    if not sweeps:
        return {**common, "real_time": trace_cfg.think_mean >= REALISTIC_THINK - 1e-9}
    # Capacity planning with the same costs: users per GPU vs slowdown, 3 seeds per point, at
    # the replay's compressed think time and at a realistic one (over a longer virtual run).
    # Capacity planning with the same costs: users per GPU vs slowdown, 3 seeds per point, at
    # the replay's time scale and at real time (think and GPU times both TIME_SCALE x longer:
    # the same duty cycle, while eviction and restore keep their measured cost).
    real_time = scaled(trace_cfg, TIME_SCALE, horizon=15 * trace_cfg.think_mean * TIME_SCALE)
    capacity = []
    for tc in (trace_cfg, real_time):
        rows = capacity_sweep(
            tc, CAPACITY_USERS, ("gpushare", "fixed-quantum", "colocate"), sim_cfg, 3
        )
        capacity += [{**r, "think_mean": tc.think_mean, "horizon": tc.horizon} for r in rows]
    # Where the slowdown comes from (8 users, real time): the same simulation with one cost
    # taken away at a time.
    what_if = []
    for label, change in (
        ("as measured", {}),
        ("eviction instant", {"evict_bw": 1e18}),
        ("restore instant", {"restore_bw": 1e18}),
        ("both instant", {"evict_bw": 1e18, "restore_bw": 1e18}),
        ("pool holds everyone", {"pool_bytes": 1 << 60, "total_bytes": 1 << 60}),
    ):
        (row,) = capacity_sweep(
            real_time, [trace_cfg.users], ("gpushare",), dataclasses.replace(sim_cfg, **change), 3
        )
        what_if.append({"case": label, **row})
    # The same at the replay's time scale, to explain the replay's own numbers.
    what_if_replay = []
    for label, change in (
        ("as measured", {}),
        ("both instant", {"evict_bw": 1e18, "restore_bw": 1e18}),
        ("pool holds everyone", {"pool_bytes": 1 << 60, "total_bytes": 1 << 60}),
    ):
        (row,) = capacity_sweep(
            trace_cfg, [trace_cfg.users], ("gpushare",), dataclasses.replace(sim_cfg, **change), 3
        )
        what_if_replay.append({"case": label, "think_mean": trace_cfg.think_mean, **row})
    return {
        **common,
        "capacity": capacity,
        "what_if": what_if,
        "what_if_replay_scale": what_if_replay,
        "target": {"users": 8, "p95_slowdown": 1.3, "failed": 0},
        "met": bool(
            "summary" in runs.get("gpushare", {})
            and runs["gpushare"]["summary"]["slowdown_p95"] <= 1.3
            and runs["gpushare"]["summary"]["failed"] == 0
            and runs["gpushare"]["summary"]["unfinished"] == 0
        ),
    }
