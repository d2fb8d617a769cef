"""Seeded traces of interactive notebook users: cells with GPU bursts, think times, working sets.

A user is a notebook kernel holding a working set (a model, a batch of data) on the GPU and
running cells now and then: think (exponential), then a GPU burst (log-normal, clipped), closed
loop (the next think time starts when the cell ends). Real think times are minutes; the default
compresses them to ``think_mean`` seconds so that a replay of a couple of minutes holds several
cells per user (docs/performance.md says so wherever a number depends on it).

The same seed gives the same trace in every process and on every machine (``random.Random``).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

GiB = 1 << 30


@dataclass(frozen=True)
class TraceConfig:
    users: int = 8
    seed: int = 1
    horizon: float = 100.0  # seconds: no cell arrives after this (the replay's length)
    think_mean: float = 20.0  # seconds, exponential; compressed from real notebook minutes
    think_min: float = 1.0
    gpu_median: float = 0.5  # seconds of GPU time per cell on a dedicated GPU, log-normal
    gpu_sigma: float = 0.8
    gpu_min: float = 0.05
    gpu_max: float = 6.0
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


def to_json(cfg: TraceConfig, users: list[User]) -> dict[str, Any]:
    return {"config": asdict(cfg), "users": [asdict(u) for u in users]}
