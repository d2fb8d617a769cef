"""Room for the next arrival: idle kernels' memory off the GPU before anyone asks for it.

Pure rules beside the policy (:mod:`.policy`), like :mod:`.ordering` and :mod:`.deep_idle`: the
policy's client records in, which clients to act on out; no I/O and no clock of their own.

Two steps prepare a full GPU for the next kernel to arrive:

1. **Pre-copy** (:func:`precopy_candidates`). An idle kernel's memory is copied to the host in
   the background while it stays on the GPU, so that evicting it later is an unmap (no copy).
2. **Keep free** (:func:`room_evictions`). An unmap still takes time: on an H100, releasing a
   pre-copied 12 GiB kernel's physical memory took 194.6 ms, twice the 100 ms an arrival may
   wait. So the room is made *before* the arrival: while nobody waits and the pool has less than
   the target free, idle kernels whose memory is fully pre-copied (evicting them is only an
   unmap) are evicted, least recently used first, until the target is free. A busy kernel, one
   with memory that has no current host copy, and a holder that is not idle are never evicted
   for room.

The target (:class:`KeepFree`) is a size, or ``auto``: the largest of the last
:data:`AUTO_WINDOW` arrivals on the device (the bytes a grant brought onto the GPU: a new kernel's
memory, or an evicted one's restore), at most :data:`AUTO_POOL_FRACTION` of the pool. Before any
arrival was seen, ``auto`` keeps nothing free.

**Only where it pays** (``auto``, :attr:`KeepFree.min_wait`). Room made ahead saves the next
arrival the unmap of the idle kernels' pre-copied memory, and costs each kernel evicted for it a
restore if it comes back before the room is used. At the engine's measured costs
(:mod:`.costs`: an unmap 0.68 ms/GiB, a restore 21 ms/GiB) the saving is a few milliseconds and
the restore thirty times dearer per byte: in the simulator keep_free "auto" raised nbmix's p95
slowdown at 8 users from 3.18x to 3.62x (docs/performance.md). So ``auto`` keeps room only while
making it on demand would keep the arrival waiting at least ``min_wait`` seconds: the target's
bytes at the device's measured unmap time per byte (an EWMA of the evictions that copied nothing,
starting from :data:`~.costs.UNMAP_S_PER_GIB`). A size set by the operator is kept as set.

**No thrashing.** Room is kept for *another* kernel; when the one evicted for room is the one that
comes back, the room cost it a restore and saved nobody anything. Such a client is held: it is
not evicted for room again until it has been idle :func:`room_hold` seconds (60 s after its first
return, doubling with each further return, at most an hour), so a kernel in active use stays
resident between its cells while a forgotten one still gives its room away. A room eviction the
shim refuses is not tried again in the same idle period.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .events import Decision
from .policy_state import ARRIVAL_WINDOW, ClientState, DeviceState

__all__ = [
    "AUTO_POOL_FRACTION",
    "AUTO_WINDOW",
    "KEEP_FREE_WAIT",
    "REASON_ROOM",
    "KeepFree",
    "precopy_candidates",
    "room_deadline",
    "room_evictions",
    "room_hold",
]

#: ``auto`` keeps at most this part of the pool free: the rest stays for idle kernels' residency.
AUTO_POOL_FRACTION = 0.25
#: ``auto`` estimates the next arrival from this many recent ones per device.
AUTO_WINDOW = ARRIVAL_WINDOW
#: Seconds a client that came back after a room eviction stays idle before the next one.
RETURN_HOLD = 60.0
#: The hold's ceiling (it doubles with each return).
RETURN_HOLD_MAX = 3600.0
#: keep_free "auto" keeps room only where making it on demand would keep an arrival waiting this
#: long (seconds): the arrival's target in docs/performance.md (an arrival at pre-copied idle
#: kernels granted within 100 ms). The scheduler's c.GPUShareScheduler.keep_free_wait.
KEEP_FREE_WAIT = 0.1
#: The reason an eviction for room gives (the scheduler logs it; the shim ignores it).
REASON_ROOM = "room for the next arrival"


@dataclass(frozen=True)
class KeepFree:
    """How much of each device's pool to keep free for the next arrival (0 and not auto: off)."""

    size: int = 0  # bytes, when not auto
    auto: bool = False
    # auto: keep room only while making it on demand (an unmap) would take this long (seconds)
    min_wait: float = 0.0

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError(f"keep_free cannot be negative (got {self.size})")
        if not self.min_wait >= 0:
            raise ValueError(f"keep_free's min_wait must be >= 0 (got {self.min_wait})")

    @property
    def on(self) -> bool:
        return self.auto or self.size > 0

    def target(
        self, pool_bytes: int, recent_arrivals: Iterable[int], unmap_s_per_byte: float = 0.0
    ) -> int:
        """The bytes to keep free on a device of ``pool_bytes`` (never more than the pool);
        ``unmap_s_per_byte``: what making room on demand costs there (``auto`` and ``min_wait``)."""
        if self.auto:
            want = min(max(recent_arrivals, default=0), int(pool_bytes * AUTO_POOL_FRACTION))
            if want * unmap_s_per_byte < self.min_wait:
                return 0  # made on demand, the room costs the arrival less than min_wait
        else:
            want = self.size
        return max(0, min(want, pool_bytes))


