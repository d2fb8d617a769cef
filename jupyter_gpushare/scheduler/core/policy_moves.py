"""What the policy moves, and what moving it costs: partial eviction, cost-aware choice and the
room a grant may use. Pure rules beside :mod:`.policy` (client records in, numbers out).

**Partial eviction.** To make room for X bytes the policy evicts X, not whole kernels: each
candidate in turn is asked for ``min(still missing, what it has on the GPU)`` (:func:`ask`),
rounded up to the engine's block (:data:`~.costs.BLOCK_BYTES`), so the room asked for is at
least what is missing and at most one block more. The shim frees pre-copied blocks first, then
the least recently used ones, and a later grant restores only what left.

**Candidates, cheapest first** (:func:`order_candidates`): idle kernels whose memory is
pre-copied (an unmap), then other idle kernels, least recently used first, then the paused
kernels behind the waiter being served, least recently run first.

**Cost-aware choice** (:func:`worth_evicting`): a busy holder is evicted for a waiter only when
the cell it runs is expected to last longer than the move would take (evicting the bytes and
restoring them): otherwise the waiter waits for the cell. The expected remaining time comes from
what the policy saw: the EWMA of the kernel's past cells (``turn_s``) less what the current one
has run, or, once the current cell has outlived that (or with no history), as long again as it
has run (a cell that has run long tends to run long).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .costs import BLOCK_BYTES, restore_seconds
from .events import Decision, Evict, Revoke
from .policy_state import ClientState, DeviceState

__all__ = [
    "ask",
    "count_evicted",
    "expected_left",
    "freed_by",
    "growth_room",
    "move_seconds",
    "new_rooms",
    "note_growth",
    "order_candidates",
    "room_for",
    "worth_evicting",
]

#: Weight of a finished cell in a kernel's typical cell length.
TURN_ALPHA = 0.3


def ask(c: ClientState, short: int) -> int:
    """Bytes to ask ``c`` to free for ``short`` missing bytes (its whole part when less)."""
    have = c.evictable
    if short >= have:
        return have
    blocks = -(-max(0, short) // BLOCK_BYTES)
    return min(have, blocks * BLOCK_BYTES)


def count_evicted(c: ClientState, nbytes: int = 0, total: int = -1, moved: int = 0) -> None:
    """``nbytes`` of ``c``'s memory left the GPU (0, or all it had there: everything).

    ``total``, when the shim said it: its evicted bytes now, which stand for the ask (a shim may
    free more than asked, up to everything). ``moved``: what this move copied to the host. That
    has left the GPU whatever the total says: a total short of it (a shim whose count lost the
    resident blocks the program freed, memory/vmm.c before the fix) made the rest look like
    memory that cannot move, and rule 5 granted a waiter beside it, over the pool (H100,
    tests/gpu/test_gpu_captures.py).
    """
    if total >= 0 and c.resident:
        total = max(total, c.away + moved)
    if total >= 0 and c.resident and total < c.movable:
        gone = max(0, total - c.away)
        # Pre-copied blocks leave first, but the shim's MEMORY report before its answer
        # (client/lifecycle.c) already said its pre-copied bytes without the blocks it counts
        # as evicted (c.evicted): only what left since then comes off them. Taken off twice,
        # a partly evicted idle kernel's pre-copy read 0 for the rest of its idle period, and
        # it was not asked again (the stand-in replay's warm start never settled).
        unseen = max(0, total - max(c.away, c.evicted))
        c.away += gone
        c.evicted = c.away
        c.precopied = max(0, c.precopied - unseen)
        c.restore = c.restore or c.away > 0
        if nbytes == 0 or gone < nbytes:
            # It moved less than asked: the rest cannot move now. Asking again at once
            # would answer the same, on every event (an EVICT storm on the H100).
            c.stuck = max(0, c.movable - c.away)
        return
    if total >= 0:
        nbytes = 0  # all of it
    c.restore = True
    if c.resident and 0 < nbytes < c.evictable:  # a partial eviction: the rest stays
        c.away += nbytes
        c.evicted = c.away
        c.precopied = max(0, c.precopied - nbytes)  # pre-copied blocks leave first
        return
    c.resident = False
    c.away = 0
    c.evicted = c.managed
    c.precopied = 0  # nothing resident left to have a copy of


def order_candidates(
    idle: list[ClientState], paused: Iterable[ClientState], now: float | None = None
) -> list[ClientState]:
    """Idle pre-copied first, then idle least recently used, then ``paused`` as given.

    With ``now`` (cost-aware), by the harm a byte's move does instead: a byte moved out comes
    back before the kernel's next run, so the move weighs least on the longest cell. Kernels
    whose cell is expected to last longest give first (a paused kernel: its expected rest,
    :func:`expected_left`; an idle one: its typical cell, unknown counting as the shortest),
    then the order above.
    """
    idle = sorted(idle, key=lambda c: (c.precopied < c.evictable, c.last_active, c.seq))
    ordered = idle + list(paused)
    if now is None:
        return ordered
    rank = {c.id: i for i, c in enumerate(ordered)}

    def length(c: ClientState) -> float:
        if c.waiting_since is not None and c.cell_start is not None:
            return expected_left(c, now)
        return c.turn_s

    return sorted(ordered, key=lambda c: (-length(c), rank[c.id]))


def note_cell_end(c: ClientState, now: float) -> None:
    """A cell ended: fold its length into the kernel's typical cell length."""
    if c.cell_start is None:
        return
    length = max(0.0, now - c.cell_start)
    c.turn_s = length if c.turn_s <= 0 else c.turn_s + TURN_ALPHA * (length - c.turn_s)
    c.cell_start = None


