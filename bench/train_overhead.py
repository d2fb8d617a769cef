"""A real PyTorch training loop with and without the shim (benchmark 1b). Target: <= 1% slower.

A small CNN (two conv layers, two linear, batch 256 of 32x32 images, SGD) trains a fixed number
of steps in a fresh process; processes alternate plain / shimmed (ABBA), each holding the
device alone (its scheduler has no other client). Per pair, the relative difference of the
seconds per step; the result is the median with a distribution-free 95% confidence interval.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .common import child_env, median_ci, shim_env
from .common import scheduler as start_scheduler
from .procs import WorkerProc

TARGET = 0.01


def _train(env: dict[str, str], steps: int) -> dict[str, Any]:
    w = WorkerProc(env, "train")
    try:
        w.read(120)
        return w.call("train", steps=steps, warmup=30, timeout=300)
    finally:
        w.close()


def run(workdir: Path, pairs: int = 6, steps: int = 400, log: Any = print) -> dict[str, Any]:
    plain: list[float] = []
    under: list[float] = []
    losses: dict[str, list[float]] = {"plain": [], "shim": []}
    with start_scheduler(workdir, "--pool", "40GiB") as sched:
        for i in range(pairs):
            order = [("plain", child_env(), plain), ("shim", shim_env(sched.socket), under)]
            if i % 2:
                order.reverse()
            for kind, env, dest in order:
                res = _train(env, steps)
                dest.append(float(res["step_s"]))
                losses[kind].append(float(res["loss"]))
    rel = [u / p - 1.0 for p, u in zip(plain, under, strict=True)]
    med, lo, hi = median_ci(rel)
    log(
        f"training: {statistics.median(plain) * 1e3:.3f} ms/step plain, "
        f"{statistics.median(under) * 1e3:.3f} under the shim: {med * 100:+.2f}% "
        f"(95% CI {lo * 100:+.2f} .. {hi * 100:+.2f}%; target <= +1%)"
    )
    return {
        "steps": steps,
        "pairs": pairs,
        "plain_step_s": plain,
        "shim_step_s": under,
        "relative_diff": rel,
        "slowdown_median": med,
        "slowdown_ci95": [lo, hi],
        "final_loss": losses,
        "losses_identical": losses["plain"] == losses["shim"],
        "target": TARGET,
        "met": med <= TARGET,
    }
