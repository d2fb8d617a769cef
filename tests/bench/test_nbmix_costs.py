"""Issue 21's trace and engine model: the nbmix trace's statistics, and the simulator's costs
are those of the committed GPU measurements (jupyter_gpushare.scheduler.core.costs)."""

from __future__ import annotations

import json
import random
import re
import statistics
import tarfile
from pathlib import Path

import pytest

from bench.simulator import SimConfig, Simulation, legacy
from bench.trace import (
    NBMIX,
    GiB,
    TraceConfig,
    User,
    generate,
    nbmix_cell,
    nbmix_duty_cycle,
    nbmix_think,
)
from jupyter_gpushare.scheduler.core import costs

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "docs/perf-runs/2026-11-27-gpu"
MEMORY = RUNS / "memory-h100-8c053a7.json"
HANDOFF = RUNS / "handoff-h100-8c053a7.json"
COLD = RUNS / "cold_eviction-h100-8c053a7.json"
ENGINE = ROOT / "docs/gpu-runs/2026-11-28-c/4-rerun-h100-95c641b.tar.gz"


def test_nbmix_duty_and_medians():
    assert 0.035 <= nbmix_duty_cycle(100_000) <= 0.045  # "about 4% duty"
    rng = random.Random(7)
    cells = [nbmix_cell(rng) for _ in range(40_000)]
    short = [c for c in cells if c <= 5.0]
    # 80% interactive (median 0.25 s, sigma 1), the rest >= 1 s: the median cell is the
    # interactive ones' 62.5th percentile, 0.25 * exp(0.319) = 0.344 s
    assert 0.32 <= statistics.median(cells) <= 0.37
    assert len(short) / len(cells) >= 0.80
    training = [c for c in cells if c >= 120.0]
    assert 0.02 <= len(training) / len(cells) <= 0.05
    assert max(cells) <= 1800.0 and min(cells) >= 0.01
    thinks = [nbmix_think(rng) for _ in range(40_000)]
    assert 100.0 <= statistics.median(thinks) <= 125.0  # median 110 s, plus 5% long breaks
    assert min(thinks) >= 2.0


def test_nbmix_working_sets_hold_twice_a_40_gib_pool_at_8_users():
    totals = []
    for seed in range(1, 21):
        users = generate(TraceConfig(users=8, seed=seed, horizon=3600, shape="nbmix"))
        assert {u.working_set / GiB for u in users} <= set(NBMIX.working_sets_gib)
        totals.append(sum(u.working_set for u in users) / GiB)
    assert 70 <= statistics.mean(totals) <= 90  # ~2 x 40 GiB
    again = generate(TraceConfig(users=8, seed=3, horizon=3600, shape="nbmix"))
    assert again == generate(TraceConfig(users=8, seed=3, horizon=3600, shape="nbmix"))
    # today's trace is kept as it was
    assert (
        generate(TraceConfig(users=2, seed=1))[0].working_set
        == generate(TraceConfig())[0].working_set
    )


def _engine_log() -> str:
    """The newest engine test's log (docs/gpu-runs/2026-11-28-c, run 4 at 95c641b)."""
    with tarfile.open(ENGINE) as tar:
        member = tar.extractfile("./logs/test_gpu_memory_engine.log")
        assert member is not None
        return member.read().decode()


