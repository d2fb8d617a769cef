"""Restore ahead (issue 21, item 6): evicted memory back on the GPU before its owner's turn.

Pure rules beside the policy (:mod:`.policy`), like :mod:`.room`: the policy's client records in,
which clients to restore ahead out; no I/O and no clock of their own.

A kernel whose memory left the GPU pays its restore when its turn comes: a 0.04 s cell that
restores 24 GiB takes 0.55 s, and that is the tail of the notebook-shaped trace at 8 users
(docs/performance.md, section 8). When the pool has room that nobody else is owed, the restore
can happen *before* the turn, overlapping others' compute: the policy sends
:class:`~.events.RestoreAhead`, the shim brings its evicted blocks back while its launches stay
gated, and the grant that follows opens the gate at once.

**Only where it is cheap and safe** (:func:`ahead_choices`):

- the bytes fit the pool's free room, less the room kept for the next arrival (``keep_free``):
  nothing is evicted for a restore ahead, and the pool is never exceeded (the policy counts the
  bytes on the GPU from the decision on, as it counts a grant's);
- nothing is being moved out on the device (no eviction in flight or decided in this pass: that
  room is owed to someone);
- waiters first, in queue order, only the first :data:`AHEAD_DEPTH` (the head of the line, or
  near it: a waiter paused while shorter cells run); the head's room is never given to one
  behind it; then, once nobody waits, kernels that Jupyter says have a cell coming
  (:class:`~.events.Coming`, or a ``Busy`` of a kernel that holds nothing); then, once nobody
  waits, one idle kernel at a time whose memory left within :data:`IDLE_AHEAD_WINDOW` seconds
  of its last use, most recently used first (the likeliest to come back soonest).

**Copied again before it is cheap to take back.** A restore does not mark its blocks clean
(native/src/memory/move.c): restored memory has no current host copy, so evicting it again is a
copy until a pre-copy has run. The answer (:class:`~.events.Restored` with ``ahead``) says which
resident bytes are still clean, and the kernel may be asked for a pre-copy again in the same idle
period (:func:`on_ahead_restored`), after which the eviction rules find an idle, pre-copied kernel
whose memory leaves as an unmap. While its restore is in flight it is not evicted (the answer
ends that).
"""

from __future__ import annotations

from collections.abc import Iterable

from .events import Decision, Evict, Restored, Revoke
from .policy_state import ClientState, DeviceState

__all__ = [
    "AHEAD_DEPTH",
    "IDLE_AHEAD_WINDOW",
    "ahead_choices",
    "ahead_need",
    "on_ahead_restored",
    "start_ahead",
]

#: Waiters this close to the head of the line may be restored ahead.
AHEAD_DEPTH = 2
#: An idle kernel is restored ahead only if it was last used this many seconds ago or less: a
#: forgotten notebook's memory stays on the host (deep idle may put it to sleep).
IDLE_AHEAD_WINDOW = 600.0


def ahead_need(c: ClientState) -> int:
    """Bytes a restore ahead of ``c`` brings back (0: none to bring, or not now)."""
    if c.holding is not None or c.evict_pending or c.ahead_pending or c.ahead_short:
        return 0
    if not c.restore:
        return 0
    return max(0, c.used - c.on_gpu)


def _last_use(c: ClientState) -> float:
    return max(c.last_active, c.idle_since)


def ahead_choices(
    dev: DeviceState,
    queue: list[ClientState],
    target: int,
    now: float,
    decided: Iterable[Decision] = (),
) -> list[tuple[ClientState, int]]:
    """The clients of ``dev`` to restore ahead now, with the bytes each brings back.

    ``queue``: its waiters in priority order after this pass; ``target``: the room to keep free
    (keep_free); ``decided``: this pass's decisions (see the module doc).
    """
    decided = list(decided)
    if any(isinstance(d, Revoke | Evict) for d in decided) or dev.incoming_bytes > 0:
        return []  # room is being made for someone: it is theirs
    touched = {d.client for d in decided}
    room = dev.pool_bytes - dev.resident_bytes - max(0, target)
    chosen: list[tuple[ClientState, int]] = []
    for w in queue[:AHEAD_DEPTH]:
        need = ahead_need(w)
        if need <= 0 or w.id in touched:
            continue
        if need > room:
            break  # the head's room is not given to one behind it
        chosen.append((w, need))
        room -= need
    if queue:
        return chosen  # someone waits: what is left of the room is admission's
    rest = [
        c
        for c in dev.clients.values()
        if c.waiting_since is None and c.id not in touched and ahead_need(c) > 0
    ]
    rest.sort(key=lambda c: (not c.coming, -_last_use(c), c.seq))
    idle_in_flight = any(c.ahead_pending and not c.coming for c in dev.clients.values())
    for c in rest:
        need = ahead_need(c)
        stale = not c.idle or now - _last_use(c) > IDLE_AHEAD_WINDOW
        if need > room or (not c.coming and (idle_in_flight or stale)):
            continue
        chosen.append((c, need))
        room -= need
        idle_in_flight |= not c.coming  # one idle kernel at a time: the bus stays for others
    return chosen


def start_ahead(c: ClientState) -> None:
    """Account a RestoreAhead of ``c``: its memory counts on the GPU from now on."""
    c.ahead_pending = True
    c.resident = True
    c.away = 0
    c.stuck = 0
    c.evicted = 0
    c.restore = False


def on_ahead_restored(c: ClientState, evt: Restored) -> None:
    """The answer to a RestoreAhead: what stayed on the host (if the shim said) is away again,
    and the next grant restores it; the restored bytes have no host copy, so the kernel may be
    asked for a pre-copy again (.room.precopy_candidates asks once per idle period)."""
    if not c.ahead_pending:
        return  # a grant came first: it restored whatever stayed behind (and since, who knows)
    c.ahead_pending = False
    if evt.precopied >= 0:
        c.precopied = min(evt.precopied, c.movable)
    if evt.bytes_moved > 0:
        c.precopy_asked = False  # what came back is not copied: a pre-copy makes it an unmap
    left = min(evt.evicted_bytes, c.movable)
    if left > 0:  # the device had no room for the rest: asking again would answer the same
        c.ahead_short = True
        c.away = left
        c.evicted = left
        c.restore = True
