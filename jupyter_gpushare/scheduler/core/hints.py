"""Cell hints (issue 35, item 1): the notebook says a cell is coming, its memory comes back first.

Pure rules beside the policy (:mod:`.policy`), like :mod:`.ahead` and :mod:`.room`: client records
and the event's time in, decisions' subjects out; no I/O and no clock of their own.

The tail of the notebook-shaped trace is a notebook restoring the memory that left while it was
idle, before its cell can run (docs/performance.md, section 8). A notebook knows a cell is coming
before the kernel does: the user focuses or edits a code cell of a kernel whose memory is away
(the lab extension's hint, ``POST gpushare/api/kernels/{id}/hint``), a cell is queued behind
another (the server extension's ``kernel_state coming``), an execute request arrives while the
kernel is paused. Each is a :class:`~.events.Coming`. With ``PolicyConfig.cell_hints`` on:

- the kernel's evicted memory is restored ahead (:mod:`.ahead`) even where restore ahead is off
  for everyone else, into room nobody waiting is owed;
- where the pool has no such room, idle kernels' pre-copied memory (it has a current host copy:
  leaving is an unmap of milliseconds, nothing is copied) is evicted to make it, least recently
  used first (:func:`hint_victims`; an idle kernel that still holds its grant is revoked with
  that eviction); busy kernels, waiters and kernels with a cell coming themselves are never
  touched, memory without a host copy never leaves for a hint, and nothing is evicted while
  anyone waits or while room is being made for someone;
- hints are per user and rate-limited (:class:`HintLimiter`, a token bucket): a user whose
  notebook hints more often than :attr:`CellHints.refill_s` allows has the extra hints ignored.

A wrong hint costs the bytes it moved back (and the unmaps it made, whose owners restore when
their own cell comes): the simulator measures it (docs/performance.md, "Cell hints").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .policy_state import ClientState, DeviceState

__all__ = ["REASON_HINT", "CellHints", "HintLimiter", "hint_victims"]

REASON_HINT = "room for a coming cell"


@dataclass(frozen=True)
class CellHints:
    """The policy's switch and limits for cell hints (c.GPUShareScheduler.cell_hints)."""

    on: bool = False  # off in the bare core; the scheduler turns it on
    burst: int = 3  # hints a user may send at once
    refill_s: float = 10.0  # ... and one more every this many seconds

    def __post_init__(self) -> None:
        if self.burst < 1 or self.refill_s <= 0:
            raise ValueError("cell hints: burst must be at least 1 and refill_s positive")


@dataclass
class HintLimiter:
    """A token bucket per user: :meth:`allow` says whether a hint at ``now`` is taken."""

    cfg: CellHints = field(default_factory=CellHints)
    _tokens: dict[str, tuple[float, float]] = field(default_factory=dict)  # user: (tokens, at)

    def allow(self, user: str, now: float) -> bool:
        tokens, at = self._tokens.get(user, (float(self.cfg.burst), now))
        tokens = min(float(self.cfg.burst), tokens + max(0.0, now - at) / self.cfg.refill_s)
        if tokens < 1.0:
            self._tokens[user] = (tokens, now)
            return False
        self._tokens[user] = (tokens - 1.0, now)
        return True


def hint_victims(
    dev: DeviceState, c: ClientState, need: int, room: int, queue: Iterable[ClientState]
) -> list[tuple[ClientState, int]]:
    """Idle clients of ``dev`` whose pre-copied memory to unmap so that ``need`` bytes of the
    hinted client ``c`` fit (``room``: the free room nobody else is owed), least recently used
    first, each with the bytes it gives (only what has a host copy: an unmap, nothing copied).
    Idle holders count (an idle kernel keeps its grant while nobody wants the device). Empty
    where the room is there already, where they could not make it all (a hint never evicts
    without restoring), or where someone waits or room is being made."""
    if need <= room or any(True for _ in queue) or dev.incoming_bytes > 0:
        return []
    cands = sorted(
        (
            v
            for v in dev.clients.values()
            if v is not c
            and (v.holding is None or (v.holding == "running" and v.idle))
            and v.waiting_since is None
            and v.idle
            and not v.coming
            and v.resident
            and not v.moving
            and min(v.evictable, v.precopied) > 0
        ),
        key=lambda v: (v.last_active, v.seq),
    )
    chosen: list[tuple[ClientState, int]] = []
    for v in cands:
        if room >= need:
            break
        give = min(v.evictable, v.precopied, need - room)
        chosen.append((v, give))
        room += give
    return chosen if room >= need else []
