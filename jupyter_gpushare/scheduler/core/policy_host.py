"""The host budget's part of the policy (:class:`HostBudgetRules`, a part of
:class:`~.policy.Policy`): its events, its checks on every eviction the policy decides, and its
decisions. The rules themselves are in :mod:`.host_budget`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from .events import Decision, HostMemory
from .host_budget import (
    eviction_need,
    fitting,
    full_text,
    host_room,
    refusals,
    staging_decisions,
)
from .policy_config import PolicyConfig
from .policy_state import ClientState, DeviceState

__all__ = ["HostBudgetRules"]


class _PolicyParts(Protocol):
    """What the host budget's rules use of the policy they are part of."""

    config: PolicyConfig
    _clients: dict[str, ClientState]
    _devices: dict[str, DeviceState]

    def _schedule(self, dev: DeviceState) -> list[Decision]: ...
    def _host_full(self, dev: DeviceState) -> str | None: ...


def _on(p: _PolicyParts) -> bool:
    return p.config.host_budget > 0 and p.config.policy == "gpushare"


def _room(p: _PolicyParts, but: ClientState | None = None) -> int:
    """The host room, ``but``'s own eviction (being decided) not counted as in flight."""
    clients = p._clients.values()
    room = host_room([c for c in clients if c is not but], p.config.host_budget)
    return room - (but.host if but is not None else 0)


class HostBudgetRules:
    """Host memory as a node-wide budget (``PolicyConfig.host_budget``; 0: off)."""

    def _on_host(self: _PolicyParts, c: ClientState, evt: HostMemory) -> list[Decision]:
        """A shim said what its engine holds on the host. When that fell (staging given back,
        a client's evicted memory restored and released), a waiter that waited for host room
        may fit now: every device is scheduled again."""
        before = c.host
        c.host = max(0, evt.host)
        c.staging = min(max(0, evt.staging), c.host)
        c.host_said = True
        if not _on(self) or c.host >= before:
            return []
        return [d for dev in self._devices.values() for d in self._schedule(dev)]

    def _host_fit(self: _PolicyParts, cands: Iterable[ClientState]) -> list[ClientState]:
        """The eviction candidates whose eviction fits the host budget (all when it is off)."""
        if not _on(self):
            return list(cands)
        return fitting(cands, _room(self))

    def _host_cap(self: _PolicyParts, c: ClientState, nbytes: int) -> int:
        """``nbytes`` when an eviction of ``c`` fits the host budget, else 0 (.host_budget's
        eviction_need: any eviction of it counts as all of it)."""
        if not _on(self) or eviction_need(c) <= max(0, _room(self, but=c)):
            return nbytes
        return 0

    def _host_decisions(self: _PolicyParts) -> list[Decision]:
        """Refusals of waiters that can never fit, then the staging allowances that changed."""
        if not _on(self):
            return []
        budget = self.config.host_budget
        out: list[Decision] = []
        for dev in self._devices.values():
            out += refusals(dev.clients.values(), dev.pool_bytes, budget)
        return out + staging_decisions(self._clients.values(), budget)

    def host_snapshot(self: _PolicyParts) -> dict[str, Any]:
        """The node's host memory for the status document: the budget (0: not accounted),
        what the clients hold on the host together, and by whom (per user, idle clients)."""
        clients = list(self._clients.values())
        by_user: dict[str, int] = {}
        for c in clients:
            if c.host:
                by_user[c.user] = by_user.get(c.user, 0) + c.host
        idle = [c for c in clients if c.host and c.holding is None and c.waiting_since is None]
        return {
            "budget_bytes": self.config.host_budget,
            "held_bytes": sum(c.host for c in clients),
            "staging_bytes": sum(c.staging for c in clients),
            "idle_holders": len(idle),
            "by_user": by_user,
        }

    def _host_holds(self: _PolicyParts, dev: DeviceState, w: ClientState) -> bool:
        """Whether the host budget keeps ``w`` from being granted alone (rule 5): memory that
        could make its room stays on the device for want of host room, or ``w`` can never fit
        (more than the pool and the budget: it is refused instead)."""
        if not _on(self):
            return False
        never = w.used > dev.pool_bytes + self.config.host_budget
        return never or self._host_full(dev) is not None

    def _host_full(self: _PolicyParts, dev: DeviceState) -> str | None:
        """Why the waiters of ``dev`` wait for host memory (None: they do not): idle memory
        there could make room, but its eviction does not fit the host budget."""
        if not _on(self) or dev.incoming_bytes:
            return None
        if not any(c.waiting_since is not None for c in dev.clients.values()):
            return None
        room = _room(self)
        needs = [
            eviction_need(c)
            for c in dev.clients.values()
            if c.holding is None and c.waiting_since is None and c.resident and c.evictable > 0
        ]
        blocked = [n for n in needs if n > max(0, room)]
        need = min(blocked) - max(0, room) if blocked else None
        return full_text(self._clients.values(), self.config.host_budget, need)