def expected_left(c: ClientState, now: float) -> float:
    """Seconds the current cell of ``c`` is expected to run on (see the module docstring)."""
    start = c.run_start if c.cell_start is None else max(c.cell_start, c.run_start)
    ran = max(0.0, now - start)
    if c.turn_s > ran:
        return c.turn_s - ran
    return ran


def move_seconds(dev: DeviceState, nbytes: int, c: ClientState | None = None) -> float:
    """Evicting ``nbytes`` (of ``c``) now and restoring them later, at the estimated bandwidths
    (``c``'s own measured ones where it has them, else the device's)."""
    evict_bw, restore_bw = (dev.evict_bw, dev.restore_bw) if c is None else c.bandwidths(dev)
    return nbytes / evict_bw + restore_seconds(nbytes, restore_bw)


def worth_evicting(dev: DeviceState, h: ClientState, nbytes: int, now: float) -> bool:
    """Whether evicting ``nbytes`` of the busy holder ``h`` beats waiting for its cell."""
    return expected_left(h, now) > move_seconds(dev, nbytes, h)


#: A holder back past its room within this long of its grant is growing in steps (seconds).
GROWTH_WINDOW = 2.0


def note_growth(c: ClientState, now: float) -> None:
    """``c`` gave the device back because an allocation went past its room (deferred memory)."""
    c.grow_streak = c.grow_streak + 1 if now - c.run_start <= GROWTH_WINDOW else 1


def growth_room(w: ClientState, need: int, cands: Iterable[ClientState]) -> int:
    """The room to make for ``w`` beyond what it misses now, when it is growing in steps.

    A program that allocates in a loop (PyTorch filling 80 GiB in 1 GiB tensors) goes past its
    room once per step, each a round trip through the scheduler and an eviction of its own: on
    an H200 beside an idle 80 GiB notebook the newcomer's 80 GiB took 56 round trips and 5.5 s
    where alone it took under a second (2026-12-02). So the room asked doubles with each step
    that comes back within GROWTH_WINDOW of its grant (1, 2, 4, ... times what it misses now),
    a handful of round trips for any size; only idle kernels' memory is taken for the extra,
    never a paused or busy kernel's. 0 for a kernel not growing.
    """
    if w.grow_streak <= 1 or need <= 0:
        return 0
    idle = sum(c.evictable for c in cands if c.idle and c.waiting_since is None)
    return min(need << min(w.grow_streak - 1, 20), idle)


def freed_by(decisions: Iterable[Decision], clients: Mapping[str, ClientState]) -> int:
    """The device bytes ``decisions`` free once answered (evictions and evicting revokes)."""
    total = 0
    for d in decisions:
        c = clients.get(d.client)
        if isinstance(d, Evict) and c is not None:
            total += c.evict_asked
        elif isinstance(d, Revoke) and d.evict and c is not None:
            total += c.revoke_bytes
    return total


def room_for(dev: DeviceState, c: ClientState) -> int:
    """The most device memory ``c`` may hold backed now: the pool less what every other kernel
    holds on the GPU, idle ones included.

    An idle kernel's memory can leave for ``c``, but it is room only once it has left: counted as
    free, the shim backed a new 80 GiB allocation beside an idle 80 GiB notebook at the default
    pool (the whole card) and the driver answered out of memory (H200, e5353ea). Past this room
    the shim leaves the allocation unbacked and asks again, and admission evicts the idle
    kernels (pre-copied first) to make the room.
    """
    others = sum(o.on_gpu for o in dev.clients.values() if o is not c)
    return dev.pool_bytes - others


def new_rooms(dev: DeviceState) -> list[ClientState]:
    """Holders on ``dev`` whose room changed since their grant or their last Room (the kernels
    beside them started or ended a cell, or their memory came or left), each one's ``room`` set
    to the new one: :func:`room_for`, never less than what it holds on the GPU."""
    out: list[ClientState] = []
    for c in dev.clients.values():
        if c.holding != "running" or c.room is None:
            continue
        room = max(c.used - c.deferred, room_for(dev, c))
        if room != c.room:
            c.room = room
            out.append(c)
    return out
