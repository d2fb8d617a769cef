"""Interactive-first ordering: which of the cells that fit the GPU go through the launch gate.

Memory decides *who may* hold a device (:mod:`.policy`); this module decides, among busy kernels
that all fit, *who goes first*. Under ``"fair"`` every kernel that fits runs and co-running cells
split the GPU equally (time-sliced contexts). Under ``"interactive"`` (the default) the scheduler
prefers the cell that has had the least GPU time so far in its current cell, a multi-level
feedback queue in the manner of least-attained-service (LAS) scheduling:

* Only kernels that Jupyter reports cells for take part (a "busy" seen): a plain program
  outside Jupyter has no cells, is never paused and never holds others back; programs that fit
  run side by side as under "fair".
* A cell's *service* is its estimated GPU seconds since the cell began (Jupyter's "busy", or a
  request after the kernel went idle): while ``n`` busy kernels hold the device, each one is
  credited ``dt / n`` (they share the GPU). Service divided by the client's weight puts the cell
  on a *level*: level 0 below ``first_level`` seconds, then one level per ``level_ratio``-fold.
  A heavier weight climbs more slowly, so weights keep their meaning (GPU time in proportion).
* Only the busy kernels on the lowest level present go through the gate. A holder on a higher
  level is *paused*: revoked without eviction (its memory stays on the GPU, so resuming it costs a
  handoff without memory, ~1.4 ms p50 on an H100). It is not paused before it has held the device
  ``min_slice`` seconds, so the gate never thrashes; and because levels are geometric, two long
  cells swap at most once per level.
* **Starvation bound.** A busy kernel paused for ``starvation_window`` seconds at a stretch is let
  through regardless of level, and then holds the gate for at least
  ``max(min_slice, starvation_window * weight / total busy weight)`` seconds before it may be
  paused again: in every stretch of ``window + slice`` seconds a long cell holds the gate for at
  least its weighted share of the window. Its GPU time in that slice is shared with the short cells
  running beside it.

Everything here is pure: :class:`Ordering` reads the kernels the policy passes in (anything
with the fields of :class:`Kernel`) and the time it is given, and changes nothing but the
``CellService`` of a kernel it lets through by the starvation bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

from . import costs

__all__ = [
    "ORDERINGS",
    "CellService",
    "Kernel",
    "Ordering",
    "OrderingConfig",
    "boost_slice",
    "break_even",
    "level",
    "level_ceiling",
    "pause_pays",
]

#: Orderings a configuration may name.
ORDERINGS = ("interactive", "fair")

#: What pausing a busy kernel costs it beyond the time paused: its launched work drains, and the
#: pause and the resume are a grant each (costs.py).
PAUSE_COST_S = costs.DRAIN_S + 2 * costs.HANDOFF_S

#: Relative slack when comparing service to a threshold: the time at which a level is reached,
#: computed and then accounted back, can fall short of it by a rounding error.
_SLACK = 1e-9


@dataclass(frozen=True)
class OrderingConfig:
    mode: str = "interactive"  # "interactive" or "fair" (every kernel that fits co-runs)
    first_level: float = 1.0  # GPU seconds (per unit of weight) a cell has on level 0
    level_ratio: float = 4.0  # each further level holds this many times more service
    min_slice: float = 0.1  # seconds a granted kernel holds before the ordering may pause it
    starvation_window: float = 20.0  # seconds a busy kernel may stay paused at a stretch
    # Pause or co-run (pause_pays): a short cell's slowdown beside one longer cell, the longer
    # cell's speed beside it, and what a pause costs the paused cell beyond the pause (its drain
    # and two grants, costs.py). The defaults are time-slicing's (the simulator's model): 2 and
    # half; a configuration may give the GPU's measured ones (bench/nbmix.py does).
    corun_slowdown: float = 2.0
    corun_long_rate: float = 0.5
    pause_cost_s: float = PAUSE_COST_S

    def __post_init__(self) -> None:
        if self.mode not in ORDERINGS:
            raise ValueError(f"unknown ordering {self.mode!r} (one of: {', '.join(ORDERINGS)})")
        if not (self.first_level > 0 and self.level_ratio > 1):
            raise ValueError("first_level must be positive and level_ratio above 1")
        if not (self.min_slice >= 0 and self.starvation_window > self.min_slice):
            raise ValueError("min_slice must be >= 0 and below starvation_window")
        if not (self.corun_slowdown >= 1 and 0 <= self.corun_long_rate <= 1):
            raise ValueError("corun_slowdown must be >= 1 and corun_long_rate in [0, 1]")
        if self.pause_cost_s < 0:
            raise ValueError("pause_cost_s must be >= 0")

    @property
    def interactive(self) -> bool:
        return self.mode == "interactive"


@dataclass
class CellService:
    """One client's current cell as the ordering sees it."""

    service: float = 0.0  # estimated GPU seconds since the cell began
    protect_until: float = -math.inf  # let through by the starvation bound: no pause before
    tracked: bool = False  # Jupyter reports its cells: the ordering applies to it

    def new_cell(self, from_jupyter: bool = False) -> None:
        self.service = 0.0
        self.protect_until = -math.inf
        self.tracked = self.tracked or from_jupyter