def test_the_costs_are_the_newest_committed_measurements():
    mem = json.loads(MEMORY.read_text())
    hand = json.loads(HANDOFF.read_text())
    cold = json.loads(COLD.read_text())
    log = _engine_log()
    bus = re.search(r"eviction ([\d.]+) GB/s \(n=\d+, min [\d.]+\), restore ([\d.]+) GB/s", log)
    assert bus is not None
    assert float(bus[1]) * 1e9 == costs.EVICT_STAGED_BPS
    assert float(bus[2]) * 1e9 == costs.RESTORE_BPS
    unmap = re.search(r"A evicted in ([\d.]+) ms after its pre-copy", log)
    assert unmap is not None  # A holds 14 GiB (tests/gpu/test_gpu_memory_engine.py)
    assert pytest.approx(float(unmap[1]) / 1000 / 14) == costs.UNMAP_S_PER_GIB
    # Each size's first restore is the slow one: every sample under 10 GB/s, none left out.
    slow = [r for r in mem["shim"]["restore"]["samples"] if r < 10e9]
    assert len(slow) == len(mem["per_size"]) == 3
    assert pytest.approx(statistics.mean(slow)) == costs.FIRST_RESTORE_BPS
    rates = [
        a["idle_kernels"] * a["bytes"] / a["precopy_seconds"]
        for a in (mem["precopied_arrival"], mem["precopied_arrival_kept"])
    ]
    assert pytest.approx(statistics.mean(rates)) == costs.PRECOPY_BPS
    assert 15.4e9 <= costs.PRECOPY_BPS <= 15.7e9
    # The cold path: every run at 0.5 s, none dropped.
    at_half = [r["evict_gbps"] * 1e9 for r in cold["runs"] if r["delay_s"] == 0.5]
    assert len(at_half) == 2 and pytest.approx(statistics.mean(at_half)) == costs.EVICT_COLD_BPS
    staged = [r["evict_gbps"] for r in cold["runs"] if r["delay_s"] == 2.0]
    assert min(staged) >= 40  # staging ready by 2 s after a lone 20 GiB allocation
    assert costs.staging_ready_after(20 * GiB) <= 2.0
    # 32 kernels of 1 GiB at once: the slowest ready 4.9 s after its allocation.
    assert pytest.approx(costs.staging_ready_after(GiB, 31 * GiB), abs=0.1) == 4.9
    assert pytest.approx(hand["no_memory"]["p50_ms"] / 1000) == costs.HANDOFF_S
    pinned = mem["pinned_memcpy"]
    assert pytest.approx(max(pinned["d2h"], pinned["h2d"])) == costs.BUS_BPS
    assert set(costs.SOURCES) == {n for n in costs.__all__ if n.isupper() and n != "SOURCES"}
    for name, source in costs.SOURCES.items():
        path = source.split(" ")[0]
        if "/" in path:  # each named file is committed
            assert (ROOT / path.split(":")[0]).exists() or list(ROOT.glob(path)), (name, path)
    cfg = SimConfig()
    assert (cfg.evict_bw, cfg.restore_bw, cfg.unmap_s_per_gib, cfg.precopy_bw) == (
        costs.EVICT_STAGED_BPS,
        costs.RESTORE_BPS,
        costs.UNMAP_S_PER_GIB,
        costs.PRECOPY_BPS,
    )
    assert (cfg.cold_evict_bw, cfg.drain_s, cfg.handoff_s, cfg.block_bytes) == (
        costs.EVICT_COLD_BPS,
        costs.DRAIN_S,
        costs.HANDOFF_S,
        costs.BLOCK_BYTES,
    )
    assert cfg.model_precopy and cfg.partial and cfg.keep_free
    assert cfg.first_restore_bw == costs.FIRST_RESTORE_BPS and cfg.shared_bus
    assert cfg.shared_staging


def _evict_time(at: float, cfg: SimConfig) -> float:
    """Seconds the simulated engine takes to evict a 20 GiB kernel ``at`` s after it ran."""
    users = [
        User("a", 20 * GiB, [{"think": 0.0, "gpu": 0.1}]),
        User("b", 30 * GiB, [{"think": 0.1 + at, "gpu": 0.1}]),
    ]
    sim = Simulation(users, "gpushare", 200.0, cfg)
    sim.log = []
    sim.run()
    (secs,) = [
        e.micros / 1e6
        for e, _ in sim.log
        if type(e).__name__ in ("Released", "Evicted") and e.client == "a" and e.micros > 0
    ]
    return secs


def test_cold_then_staged_eviction_as_the_engine_runs_them():
    cfg = SimConfig(pool_bytes=40 * GiB, model_precopy=False, keep_free=False)
    ready = costs.staging_ready_after(20 * GiB)
    cold, staged = _evict_time(1.0, cfg), _evict_time(ready + 1.0, cfg)
    # b misses 11 GiB (40 GiB pool: a holds 20.5, b's context 0.5, b needs 30 more): only that
    # leaves a (partial eviction)
    moved = 11 * GiB
    assert cold == pytest.approx(moved / costs.EVICT_COLD_BPS, rel=1e-3)
    assert staged == pytest.approx(moved / costs.EVICT_STAGED_BPS, rel=1e-3)
    old = legacy(cfg)
    assert _evict_time(1.0, old) == pytest.approx(20 * GiB / 10e9, rel=1e-3)  # whole, 10 GB/s
