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

The notebook-shaped trace ``nbmix`` (``TraceConfig(shape="nbmix")``, issue 21) is at real time
and heavier-tailed: 80% interactive cells (log-normal, median 0.25 s, sigma 1.0, 0.01-5 s), 17%
medium (median 8 s, sigma 1.0, 1-120 s), 3% training cells (Pareto alpha 1.5 from 120 s, cut at
30 min); think time log-normal (median 110 s, sigma 1.2, at least 2 s) plus, with probability
5%, a long break (exponential, mean 20 min); about 4% duty; working sets dealt from {1, 2, 3, 4,
6, 8, 12, 16, 20, 24} GiB, so that 8 users hold about twice a 40 GiB pool. Its distributions are
fixed (:data:`NBMIX`): only users, seed, horizon and memory_scale of the TraceConfig apply.

The shortened form ``nbmix-replay`` (:data:`NBMIX_REPLAY`, issue 21 item 7) is what a real-time
GPU replay can play in one device command: 8 users send about 260 cells in 360 s (nbmix at
real time: about 13). What is REAL: the interactive class (80% of the cells, median 0.25 s,
0.01-5 s: the cells whose latency the targets are about), the mix's proportions, the working
sets (up to ``memory_scale``) and every cost of moving them. What is SCALED:
think times and long breaks are :data:`REPLAY_THINK_DIVISOR` (28) times shorter (median 3.9 s,
at least 0.07 s; breaks 5%, mean 43 s); medium and training cells are
:data:`REPLAY_LONG_DIVISOR` (10) times shorter (medium: median 0.8 s, 0.1-10 s) and every cell is
cut at :data:`REPLAY_CELL_CAP` (10 s, 1/36 of the window), so training cells (3%) are all 10 s.
At real length, 260 cells of the mix would ask the GPU for more seconds than the window has.
The cost: each user's duty is about 7.5% (nbmix: 4%), so 8 users keep the GPU about 65% busy
(nbmix: ~31%).

The same seed gives the same trace in every process and on every machine (``random.Random``).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any

GiB = 1 << 30
#: How much faster than real use the default trace runs (think time and GPU bursts alike).
TIME_SCALE = 30.0
#: The trace shapes: today's time-scaled one and the notebook-shaped mix.
SHAPES = ("uniform", "nbmix", "nbmix-replay")


@dataclass(frozen=True)
class NbmixShape:
    """The distributions of the ``nbmix`` trace (see the module docstring)."""

    interactive_p: float = 0.80
    interactive: tuple[float, float, float, float] = (0.25, 1.0, 0.01, 5.0)  # median, sigma, lo, hi
    medium_p: float = 0.17
    medium: tuple[float, float, float, float] = (8.0, 1.0, 1.0, 120.0)
    training: tuple[float, float, float] = (1.5, 120.0, 1800.0)  # Pareto alpha, from, cut
    think: tuple[float, float, float] = (110.0, 1.2, 2.0)  # median, sigma, at least
    break_p: float = 0.05
    break_mean: float = 1200.0
    working_sets_gib: tuple[float, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24)


NBMIX = NbmixShape()
#: The shortened form's divisors of think times and of medium and training cells, and its cap
#: on a cell (see the module docstring).
REPLAY_THINK_DIVISOR = 28.0
REPLAY_LONG_DIVISOR = 10.0
REPLAY_CELL_CAP = 10.0


def _shortened(shape: NbmixShape, think_div: float, long_div: float, cap: float) -> NbmixShape:
    """``shape`` with think times and breaks ``think_div`` x shorter, medium and training cells
    ``long_div`` x shorter, every cell cut at ``cap``; the interactive class and the mix
    unchanged."""
    median, sigma, lo, hi = shape.medium
    alpha, start, cut = shape.training
    t_median, t_sigma, t_least = shape.think
    return replace(
        shape,
        interactive=(*shape.interactive[:3], min(shape.interactive[3], cap)),
        medium=(median / long_div, sigma, lo / long_div, min(hi / long_div, cap)),
        training=(alpha, start / long_div, min(cut / long_div, cap)),
        think=(t_median / think_div, t_sigma, t_least / think_div),
        break_mean=shape.break_mean / think_div,
    )


