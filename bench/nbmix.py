"""The simulator on the notebook-shaped trace (issue 21): memory that does not fit, before/after.

    python -m bench.nbmix OUT_DIR [--seeds 20] [--users 8,16,32] [--horizon 3600]

writes ``OUT_DIR/nbmix.json``: for each user count and variant, the p95 (and p50) slowdown of
each seed, their mean and 95% confidence half-width, and the users per GPU whose mean p95 meets
2x, for the nbmix trace and today's (uniform, at real time). Variants:

- ``before``: the simulator and policy as they were (one 10 GB/s eviction, no pre-copy model,
  whole kernels moved, no cost-aware choice);
- ``engine``: the engine's measured costs (:mod:`jupyter_gpushare.scheduler.costs`: staged and
  cold eviction, restore, pre-copy, unmap, keep_free as the daemon runs them), the old rules;
- ``after``: the measured costs and issue 21's rules (partial eviction, cost-aware choice);
- ``after-no-keep-free``: the same without keep_free (what room kept ahead costs here);
- ``fits``: the same cells on a pool that holds every working set (the memory-free floor).

No GPU; about 10 CPU minutes for the defaults. ``bench.report`` shows the file's rows.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from .capacity import mean_ci
from .common import GiB, record, write_json
from .simulator import SimConfig, Simulation, legacy, policy_config, summarize
from .trace import TIME_SCALE, TraceConfig, generate, scaled

VARIANTS = ("before", "engine", "after", "after-no-keep-free", "fits")
#: The issue's targets: mean p95 slowdown at most this, per user count (nbmix).
TARGETS = {8: 3.0, 16: 6.0}
WARMUP = 300.0


def variant_configs(name: str, cfg: SimConfig) -> tuple[SimConfig, Any]:
    """The simulator's and the policy's configuration of a variant."""
    old_rules = {"partial_eviction": False, "cost_aware": False}
    if name == "before":
        sim = legacy(cfg)
        return sim, replace(policy_config("gpushare", sim), **old_rules)
    if name == "engine":
        return cfg, replace(policy_config("gpushare", cfg), **old_rules)
    if name == "after-no-keep-free":
        sim = replace(cfg, keep_free=False)
        return sim, policy_config("gpushare", sim)
    if name == "fits":
        sim = replace(cfg, pool_bytes=10_000 * GiB, total_bytes=10_000 * GiB)
        return sim, policy_config("gpushare", sim)
    return cfg, policy_config("gpushare", cfg)


def trace(shape: str, users: int, seed: int, horizon: float) -> TraceConfig:
    tc = TraceConfig(users=users, seed=seed, horizon=horizon, shape=shape)
    return tc if shape == "nbmix" else scaled(tc, TIME_SCALE, horizon=horizon)


def point(shape: str, users: int, variant: str, seeds: int, horizon: float) -> dict[str, Any]:
    """One user count and variant over ``seeds`` seeded traces."""
    cfg, pcfg = variant_configs(variant, SimConfig())
    p95, p50 = [], []
    for s in range(seeds):
        tc = trace(shape, users, 1 + 1000 * s, horizon)
        cells = Simulation(generate(tc), "gpushare", horizon, cfg, pcfg).run()
        summary = summarize(cells, horizon, warmup=WARMUP)
        p95.append(summary["slowdown_p95"])
        p50.append(summary["slowdown_p50"])
    ci = mean_ci(p95)
    return {
        "trace": shape,
        "users": users,
        "variant": variant,
        "seeds": seeds,
        "slowdown_p95_mean": ci["mean"],
        "slowdown_p95_ci": ci["ci"],
        "slowdown_p50_mean": mean_ci(p50)["mean"],
        "slowdown_p95": p95,
        "target": TARGETS.get(users) if shape == "nbmix" else None,
    }


def users_at(shape: str, variant: str, limit: float, seeds: int, horizon: float) -> int:
    """The most users per GPU whose mean p95 slowdown is at most ``limit`` (upward grid)."""
    best = 0
    for n in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32):
        p95 = point(shape, n, variant, seeds, horizon)["slowdown_p95_mean"]
        if p95 > limit:  # NaN (no cells after the warm-up) counts as met
            break
        best = n
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--users", default="8,16,32")
    ap.add_argument("--horizon", type=float, default=3600.0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--capacity-seeds", type=int, default=5, help="seeds per users-per-GPU point")
    args = ap.parse_args(argv)
    started = time.monotonic()
    variants = args.variants.split(",")
    rows = [
        point("nbmix", int(n), v, args.seeds, args.horizon)
        for n in args.users.split(",")
        for v in variants
    ]
    capacity = [
        {
            "trace": shape,
            "variant": v,
            "limit": 2.0,
            "users": users_at(shape, v, 2.0, args.capacity_seeds, args.horizon),
        }
        for shape in ("nbmix", "uniform")
        for v in ("before", "after")
    ]
    doc = record(
        "nbmix",
        horizon_s=args.horizon,
        warmup_s=WARMUP,
        pool_gib=SimConfig().pool_bytes / GiB,
        rows=rows,
        users_per_gpu_p95_2x=capacity,
        targets=TARGETS,
        duration_s=time.monotonic() - started,
    )
    write_json(args.out / "nbmix.json", doc)
    for r in rows:
        print(
            f"{r['users']:>3} {r['variant']:<20} p95 {r['slowdown_p95_mean']:.2f} "
            f"± {r['slowdown_p95_ci']:.2f}  p50 {r['slowdown_p50_mean']:.2f}"
        )
    for c in capacity:
        print(f"users/GPU at p95 <= 2x: {c['trace']} {c['variant']}: {c['users']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
