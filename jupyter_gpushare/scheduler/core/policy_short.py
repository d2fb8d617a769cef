"""Short cells first under memory pressure: the interactive ordering (:mod:`.ordering`) carried
into the memory queue. Pure rules beside :mod:`.policy` (client records in, answers out).

The ordering decides who goes through the launch gate among kernels that *fit*; when a short cell
needs room that a long one holds, two older rules stood in its way:

1. **The queue.** Waiters that had waited ``max_quantum`` (overdue) or a starvation window came
   first. When the working sets of the kernels that want the GPU cannot fit together, long cells
   take turns, each waiting several quanta between them, so every one of them is overdue or
   starved: a new short cell queued behind all of them, about a starvation window (20 s) for a
   0.25 s cell. So a waiter whose cell is *short* (:func:`short_cell`: tracked by Jupyter, on
   ordering level 0, less than ``first_level`` GPU-seconds since it began) comes first, ahead of
   overdue ones (:func:`queue_key`); among short ones, fair share then arrival.
2. **The quantum.** A busy holder was revoked for a blocked waiter only once its quantum (at
   least ``base_quantum``) had passed. A short waiter now pre-empts a busy holder on a higher level
   (:func:`preempts`), as the ordering pauses it when memory fits: once the holder has held
   ``min_slice`` and outside a starvation slice, and, cost-aware, only when the holder's cell is
   expected to run longer than moving the bytes out and back (:func:`.policy_moves.worth_evicting`).
   Only the missing bytes leave (partial eviction); the long cell resumes when the short one
   ends.

Both are bounded: a cell leaves level 0 after ``first_level`` GPU-seconds (per unit of weight),
so each cell passes a waiter, or pre-empts a holder, for at most that long; a pre-empted kernel is
on a higher level and never pre-empts back. Measured in the simulator (nbmix, p95 slowdown,
docs/perf-runs/2026-11-27-sim-b): 16 users 6.28x -> 5.31x, 32 users 58.88x -> 10.84x; on 4
seeds at 32 users the first rule alone gave about 30x, the second alone about 37x, both 9-10x.
``PolicyConfig.short_first`` switches both.
"""

from __future__ import annotations

from .ordering import Ordering
from .policy_state import ClientState

__all__ = ["preempts", "queue_key", "short_cell"]


def short_cell(order: Ordering, c: ClientState) -> bool:
    """A busy cell that Jupyter reports, still on the interactive ordering's first level."""
    return order.cfg.interactive and c.cell.tracked and not c.idle and order.level(c) == 0


def queue_key(
    order: Ordering, c: ClientState, now: float, share: float, overdue: bool, short_first: bool
) -> tuple[int, int, int, float, float, int]:
    """A waiter's place in the memory queue (:meth:`.policy.Policy._queue`), lowest first.

    With ``short_first``, short cells; then overdue waiters in arrival order; then the rest by:
    not marked idle by Jupyter, the ordering's rank, fair ``share``, arrival.
    """
    since = c.waiting_since
    assert since is not None
    if short_first and short_cell(order, c):
        return (-1, 0, 0, share, since, c.seq)
    if overdue:
        return (0, 0, 0, 0.0, since, c.seq)
    return (1, int(c.idle), order.rank(c, now), share, since, c.seq)


def preempts(order: Ordering, w: ClientState, h: ClientState, now: float) -> bool:
    """Whether the blocked waiter ``w`` may have the busy holder ``h`` revoked before its quantum
    ends: ``w``'s cell is short, ``h``'s is on a higher level, ``h`` has held its minimum slice
    and no starvation slice protects it."""
    return (
        short_cell(order, w)
        and h.cell.tracked
        and order.level(h) > 0
        and now >= h.run_start + order.cfg.min_slice
        and now >= h.cell.protect_until
    )
