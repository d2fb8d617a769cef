"""The nbmix replay on the GPU (issue 21, item 7): 8 users, >= 200 cells, a warm pool, one command.

    python3 -m bench.run_campaign OUT_DIR --only nbmix-replay     # ~7.5 min on an H100 or H200

Real PyTorch workers under the shim, one per user, against a real scheduler with the daemon's
defaults (:mod:`bench.replay`, mode ``gpushare`` only), play the shortened notebook-shaped trace
``nbmix-replay`` (:data:`bench.trace.NBMIX_REPLAY`: the interactive cells, the mix, the working
sets and every memory cost real; think times 28x and medium and training cells 10x shorter, no
cell over 10 s, so that 8 users send about 260 cells in 360 s). Before the clock starts every
user has loaded its memory, one at a time, and the pool holds what the policy keeps,
pre-copied (the warm start, :func:`bench.replay.settled`). The simulator
(:mod:`bench.simulator`, the daemon's own policy object) plays the same users through the same
warm start with the costs calibrated in this run; the record says whether its p50 and p95
slowdown are within :data:`bench.replay.AGREEMENT` of the real ones, and whether the same
users' memory was out of the pool when the clocks started (``warm_pool``).

Memory: the users' total must fit the card's free memory (never oversubscribe: the pressure
comes from a pool smaller than the card) and the host's available memory (evicted memory
lives in host staging), and the users must hold about twice the pool, as in
nbmix (:func:`pressure`). :data:`FORMS` gives the choices; the first that fits the card found
is played: the working sets as they are with a 40 GiB pool (an H200: seed 1's 8 users hold
91 GiB), or halved with a 22 GiB pool (an H100: 45.5 GiB). The pool keeps the pressure of
nbmix's 40 GiB: what is left of it beside the users' contexts (512 MiB each, counted in the
pool) scales with the working sets (:func:`pool_for`). A worker holds its working set in
allocations of 256 MiB (scaled likewise), as a notebook holds many tensors: the engine evicts
whole allocations, and the simulator evicts blocks of the same size (:func:`chunk_for`).

Before the replay the simulator also predicts the run with the committed costs
(:mod:`jupyter_gpushare.scheduler.core.costs`): a run cut short keeps that and the cells so far
(checkpoints every 30 s).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from . import replay
from .common import GiB, MiB
from .simulator import SimConfig, Simulation, summarize
from .trace import TraceConfig, generate
from .worker import operand_bytes, process_host_bytes

#: (memory scale, label), the first whose users fit the card's free memory is played.
FORMS = (
    (1.0, "working sets as in nbmix (a card with ~110 GiB free: an H200)"),
    (0.5, "working sets halved (an 80 GB card: an H100)"),
)
#: The shim's count of a context in the pool (GPUSHARE_CONTEXT_BYTES's default).
CONTEXT = 512 * MiB
#: Per user beside its working set, for the fit on the card: context, operands, workspaces
#: (the same allowance as bench.replay's check).
ALLOWANCE = int(1.5 * GiB)
#: Left free on the card beyond the users' allowance.
HEADROOM = 2 * GiB
#: What the host keeps free beside the users' memory and processes (bench.worker's
#: process_host_bytes): evicted memory lives in host staging, so the users' memory must fit the
#: host too (the device machines have 128 GiB; seed 1's unscaled users need about 118 GiB).
HOST_HEADROOM = 8 * GiB
#: nbmix's pool at 8 users (issue 21).
NBMIX_POOL = 40 * GiB
#: A working set's allocations at memory scale 1 (a notebook's tensors; the engine evicts whole
#: allocations, the simulator blocks of this size: bench.worker.chunks), scaled with it.
CHUNK = 256 * MiB
#: Asked of the replay: cells arriving in the window.
CELLS_TARGET = 200
HORIZON = 360.0
GRACE = 20.0


def pool_for(memory_scale: float, users: int) -> int:
    """The pool that keeps nbmix's pressure: the contexts, plus nbmix's 40 GiB beside 8 users'
    contexts scaled by the working sets' scale and the number of users."""
    room = (NBMIX_POOL - 8 * CONTEXT) * memory_scale * users / 8
    return int(users * CONTEXT + room) // MiB * MiB


