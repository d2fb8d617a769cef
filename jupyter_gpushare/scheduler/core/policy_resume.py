"""A shim reconnecting after the scheduler was lost (:class:`Resume`, a part of
:class:`~.policy.Policy`): what it says it had, taken back as far as the recovery window lets
it (docs/reliability.md)."""

from __future__ import annotations

from typing import Protocol

from .events import Decision, Grant, Join
from .policy_moves import count_evicted
from .policy_state import ClientState, DeviceState

__all__ = ["Resume"]


class _PolicyParts(Protocol):
    """What the resume rules use of the policy they are part of."""

    _clock: float

    def recovering(self, now: float) -> bool: ...


class Resume:
    """Rebuilding a reconnecting client's state."""

    def _resume(self: _PolicyParts, dev: DeviceState, c: ClientState, evt: Join) -> list[Decision]:
        """A shim reconnecting after the scheduler was lost: take back what it says it had.

        Its memory is taken as reported; managed memory not on the host is resident if it ever
        held the device. A holder keeps the device when it fits beside the holders already resumed
        (the first to reconnect always does: it held the device before, and nobody else holds
        it yet); one that does not fit loses the grant and queues first among its peers, from
        the moment of its old grant. A waiter queues from the moment it began to wait.

        Claims to a grant or to an old place in the queue are believed only during a recovery
        window (:meth:`recover_until`, opened when the scheduler restarts with clients to take
        back): at any other time they would let a new client jump the queue.
        """
        if evt.used >= 0:
            c.set_memory(evt.used, evt.managed, evt.pinned, evt.evicted)
            # Resident if it ever ran (memory nobody touched has no pages on the GPU).
            ran = evt.gpu_seconds > 0 or evt.resume == "holding"
            c.resident = ran and c.managed > 0 and evt.evicted == 0
            if 0 < evt.evicted < c.movable:
                # a partial eviction before the restart: the rest is on the GPU (it ran)
                c.resident, c.away, c.evicted, c.restore = True, evt.evicted, evt.evicted, True
            elif evt.evicted > 0:
                count_evicted(c)
        c.gpu_seconds = max(0.0, evt.gpu_seconds)
        if not self.recovering(self._clock):
            return []
        since = self._clock - max(0.0, evt.since)
        if evt.resume == "holding":
            held = sum(h.used for h in dev.clients.values() if h.holding is not None)
            if held == 0 or held + c.used <= dev.pool_bytes:
                c.holding = "running"
                c.run_start = since
                c.resident = True
                c.restore = False
                return [Grant(c.id, restore=False)]
        if evt.resume in ("holding", "waiting"):
            c.resume_since = since
        return []