def room_hold(returns: int) -> float:
    """Seconds a client must have been idle before it is evicted for room (see the module doc)."""
    if returns <= 0:
        return 0.0
    return min(RETURN_HOLD * 2.0 ** (returns - 1), RETURN_HOLD_MAX)


def last_use(c: ClientState) -> float:
    """When the client last did something: its last run's end, or its last cell's end."""
    return max(c.last_active, c.idle_since)


def _evictable(c: ClientState) -> bool:
    """Idle, fully pre-copied memory on the GPU, and nothing else pending for it."""
    return (
        c.idle
        and c.holding != "revoking"
        and c.waiting_since is None
        and c.resident
        and not c.evict_pending
        and not c.room_tried
        and c.evictable > 0
        and c.precopied >= c.evictable
    )


def _short(dev: DeviceState, target: int) -> int:
    """Bytes missing from ``target`` once the evictions in flight are done."""
    if target <= 0 or any(c.waiting_since is not None for c in dev.clients.values()):
        return 0  # nobody to keep room for, or a waiter: admission makes the room it needs
    free = dev.pool_bytes - dev.resident_bytes + dev.incoming_bytes
    return max(0, target - free)


def _ready_at(c: ClientState) -> float:
    return last_use(c) + room_hold(c.room_returns)


def room_evictions(
    dev: DeviceState, target: int, now: float, decided: Iterable[Decision] = ()
) -> list[ClientState]:
    """The clients of ``dev`` to evict now so that ``target`` bytes of its pool are free.

    Least recently used first; ``decided`` are decisions already made in this pass (a client in
    them is left alone). Nothing is evicted while a client waits: admission then makes exactly
    the room the waiter needs.
    """
    short = _short(dev, target)
    if short <= 0:
        return []
    touched = {d.client for d in decided}
    ready = [
        c
        for c in dev.clients.values()
        if _evictable(c) and c.id not in touched and now >= _ready_at(c)
    ]
    ready.sort(key=lambda c: (last_use(c), c.seq))
    chosen: list[ClientState] = []
    for c in ready:
        if short <= 0:
            break
        chosen.append(c)
        short -= c.evictable
    return chosen


def room_deadline(dev: DeviceState, target: int, now: float) -> float | None:
    """The next time a held client of ``dev`` becomes evictable for missing room, or None."""
    if _short(dev, target) <= 0:
        return None
    times = [_ready_at(c) for c in dev.clients.values() if _evictable(c) and _ready_at(c) > now]
    return min(times, default=None)


def precopy_candidates(clients: Iterable[ClientState], decided: Iterable[Decision]) -> list[str]:
    """Which clients to ask for a pre-copy now, least recently used first.

    A pre-copy copies a client's resident memory to the host while it stays resident, so that
    evicting it later is an unmap (milliseconds) instead of a copy (seconds): the next arrival at
    a full GPU is granted as fast as the idle kernels can be unmapped. Worth it for a client that
    is idle (its cell ended: nothing will invalidate the copy soon), resident, not waiting, has
    memory that is not yet copied, was not asked in this idle period (the shim copies in the
    background and reports progress in MEMORY; memory it cannot pre-copy, such as the program's
    own managed memory, must not make the scheduler ask again and again), and has no other
    decision in this batch (one about to move or run it anyway). Least recently used first:
    those are the ones an arrival evicts first (:meth:`Policy._eviction_candidates`).
    """
    touched = {d.client for d in decided}
    chosen = [
        c
        for c in clients
        if c.idle
        and c.resident
        and c.waiting_since is None
        and not c.precopy_asked
        and not c.evict_pending
        and c.evictable > c.precopied
        and c.id not in touched
    ]
    chosen.sort(key=lambda c: (c.last_active, c.seq))
    return [c.id for c in chosen]