def chunk_for(memory_scale: float) -> int:
    """The workers' allocation size (and the simulator's block) at ``memory_scale``."""
    return max(MiB, int(CHUNK * memory_scale) // MiB * MiB)


def pressure(held: int, pool: int, users: int) -> float:
    """The users' working sets over the pool's room for data (the pool less their contexts):
    about 2 for nbmix at 8 users (seed 1: 91 GiB over 36), the same at every memory scale."""
    return held / max(1, pool - users * CONTEXT)


def trace_config(users: int, seed: int, horizon: float, memory_scale: float) -> TraceConfig:
    return TraceConfig(
        users=users, seed=seed, horizon=horizon, shape="nbmix-replay", memory_scale=memory_scale
    )


def demand(tc: TraceConfig) -> int:
    """What the users may hold on the card at once (working sets and allowances)."""
    return sum(u.working_set for u in generate(tc)) + ALLOWANCE * tc.users


def host_available() -> int:
    """The host's available memory (MemAvailable), 0 where unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def host_need(tc: TraceConfig) -> int:
    """What the users need of the host's memory: each evicted byte's staging (as much as the
    working sets and operands), each worker's own (PyTorch, CUDA), and headroom."""
    held = sum(u.working_set for u in generate(tc))
    return held + tc.users * (operand_bytes() + process_host_bytes()) + HOST_HEADROOM


def choose_form(
    free: int,
    users: int,
    seed: int,
    horizon: float,
    memory_scale: float = 0.0,
    pool_gib: float = 0.0,
    host: int = 0,
) -> dict[str, Any]:
    """The memory form to play on a card with ``free`` bytes free and a host with ``host``
    bytes available (0: not checked): the first of :data:`FORMS` whose users fit both (or
    ``memory_scale`` where given), its pool (or ``pool_gib``)."""
    forms = [(memory_scale, "memory scale given")] if memory_scale > 0 else list(FORMS)
    tried = []
    for scale, label in forms:
        tc = trace_config(users, seed, horizon, scale)
        need, on_host = demand(tc), host_need(tc)
        tried.append(f"x{scale:g}: {need / GiB:.1f} GiB, host {on_host / GiB:.1f} GiB")
        if need + HEADROOM <= free and (host <= 0 or on_host <= host):
            pool = int(pool_gib * GiB) if pool_gib > 0 else pool_for(scale, users)
            held = sum(u.working_set for u in generate(tc))
            return {
                "memory_scale": scale,
                "label": label,
                "pool_bytes": pool,
                "chunk_bytes": chunk_for(scale),
                "card_free_bytes": free,
                "host_available_bytes": host,
                "host_need_bytes": on_host,
                "users_bytes": held,
                "demand_bytes": need,
                "pressure": pressure(held, pool, users),
            }
    raise SystemExit(
        f"nbmix-replay: no form fits the card's {free / GiB:.1f} GiB free and the host's "
        f"{host / GiB:.1f} GiB available (users' memory with {ALLOWANCE / GiB:g} GiB each and "
        f"{HEADROOM / GiB:g} GiB headroom: {'; '.join(tried)}); give --nbmix-memory-scale"
    )


def sim_config(form: dict[str, Any], cal: dict[str, Any], grace: float) -> SimConfig:
    """The simulator with the committed costs (the prediction before the run)."""
    return SimConfig(
        pool_bytes=form["pool_bytes"],
        total_bytes=int(cal.get("total") or SimConfig.total_bytes),
        touch_s_per_gib=cal["touch_s_per_gib"],
        grace=grace,
        extra_bytes=operand_bytes(),  # the workers' matmul operands (bench.replay's sim_cfg)
        block_bytes=form["chunk_bytes"],
    )


def predict(tc: TraceConfig, cfg: SimConfig) -> dict[str, Any]:
    cells = Simulation(generate(tc), "gpushare", tc.horizon, cfg, warm=True).run()
    return summarize(cells, tc.horizon)


def run(
    workdir: Path,
    users: int = 8,
    seed: int = 1,
    horizon: float = HORIZON,
    grace: float = GRACE,
    memory_scale: float = 0.0,
    pool_gib: float = 0.0,
    log: Any = print,
    checkpoint: Any = None,
    progress_s: float = replay.PROGRESS_S,
) -> dict[str, Any]:
    """The record (see the module docstring); ``checkpoint(partial)`` as :func:`replay.run`,
    also every ``progress_s`` seconds of the replay."""
    cal = replay.calibrate(log)
    free = int(cal.get("free_fresh") or cal.get("free") or 0)
    host = host_available()
    form = choose_form(free, users, seed, horizon, memory_scale, pool_gib, host)
    tc = trace_config(users, seed, horizon, form["memory_scale"])
    log(
        f"nbmix-replay: {form['label']}: memory x{form['memory_scale']:g}, pool "
        f"{form['pool_bytes'] / GiB:.1f} GiB, users hold {form['users_bytes'] / GiB:.1f} GiB "
        f"({form['pressure']:.2f}x the pool's room beside contexts), at most "
        f"{form['demand_bytes'] / GiB:.1f} GiB on the card, of "
        f"{free / GiB:.1f} GiB free"
    )
    prediction = predict(tc, sim_config(form, cal, grace))
    log(
        f"nbmix-replay: predicted (simulator, committed costs): {prediction['cells']} cells, "
        f"p50 {prediction['slowdown_p50']:.2f}x, p95 {prediction['slowdown_p95']:.2f}x"
    )
    extra = {"form": form, "prediction": prediction, "cells_target": CELLS_TARGET}

    def save(partial: dict[str, Any]) -> None:
        if checkpoint is not None:
            checkpoint({**partial, **extra})

    res = replay.run(
        workdir, tc, form["pool_bytes"] / GiB, ("gpushare",), grace, log, save,
        sweeps=False, warm=True, cal=cal, progress_s=progress_s, chunk_bytes=form["chunk_bytes"],
    )  # fmt: skip
    real = res["runs"]["gpushare"].get("summary")
    agree = res["agreement"].get("gpushare")
    met = bool(real and agree and agree["within"] and real["cells"] >= CELLS_TARGET)
    out = {**res, **extra, "met": met}
    log(summary_text(out).rstrip())
    return out


def _x(v: Any) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}x"


