"""The fixed-quantum lock (``PolicyConfig.policy = "fixed-quantum"``): a baseline to measure the
gpushare policy against, kept apart from its rules (:mod:`.policy`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from .events import Decision, Grant, Revoke
from .idle_timer import found_idle
from .policy_config import PolicyConfig
from .policy_state import ClientState, DeviceState

__all__ = ["REASON_IDLE", "REASON_QUANTUM", "FixedQuantumLock"]

REASON_IDLE = "idle"
REASON_QUANTUM = "quantum expired"


class _PolicyParts(Protocol):
    """What the baseline uses of the policy it is part of (named here, not imported: the policy
    imports this module, and an import back would close a circle)."""

    config: PolicyConfig
    _clock: float

    def _grant(self, c: ClientState) -> Grant: ...
    def _revoke(self, c: ClientState, evict: bool, reason: str, nbytes: int = 0) -> Revoke: ...
    def _evict_for(
        self, cands: Iterable[ClientState], short: int, reason: str
    ) -> list[Decision]: ...
    def _eviction_candidates(
        self, dev: DeviceState, behind: Iterable[ClientState]
    ) -> list[ClientState]: ...


class FixedQuantumLock:
    """The baseline's admission, a part of :class:`~.policy.Policy`."""

    def _admit_fixed(self: _PolicyParts, dev: DeviceState) -> list[Decision]:
        """An exclusive lock, first come first served, with a fixed time quantum.

        One holder at a time. While others wait, the holder keeps the device for
        ``fixed_quantum`` seconds unless the timer (every ``idle_check_interval`` seconds from
        its grant) finds it idle; Jupyter's cell-end signal is not used at once. Memory moves as
        under the gpushare policy (the holder is evicted when the next one needs the room; idle
        clients are evicted least recently used first), so the comparison isolates the policy.
        """
        queue = sorted(
            (c for c in dev.clients.values() if c.waiting_since is not None),
            key=lambda c: (c.waiting_since, c.seq),
        )
        dev.turns = False
        if not queue:
            return []
        w = queue[0]
        need = w.used - w.on_gpu
        free = dev.pool_bytes - dev.resident_bytes
        holders = [c for c in dev.clients.values() if c.holding is not None]
        if holders:
            dev.turns = True
            out: list[Decision] = []
            for h in holders:
                if h.holding != "running":
                    continue
                if found_idle(h, self._clock, self.config.idle_check_interval):
                    out.append(self._revoke(h, need > free, REASON_IDLE))
                elif self._clock >= h.run_start + self.config.fixed_quantum:
                    out.append(self._revoke(h, need > free, REASON_QUANTUM))
            return out
        if w.evict_pending:
            return []  # its own eviction is in flight: grant it (with restore) after Evicted
        if need <= free:
            return [self._grant(w)]
        short = need - free - dev.incoming_bytes
        if short <= 0:
            return []  # the evictions in flight make the room
        out = self._evict_for(self._eviction_candidates(dev, queue[1:]), short, f"room for {w.id}")
        if not out and not any(c.evict_pending for c in dev.clients.values()):
            out.append(self._grant(w))  # nothing left to evict: run it alone (rule 5)
        return out
