"""No thrashing (issue 35, item 5): under overload, at most ``cap`` long cells hold memory at once.

Pure rules beside the policy (:mod:`.policy`): client records in, the holders to swap out.

A device is *overloaded* when the working sets of the kernels that want it (busy holders and
waiters) exceed its pool. Long cells (tracked by Jupyter, past the ordering's first level) then
take turns by their quanta, each turn moving a working set out and another in, and short cells
evict the long ones' memory for their room: the bytes moved per useful GPU-second grow faster
than the users (docs/performance.md, §8c). With ``PolicyConfig.overload_long_cap`` (0: off) a
long waiter is not admitted beside ``cap`` long holders (nothing is evicted for it); it takes
the place of the longest-running one once that one has held ``overload_window`` seconds. Short
cells are not capped: they still come first. While overloaded, the ordering's starvation window
is ``overload_window`` too (:func:`overload_window`): a long cell paused behind short ones waits
longer before it is let through, so short cells keep the GPU.
"""

from __future__ import annotations

from typing import Protocol

from .ordering import Ordering, OrderingConfig
from .policy_state import ClientState, DeviceState

__all__ = ["capped_swap", "long_cell", "overload_window", "overloaded", "swap_deadlines"]


class _Config(Protocol):
    overload_long_cap: int
    overload_window: float
    ordering: OrderingConfig


def overload_window(cfg: _Config, dev: DeviceState) -> float:
    """The starvation window in force on ``dev``: ``overload_window`` (when longer) while the cap
    is on and the device is overloaded, else the ordering's."""
    base = cfg.ordering.starvation_window
    if cfg.overload_long_cap > 0 and overloaded(dev):
        return max(base, cfg.overload_window)
    return base


def overloaded(dev: DeviceState) -> bool:
    """The working sets of the kernels that want ``dev`` exceed its pool."""
    wanted = sum(
        c.used
        for c in dev.clients.values()
        if (c.holding == "running" and not c.idle) or c.waiting_since is not None
    )
    return wanted > dev.pool_bytes


def long_cell(order: Ordering, c: ClientState) -> bool:
    """A Jupyter cell past the ordering's first level."""
    return c.cell.tracked and order.level(c) > 0


def capped_swap(
    order: Ordering, dev: DeviceState, w: ClientState, cap: int, window: float, now: float
) -> tuple[bool, ClientState | None]:
    """Whether the waiter ``w`` is held back by the cap, and the long holder whose place it takes
    now (None: none yet). Not capped: ``cap`` 0, ``w`` short, or the device not overloaded."""
    if cap <= 0 or not long_cell(order, w) or not overloaded(dev):
        return False, None
    longs = [
        c
        for c in dev.clients.values()
        if c is not w and c.holding is not None and not c.idle and long_cell(order, c)
    ]
    if len(longs) < cap:
        return False, None
    if any(c.holding == "revoking" for c in longs):
        return True, None  # a swap is under way
    oldest = min(longs, key=lambda c: (c.run_start, c.seq))
    return True, (oldest if now >= oldest.run_start + window else None)


def swap_deadlines(order: Ordering, dev: DeviceState, cap: int, window: float) -> list[float]:
    """When a capped long waiter may take a long holder's place (``window`` after its grant)."""
    if cap <= 0 or not overloaded(dev):
        return []
    waiting = any(long_cell(order, c) for c in dev.clients.values() if c.waiting_since is not None)
    if not waiting:
        return []
    return [
        c.run_start + window
        for c in dev.clients.values()
        if c.holding == "running" and not c.idle and long_cell(order, c)
    ]