def summary_text(rec: dict[str, Any]) -> str:
    """The record in a few lines (nbmix_replay.txt beside the JSON)."""
    form, run = rec.get("form", {}), rec.get("runs", {}).get("gpushare", {})
    lines = [
        f"nbmix-replay: {rec.get('trace', {}).get('config', {}).get('users', '?')} users, "
        f"{form.get('label', '?')}, memory x{form.get('memory_scale', '?')}, pool "
        f"{form.get('pool_bytes', 0) / GiB:.1f} GiB, users hold "
        f"{form.get('users_bytes', 0) / GiB:.1f} GiB ({form.get('pressure', 0):.2f}x its room), "
        f"warm start: {rec.get('warm_start')}"
    ]
    s = run.get("summary")
    if s is None:
        left = "in progress" if run.get("in_progress") else run.get("error", "did not run")
        lines.append(f"real: no result ({left}; {len(run.get('cells', []))} cells recorded)")
    else:
        lines.append(
            f"real: {s['cells']} cells ({s['completed']} completed, {s['unfinished']} "
            f"unfinished, {s['failed']} failed; asked >= {rec.get('cells_target')}), "
            f"p50 {_x(s['slowdown_p50'])}, p95 {_x(s['slowdown_p95'])}"
        )
    for label, sim in (
        ("simulated (costs of this run)", rec.get("simulated", {}).get("gpushare")),
        ("predicted (committed costs)", rec.get("prediction")),
    ):
        if sim:
            lines.append(
                f"{label}: {sim['cells']} cells, p50 {_x(sim['slowdown_p50'])}, "
                f"p95 {_x(sim['slowdown_p95'])}"
            )
    pool = rec.get("warm_pool", {}).get("gpushare")
    if pool:
        lines.append(
            f"warm pool: evicted really {', '.join(pool['evicted_real']) or 'none'}; in the "
            f"simulator {', '.join(pool['evicted_simulated']) or 'none'}"
            f" ({'the same' if pool['same'] else 'NOT the same'})"
        )
    a = rec.get("agreement", {}).get("gpushare")
    if a:
        rel = ", ".join(f"{q} {a[q]['relative']:+.0%}" for q in ("p50", "p95"))
        word = "within" if a["within"] else "NOT within"
        lines.append(f"agreement: simulated vs real {rel}: {word} {replay.AGREEMENT:.0%}")
    if "met" in rec:
        lines.append(f"met: {'yes' if rec['met'] else 'no'}")
    if rec.get("partial"):
        lines.append("partial: the run was cut short")
    return "\n".join(lines) + "\n"
