"""Seeded traces of interactive notebook users: cells with GPU bursts, think times, working sets.

A user is a notebook kernel holding a working set (a model, a batch of data) on the GPU and
running cells now and then: think (exponential), then a GPU burst (log-normal, clipped), closed
loop (the next think time starts when the cell ends).

Time is scaled. An interactive notebook user keeps the GPU busy a few per cent of wall time
(assumed here: ~4%, e.g. a ~5 s burst every ~2 minutes of reading and editing). The default
trace keeps that duty cycle but runs ``TIME_SCALE`` times faster (think ~4 s, bursts ~0.12 s
median, ~0.17 s mean), so that a replay of 100 s holds ~180 cells for 8 users (a stable p95)
while 8 users load the GPU ~30%. What is NOT scaled are the real costs of sharing (eviction,
restore, handoff): against bursts 30x shorter they weigh ~30x more than in real use, so the
replay's slowdowns are pessimistic for gpushare. ``scaled`` gives the same trace at real time
(for the simulator's capacity planning).

The same seed gives the same trace in every process and on every machine (``random.Random``).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any

GiB = 1 << 30
#: How much faster than real use the default trace runs (think time and GPU bursts alike).
TIME_SCALE = 30.0


@dataclass(frozen=True)
class TraceConfig:
    users: int = 8
    seed: int = 1
    horizon: float = 100.0  # seconds: no cell arrives after this (the replay's length)
    think_mean: float = 4.0  # seconds, exponential (real: ~2 min; see TIME_SCALE)
    think_min: float = 1.0
    gpu_median: float = 0.12  # seconds of GPU time per cell on a dedicated GPU, log-normal
    gpu_sigma: float = 0.8
    gpu_min: float = 0.02
    gpu_max: float = 3.0
    working_sets_gib: tuple[float, ...] = (2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0)

    def __post_init__(self) -> None:
        if self.users < 1 or self.horizon <= 0 or self.think_mean <= 0 or self.gpu_median <= 0:
            raise ValueError(f"invalid trace configuration {self}")
        if not self.working_sets_gib:
            raise ValueError("working_sets_gib: at least one size is needed")


@dataclass
class User:
    name: str
    working_set: int  # bytes
    cells: list[dict[str, float]] = field(default_factory=list)  # {"think": s, "gpu": s}


def generate(cfg: TraceConfig) -> list[User]:
    """The users of ``cfg``: enough cells each to cover the horizon even if every cell is instant.

    Working sets are dealt from ``working_sets_gib`` in a seeded shuffle (user i gets entry
    i modulo the list), so the total is known in advance: the pool can be chosen below it.
    """
    rng = random.Random(cfg.seed)
    sizes = list(cfg.working_sets_gib)
    rng.shuffle(sizes)
    users = []
    for i in range(cfg.users):
        u = User(f"u{i:02d}", int(sizes[i % len(sizes)] * GiB))
        t = 0.0
        while t <= cfg.horizon:
            think = max(cfg.think_min, rng.expovariate(1.0 / cfg.think_mean))
            # lognormvariate(0, s) has median 1
            gpu = cfg.gpu_median * rng.lognormvariate(0.0, cfg.gpu_sigma)
            gpu = min(cfg.gpu_max, max(cfg.gpu_min, gpu))
            u.cells.append({"think": round(think, 6), "gpu": round(gpu, 6)})
            t += think
        users.append(u)
    return users


def scaled(cfg: TraceConfig, factor: float, horizon: float | None = None) -> TraceConfig:
    """The same users ``factor`` times slower: think and GPU times alike (the duty cycle stays)."""
    return replace(
        cfg,
        think_mean=cfg.think_mean * factor,
        think_min=cfg.think_min * factor,
        gpu_median=cfg.gpu_median * factor,
        gpu_min=cfg.gpu_min * factor,
        gpu_max=cfg.gpu_max * factor,
        horizon=cfg.horizon * factor if horizon is None else horizon,
    )


def duty_cycle(cfg: TraceConfig, samples: int = 200_000) -> float:
    """A user's expected fraction of wall time on the GPU (Monte Carlo of the distributions)."""
    rng = random.Random(12345)
    think = gpu = 0.0
    for _ in range(samples):
        think += max(cfg.think_min, rng.expovariate(1.0 / cfg.think_mean))
        g = cfg.gpu_median * rng.lognormvariate(0.0, cfg.gpu_sigma)
        gpu += min(cfg.gpu_max, max(cfg.gpu_min, g))
    return gpu / (think + gpu)


def to_json(cfg: TraceConfig, users: list[User]) -> dict[str, Any]:
    return {
        "config": asdict(cfg),
        "time_scale": TIME_SCALE,
        "duty_cycle": duty_cycle(cfg, 20_000),
        "users": [asdict(u) for u in users],
    }
