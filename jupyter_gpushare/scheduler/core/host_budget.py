"""Host memory is a budget (docs/architecture.md, "Host memory is a budget").

Every client's memory engine holds host memory: staging for its resident blocks (made ahead, so
that an eviction copies at the bus's speed and a pre-copied one is an unmap) and the copies of
its evicted blocks. Left alone, each shim mirrored its whole device memory, and on an H200 (140
GiB card, 128 GiB of host RAM) three 60 GiB processes took the host to the kernel's OOM killer.
So the scheduler accounts host memory node-wide, as it accounts the card's, against one budget
(``PolicyConfig.host_budget``; 0: not accounted):

- **Held** is what the shims report (``host_bytes``), plus what evictions in flight will take.
- **A move never passes it.** Evicting ``X`` bytes of a client takes ``X`` less the staging it
  already holds for resident memory (``staging_bytes``: those blocks copy into it) of new host
  memory. An eviction that does not fit is not decided (:func:`fitting`): the waiter waits, and
  its status says why (:func:`full_text`).
- **Staging goes where moves are likely.** What the budget leaves beside the evicted memory is
  shared out as staging allowances (:func:`allowances`): idle kernels first, least recently used
  first (the ones an arrival evicts first), then the others; each shim makes staging up to its
  allowance and gives back the rest (``Staging``).
- **A waiter that can never fit** (its memory more than the pool and the budget together) is
  told so once, with one line its shim prints (``Refuse``).

Pure like the rest of the core: it reads the policy's records and returns decisions.
"""

from __future__ import annotations

from collections.abc import Iterable

from ...units import format_size
from .costs import BLOCK_BYTES
from .events import Refuse, Staging
from .policy_state import ClientState

__all__ = [
    "allowances",
    "fitting",
    "full_text",
    "host_need",
    "host_room",
    "refusals",
    "staging_decisions",
]

#: Allowances are whole units of the policy's asks, so a report that moves by a few bytes does
#: not send a new one.
UNIT = BLOCK_BYTES


def host_need(c: ClientState, nbytes: int) -> int:
    """New host memory an eviction of ``nbytes`` of ``c`` takes: what its staging for resident
    memory does not already hold."""
    return max(0, nbytes - c.staging)


def eviction_need(c: ClientState) -> int:
    """New host memory any eviction of ``c`` may take, partial or not: a partial one frees
    whole blocks, pre-copied then least recently used (docs/architecture.md, "Partial
    eviction"), which the policy does not see: one 60 GiB tensor goes whole for a 20 GiB ask,
    and its staging may be another block's. So it counts what evicting all of ``c`` takes."""
    return host_need(c, c.evictable)


def _in_flight(c: ClientState) -> int:
    """Bytes an eviction already decided for ``c`` will move (0: none in flight)."""
    if c.evict_pending or (c.holding == "revoking" and c.revoke_evict):
        return c.evictable  # whole blocks go: as much as all of it (eviction_need)
    return 0


def _pending(clients: Iterable[ClientState]) -> int:
    """Host memory the evictions in flight will take once their answers come."""
    return sum(host_need(c, _in_flight(c)) for c in clients)


def host_room(clients: Iterable[ClientState], budget: int) -> int:
    """Host memory left in the budget now, evictions in flight counted as done."""
    clients = list(clients)
    return budget - sum(c.host for c in clients) - _pending(clients)


def fitting(cands: Iterable[ClientState], room: int) -> list[ClientState]:
    """The candidates whose eviction fits the host room, taken in order (each one's need comes
    out of the room before the next is weighed). One that needs no more host memory (its staging
    holds it all) always fits, even on a node already past its budget."""
    out: list[ClientState] = []
    for c in cands:
        if (need := eviction_need(c)) <= max(0, room):
            out.append(c)
            room -= need
    return out


def _likely_to_move(c: ClientState) -> bool:
    """Idle: its cell ended (a holder that is idle, or a client neither holding nor waiting)."""
    if c.holding is not None:
        return c.holding == "running" and c.idle
    return c.waiting_since is None


def allowances(clients: Iterable[ClientState], budget: int) -> dict[str, int]:
    """Each client's staging allowance: the budget less the host memory that holds evicted data
    (and what evictions in flight will take), shared out idle kernels first, least recently
    used first, then the others; each gets at most its resident memory (rounded up to a unit).

    An allowance grows only into host memory that is free now: a client whose share fell may
    not have given its staging back yet, and the shims together must never hold more than the
    budget, not even for the moment between the two."""
    clients = list(clients)
    pending = _pending(clients)
    spare = budget - sum(max(0, c.host - c.staging) for c in clients) - pending
    free = budget - sum(c.host for c in clients) - pending
    order = sorted(clients, key=lambda c: (not _likely_to_move(c), c.last_active, c.seq))
    out: dict[str, int] = {}
    for c in order:
        resident = max(0, c.movable - c.away) if c.resident else 0
        want = -(-resident // UNIT) * UNIT
        give = max(0, min(want, spare // UNIT * UNIT))
        spare -= give
        if give > c.staging:  # more staging: only what is free now
            give = min(give, c.staging + max(0, free))
            free -= give - c.staging
        out[c.id] = give
    return out


def staging_decisions(clients: Iterable[ClientState], budget: int) -> list[Staging]:
    """A ``Staging`` for each client that reports its host memory and whose allowance changed."""
    clients = list(clients)
    out: list[Staging] = []
    for cid, give in allowances(clients, budget).items():
        c = next(x for x in clients if x.id == cid)
        if c.host_said and give != c.staging_allowed:
            c.staging_allowed = give
            out.append(Staging(c.id, give))
    return out


def refusals(clients: Iterable[ClientState], pool: int, budget: int) -> list[Refuse]:
    """A ``Refuse`` for each waiter whose memory is more than the pool and the host budget
    together (once per wait)."""
    out: list[Refuse] = []
    for c in clients:
        if c.waiting_since is None:
            c.refused = False
            continue
        if c.refused or c.used <= pool + budget:
            continue
        c.refused = True
        out.append(
            Refuse(
                c.id,
                f"this process's GPU memory ({format_size(c.used)}) can never fit: it is more "
                f"than the GPU's pool ({format_size(pool)}) and the node's host memory budget "
                f"for moved memory ({format_size(budget)}) together; free some of it, or ask "
                "the operator for a larger GPU or host budget",
            )
        )
    return out


def full_text(clients: Iterable[ClientState], budget: int, need: int | None) -> str | None:
    """Why a waiter waits for host memory, or None when it does not: ``need`` is the host memory
    past the budget's room that the smallest held-back eviction would take (None: none is held
    back)."""
    if need is None:
        return None
    clients = list(clients)
    held = sum(c.host for c in clients)
    idle = [c for c in clients if c.host > 0 and c.holding is None and c.waiting_since is None]
    n = len(idle)
    return (
        f"the node's host memory is full: {format_size(held)} of its {format_size(budget)} for "
        f"moved memory held by {n} idle notebook{'s' if n != 1 else ''}, and moving the memory "
        f"this kernel needs would take {format_size(need)} more"
    )
