"""The policy's moves outside a turn: room kept for the next arrival (:mod:`.room`), pre-copies of
idle kernels, restore ahead (:mod:`.ahead`) and cell hints (:mod:`.hints`). A part of
:class:`~.policy.Policy`, kept apart from its admission rules like :mod:`.policy_fixed`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from .ahead import ahead_choices, ahead_need, start_ahead
from .events import Decision, Evict, Precopy, RestoreAhead, Revoke
from .hints import REASON_HINT, HintLimiter, hint_victims
from .policy_config import PolicyConfig
from .policy_state import ClientState, DeviceState
from .room import REASON_ROOM, precopy_candidates, room_evictions

__all__ = ["MovesAhead"]


class _PolicyParts(Protocol):
    """What these rules use of the policy they are part of (named here, not imported: the policy
    imports this module)."""

    config: PolicyConfig
    _clock: float
    _clients: dict[str, ClientState]
    _hint_limiter: HintLimiter

    def recovering(self, now: float) -> bool: ...
    def _queue(self, dev: DeviceState, now: float) -> list[ClientState]: ...
    def _revoke(self, c: ClientState, evict: bool, reason: str, nbytes: int = 0) -> Revoke: ...
    def _evict(self, c: ClientState, reason: str, nbytes: int = 0) -> Evict: ...
    def _room_target(self, dev: DeviceState) -> int: ...
    def _restore_ahead(self, dev: DeviceState, decided: list[Decision]) -> list[Decision]: ...
    def _host_fit(self, cands: Iterable[ClientState]) -> list[ClientState]: ...


class MovesAhead:
    """Room, pre-copies, restore ahead and hints: a part of :class:`~.policy.Policy`."""

    def _restore_ahead(
        self: _PolicyParts, dev: DeviceState, decided: list[Decision]
    ) -> list[Decision]:
        """Evicted memory back before its owner's turn where the pool has room to spare (.ahead);
        with restore ahead off, only for kernels a cell hint said have a cell coming (.hints)."""
        cfg, now = self.config, self._clock
        hints = cfg.cell_hints.on and any(c.hinted for c in dev.clients.values())
        if not (cfg.restore_ahead or hints) or cfg.policy != "gpushare" or self.recovering(now):
            return []
        queue = self._queue(dev, now)
        choices = ahead_choices(dev, queue, self._room_target(dev), now, decided)
        if not cfg.restore_ahead:
            # only what a hint asked for (a Busy alone restores ahead only with restore_ahead)
            choices = [(c, need) for c, need in choices if c.hinted and c.waiting_since is None]
        for c, _need in choices:
            start_ahead(c)
            c.hinted = False  # one restore ahead per hint: a wrong one costs its bytes once
        return [RestoreAhead(c.id, need) for c, need in choices]

    def _on_coming(self: _PolicyParts, dev: DeviceState, c: ClientState) -> list[Decision]:
        """A cell is coming for ``c`` (:class:`~.events.Coming`): restore it ahead, evicting idle
        pre-copied kernels for its room when hints are on and its user is within its rate."""
        c.coming = c.holding is None
        hints = self.config.cell_hints
        if not (hints.on and c.coming and self.config.policy == "gpushare"):
            return self._restore_ahead(dev, [])
        if self.recovering(self._clock) or not self._hint_limiter.allow(c.user, self._clock):
            c.coming = False  # over its rate: as if it had not hinted (a Busy sets it again)
            return []
        c.hinted = True
        need = ahead_need(c)
        queue = self._queue(dev, self._clock)
        room = dev.pool_bytes - dev.resident_bytes - max(0, self._room_target(dev))
        victims = hint_victims(dev, c, need, room, queue) if need > 0 else []
        fits = {v.id for v in self._host_fit(v for v, _ in victims)}  # the node's host budget
        victims = [(v, give) for v, give in victims if v.id in fits]
        if not victims:
            return self._restore_ahead(dev, [])
        # Its restore ahead follows their answers (Evicted, Released: the next pass).
        return [
            self._revoke(v, True, REASON_HINT, give)
            if v.holding is not None
            else self._evict(v, REASON_HINT, give)
            for v, give in victims
        ]

    def _room_target(self: _PolicyParts, dev: DeviceState) -> int:
        """Bytes to keep free on ``dev`` now (0: none), see .room."""
        keep = self.config.keep_free
        if not keep.on or self.config.policy != "gpushare" or self.recovering(self._clock):
            return 0
        return keep.target(dev.pool_bytes, dev.arrivals, dev.unmap_s_per_byte)

    def _keep_room(self: _PolicyParts, dev: DeviceState, decided: list[Decision]) -> list[Decision]:
        """Evict idle, pre-copied clients until the room for the next arrival is free (.room)."""
        target = self._room_target(dev)
        if target <= 0:
            return []
        out: list[Decision] = []
        for c in self._host_fit(room_evictions(dev, target, self._clock, decided)):
            c.room_tried = True
            c.room_evicted = True
            # An idle holder keeps its grant while nobody wants the device: revoke it, evicting.
            held = c.holding is not None
            out.append(self._revoke(c, True, REASON_ROOM) if held else self._evict(c, REASON_ROOM))
        return out

    def _precopy(self: _PolicyParts, dev: DeviceState, decided: list[Decision]) -> list[Decision]:
        out: list[Decision] = []
        clients = [c for c in self._clients.values() if c.device == dev.uuid]
        for cid in precopy_candidates(clients, decided):
            self._clients[cid].precopy_asked = True
            out.append(Precopy(cid))
        return out
