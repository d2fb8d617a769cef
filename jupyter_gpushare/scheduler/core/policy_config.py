"""The policy's settings (:class:`PolicyConfig`), kept apart from the rules that read them
(:mod:`.policy`): the scheduler's traits (:mod:`.config`) and the simulator build one of these,
and the policy takes it as it is."""

from __future__ import annotations

from dataclasses import dataclass, field

from .hints import CellHints
from .ordering import OrderingConfig
from .room import KeepFree

__all__ = ["POLICIES", "PolicyConfig"]

#: Policies a PolicyConfig may name.
POLICIES = ("gpushare", "fixed-quantum")


@dataclass
class PolicyConfig:
    base_quantum: float = 5.0  # seconds: the time slice when kernels must take turns
    move_factor: float = 4.0  # quantum ≥ move_factor * (estimated evict+restore time of holder)
    max_quantum: float = 60.0
    # bytes/s: the estimates of a client's moves until its own reports refine them (an EWMA of
    # its Released/Evicted and Restored reports, ClientState.measure)
    evict_bandwidth: float = 10e9
    restore_bandwidth: float = 50e9
    usage_half_life: float = 600.0  # seconds: decay of per-user GPU-time usage for fair share
    # "gpushare" (the rules above) or "fixed-quantum": the baseline of a plain time-sliced lock,
    # see :meth:`Policy._admit_fixed`. Only the latter reads the two settings below.
    policy: str = "gpushare"
    fixed_quantum: float = 30.0  # seconds a holder keeps the lock while others wait
    idle_check_interval: float = 5.0  # seconds between two timer checks for an idle holder
    # Ask idle, resident clients to copy their memory to the host in the background (PRECOPY),
    # so that evicting them for the next arrival is an unmap (see precopy_candidates). Off in
    # the bare core (its scenario tests read exact decision lists); the scheduler turns it on
    # (c.GPUShareScheduler.precopy_idle). Only the gpushare policy pre-copies.
    precopy_idle: bool = False
    # Room to keep free on each device for the next arrival, made by evicting idle, fully
    # pre-copied clients before anyone waits (see .room). Off in the bare core, like pre-copy;
    # the scheduler sets it from c.GPUShareScheduler.keep_free. Only the gpushare policy keeps it.
    keep_free: KeepFree = field(default_factory=KeepFree)
    # Issue 21's memory rules (.policy_moves), each switchable so the simulator can show what it
    # adds: evict only the bytes missing (partial eviction), and never evict a busy kernel whose
    # cell is expected to end sooner than the move, taking the longest cells' memory first
    # (cost-aware).
    partial_eviction: bool = True
    cost_aware: bool = True
    # Short cells first under memory pressure (.policy_short): a short cell queues ahead of
    # overdue waiters and pre-empts a longer busy holder's memory before its quantum ends.
    short_first: bool = True
    # A holder's room follows its neighbours (Room decisions): when the memory of the kernels
    # beside it that are not idle grows or leaves, its grant's room_bytes is told again, so that
    # its shim leaves unbacked what would only be evicted (docs/architecture.md, "Room in
    # grants"). Off in the bare core (its scenario tests read exact decision lists); the
    # scheduler sets it from c.GPUShareScheduler.room_updates.
    room_updates: bool = False
    # Restore ahead (.ahead): a waiter near the head of the line, a kernel Jupyter says has a cell
    # coming, or (nobody waiting) a recently idle kernel gets its evicted memory back before its
    # turn, into room nobody else is owed. Off in the bare core; the scheduler sets it from
    # c.GPUShareScheduler.restore_ahead.
    restore_ahead: bool = False
    # The node's host budget in bytes (.host_budget): staging and evicted memory of every
    # client together stay within it; no move past it is decided. 0: host memory is not
    # accounted (the bare core); the scheduler sets it from c.GPUShareScheduler.host_budget.
    host_budget: int = 0
    # Cell hints (.hints): a Coming (a notebook about to run a cell) restores that kernel ahead,
    # unmapping idle pre-copied kernels for its room; per user, rate-limited. Off in the bare
    # core; the scheduler sets it from c.GPUShareScheduler.cell_hints.
    cell_hints: CellHints = field(default_factory=CellHints)
    # No thrashing (.overload): under overload at most this many long cells hold memory (0: no
    # cap); a capped long waiter takes the place of a long holder that has held overload_window.
    overload_long_cap: int = 0
    overload_window: float = 120.0
    # Among busy kernels that fit: who goes through the gate first (see .ordering).
    ordering: OrderingConfig = field(default_factory=OrderingConfig)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r} (one of: {', '.join(POLICIES)})")
        if self.policy == "fixed-quantum" and not (
            self.fixed_quantum > 0 and self.idle_check_interval > 0
        ):
            raise ValueError("fixed_quantum and idle_check_interval must be positive")