def level(service: float, weight: float, cfg: OrderingConfig) -> int:
    """The feedback-queue level of a cell with ``service`` GPU seconds and this weight."""
    x = service / weight * (1 + _SLACK)
    if x < cfg.first_level:
        return 0
    return 1 + int(math.log(x / cfg.first_level) / math.log(cfg.level_ratio) + _SLACK)


def level_ceiling(service: float, weight: float, cfg: OrderingConfig) -> float:
    """The service at which the cell leaves its current level."""
    return weight * cfg.first_level * cfg.level_ratio ** level(service, weight, cfg)


def pause_pays(cfg: OrderingConfig, short_left: float) -> bool:
    """Whether pausing a longer cell for a short one expected to run ``short_left`` more seconds
    costs less than running them side by side, in seconds lost by both.

    A pause costs the longer cell the short one's time plus ``pause_cost_s``; co-running costs
    the short cell ``(corun_slowdown - 1) * short_left`` and the longer one the speed it loses
    over the co-run, ``(1 - corun_long_rate) * corun_slowdown * short_left``. Under time-slicing
    (2, half) a pause pays for any cell longer than its own cost; where the GPU's measured
    contention is lighter (a short cell that leaves the GPU mostly free), co-running does.
    """
    lost = cfg.corun_slowdown - 1 + (1 - cfg.corun_long_rate) * cfg.corun_slowdown
    # the slack: at the break-even's deadline (Ordering.deadlines) co-running pays, whatever the
    # rounding of the service accounted up to it
    return lost * short_left > (short_left + cfg.pause_cost_s) * (1 + 1e-6)


def break_even(cfg: OrderingConfig) -> float:
    """The short cell's time left below which co-running pays (:func:`pause_pays`); 0: never."""
    lost = cfg.corun_slowdown - 1 + (1 - cfg.corun_long_rate) * cfg.corun_slowdown
    return cfg.pause_cost_s / (lost - 1) if lost > 1 else math.inf


def boost_slice(weight: float, busy_weight: float, cfg: OrderingConfig) -> float:
    """How long a kernel let through by the starvation bound holds the gate before a pause."""
    share = weight / busy_weight if busy_weight > 0 else 1.0
    return max(cfg.min_slice, cfg.starvation_window * min(1.0, share))


class Kernel(Protocol):
    """What the ordering reads of a client (the policy's own client records have these)."""

    weight: float
    run_start: float  # when its current grant began
    waiting_since: float | None  # None unless it waits for the device
    cell: CellService


K = TypeVar("K", bound=Kernel)

#: A level above every real one: the gate when no busy kernel holds the device.
NO_LEVEL = 1 << 30