#: nbmix shortened for a real-time GPU replay of one device command (``shape="nbmix-replay"``).
NBMIX_REPLAY = _shortened(NBMIX, REPLAY_THINK_DIVISOR, REPLAY_LONG_DIVISOR, REPLAY_CELL_CAP)


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
    shape: str = "uniform"  # or "nbmix", "nbmix-replay": of the fields above only users, seed,
    # horizon apply
    memory_scale: float = 1.0  # working sets x this (a replay fitting a smaller card)

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"unknown trace shape {self.shape!r} (one of: {', '.join(SHAPES)})")
        if self.users < 1 or self.horizon <= 0 or self.think_mean <= 0 or self.gpu_median <= 0:
            raise ValueError(f"invalid trace configuration {self}")
        if not self.working_sets_gib:
            raise ValueError("working_sets_gib: at least one size is needed")
        if self.memory_scale <= 0:
            raise ValueError(f"memory_scale must be positive, not {self.memory_scale}")


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
    shape = nbmix_shape(cfg)
    sizes = list(shape.working_sets_gib if shape else cfg.working_sets_gib)
    rng.shuffle(sizes)
    users = []
    for i in range(cfg.users):
        u = User(f"u{i:02d}", int(sizes[i % len(sizes)] * cfg.memory_scale * GiB))
        t = 0.0
        while t <= cfg.horizon:
            think = nbmix_think(rng, shape) if shape else _uniform_think(rng, cfg)
            gpu = nbmix_cell(rng, shape) if shape else _uniform_gpu(rng, cfg)
            u.cells.append({"think": round(think, 6), "gpu": round(gpu, 6)})
            t += think
        users.append(u)
    return users


def nbmix_shape(cfg: TraceConfig) -> NbmixShape | None:
    """The distributions of a notebook-shaped trace (None: the uniform one)."""
    return {"nbmix": NBMIX, "nbmix-replay": NBMIX_REPLAY}.get(cfg.shape)


def _uniform_think(rng: random.Random, cfg: TraceConfig) -> float:
    return max(cfg.think_min, rng.expovariate(1.0 / cfg.think_mean))


def _uniform_gpu(rng: random.Random, cfg: TraceConfig) -> float:
    # lognormvariate(0, s) has median 1
    gpu = cfg.gpu_median * rng.lognormvariate(0.0, cfg.gpu_sigma)
    return min(cfg.gpu_max, max(cfg.gpu_min, gpu))


def _clipped_lognormal(
    rng: random.Random, median: float, sigma: float, lo: float, hi: float
) -> float:
    return min(hi, max(lo, median * rng.lognormvariate(0.0, sigma)))


def nbmix_cell(rng: random.Random, shape: NbmixShape = NBMIX) -> float:
    """One cell's GPU seconds from the nbmix mix."""
    r = rng.random()
    if r < shape.interactive_p:
        return _clipped_lognormal(rng, *shape.interactive)
    if r < shape.interactive_p + shape.medium_p:
        return _clipped_lognormal(rng, *shape.medium)
    alpha, start, cut = shape.training
    return min(cut, start * rng.paretovariate(alpha))


def nbmix_think(rng: random.Random, shape: NbmixShape = NBMIX) -> float:
    """One think time (seconds before the next cell) from the nbmix mix."""
    median, sigma, least = shape.think
    think = max(least, median * rng.lognormvariate(0.0, sigma))
    if rng.random() < shape.break_p:
        think += rng.expovariate(1.0 / shape.break_mean)
    return think


def nbmix_duty_cycle(samples: int = 200_000, shape: NbmixShape = NBMIX) -> float:
    """A nbmix user's expected fraction of wall time on the GPU (Monte Carlo)."""
    rng = random.Random(12345)
    think = gpu = 0.0
    for _ in range(samples):
        think += nbmix_think(rng, shape)
        gpu += nbmix_cell(rng, shape)
    return gpu / (think + gpu)


def scaled(cfg: TraceConfig, factor: float, horizon: float | None = None) -> TraceConfig:
    """The same users ``factor`` times slower: think and GPU times alike (the duty cycle stays).

    A nbmix trace (either form) is at its own time already: only its horizon changes."""
    if nbmix_shape(cfg) is not None:
        return replace(cfg, horizon=cfg.horizon * factor if horizon is None else horizon)
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
    shape = nbmix_shape(cfg)
    if shape is not None:
        return nbmix_duty_cycle(samples, shape)
    rng = random.Random(12345)
    think = gpu = 0.0
    for _ in range(samples):
        think += max(cfg.think_min, rng.expovariate(1.0 / cfg.think_mean))
        g = cfg.gpu_median * rng.lognormvariate(0.0, cfg.gpu_sigma)
        gpu += min(cfg.gpu_max, max(cfg.gpu_min, g))
    return gpu / (think + gpu)


def solo_arrivals(cfg: TraceConfig) -> int:
    """Cells of ``cfg``'s users that arrive within its horizon when every cell takes its solo
    GPU time (a replay, slowed by sharing, sees somewhat fewer)."""
    cells = 0
    for u in generate(cfg):
        t = 0.0
        for c in u.cells:
            t += c["think"]
            if t > cfg.horizon:
                break
            cells += 1
            t += c["gpu"]
    return cells


def to_json(cfg: TraceConfig, users: list[User]) -> dict[str, Any]:
    return {
        "config": asdict(cfg),
        "time_scale": TIME_SCALE,
        "duty_cycle": duty_cycle(cfg, 20_000),
        "users": [asdict(u) for u in users],
    }