class Ordering:
    """The rules above for one configuration; under ``"fair"`` every kernel passes."""

    def __init__(self, cfg: OrderingConfig) -> None:
        self.cfg = cfg
        #: The starvation window in force: the configuration's, or a longer one the policy sets
        #: for a device under overload (.overload) before it asks about that device.
        self.window = cfg.starvation_window

    def level(self, k: Kernel) -> int:
        return level(k.cell.service, k.weight, self.cfg)

    def starved(self, k: Kernel, now: float) -> bool:
        """A waiter paused for a whole starvation window: let through whatever its level."""
        since = k.waiting_since
        return self.cfg.interactive and since is not None and now >= since + self.window

    def rank(self, k: Kernel, now: float) -> int:
        """A waiter's place before fair share: starved first, then by level ("fair": all 0)."""
        if not self.cfg.interactive or not k.cell.tracked:
            return 0
        return 0 if self.starved(k, now) else 1 + self.level(k)

    def gate(self, busy: Sequence[Kernel]) -> int:
        """The lowest level among the busy holders with cells: waiters above it stay paused;
        none (every waiter passes) where co-running with those cells costs less (pause_pays)."""
        low = min((self.level(k) for k in busy if k.cell.tracked), default=NO_LEVEL)
        if low != NO_LEVEL and not self._pause_pays(busy, low):
            return NO_LEVEL
        return low

    def short_left(self, k: Kernel) -> float:
        """Seconds the cell of ``k`` is expected to run on: its typical cell (``turn_s``, where
        the policy keeps one) less its service, else what it may still run on its level."""
        typical = float(getattr(k, "turn_s", 0.0) or 0.0)
        if typical > k.cell.service:
            return typical - k.cell.service
        return max(0.0, level_ceiling(k.cell.service, k.weight, self.cfg) - k.cell.service)

    def _pause_pays(self, busy: Sequence[Kernel], low: int) -> bool:
        shorts = [k for k in busy if k.cell.tracked and self.level(k) == low]
        return pause_pays(self.cfg, max((self.short_left(k) for k in shorts), default=0.0))

    def passes(self, w: Kernel, gate: int, now: float) -> bool:
        if not self.cfg.interactive or not w.cell.tracked:
            return True
        return self.level(w) <= gate or self.starved(w, now)

    def protect(self, w: Kernel, busy_weight: float, now: float) -> None:
        """``w`` is let through by the starvation bound: no pause during its weighted slice."""
        cfg = (
            self.cfg
            if self.window == self.cfg.starvation_window
            else replace(self.cfg, starvation_window=self.window)
        )
        w.cell.protect_until = now + boost_slice(w.weight, busy_weight, cfg)

    def to_pause(self, busy: Sequence[K], now: float) -> list[K]:
        """Busy holders above the lowest level among them, past their minimum slice and any
        slice the starvation bound gave them."""
        tracked = [k for k in busy if k.cell.tracked]
        if not self.cfg.interactive or len(tracked) < 2:
            return []
        gate = min(self.level(k) for k in tracked)
        if not self._pause_pays(tracked, gate):
            return []  # co-running the cells costs less than a pause (pause_pays)
        return [
            k
            for k in tracked
            if self.level(k) > gate
            and now >= k.run_start + self.cfg.min_slice
            and now >= k.cell.protect_until
        ]

    def deadlines(
        self, busy: Sequence[Kernel], waiters: Sequence[Kernel], now: float
    ) -> Iterator[float]:
        """When the ordering may change its mind without an event: a busy holder reaching its
        next level (it may lose its place, or let a waiter through), a holder's minimum or
        starvation slice ending, a waiter's starvation window."""
        if not self.cfg.interactive:
            return
        tracked = [k for k in busy if k.cell.tracked]
        waiters = [w for w in waiters if w.cell.tracked]
        if tracked and (waiters or len(tracked) > 1):
            even = break_even(self.cfg)
            for k in tracked:
                left = level_ceiling(k.cell.service, k.weight, self.cfg) - k.cell.service
                yield now + left * len(busy)  # co-running kernels share the GPU
                short = self.short_left(k)
                if pause_pays(self.cfg, short):  # from then on co-running with it pays
                    yield now + (short - even) * len(busy)
        if len(tracked) > 1:
            for k in tracked:
                yield k.run_start + self.cfg.min_slice
                yield k.cell.protect_until
        for w in waiters:
            if w.waiting_since is not None:
                yield w.waiting_since + self.window
