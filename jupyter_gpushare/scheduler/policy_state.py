"""The policy's view of each client and device: what :mod:`.policy` decides from.

Plain data, no rules: the scheduling policy (:mod:`.policy`) updates these records as events and
its own decisions come, and the status snapshot (:mod:`.policy_status`) reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .ordering import CellService

__all__ = ["ClientState", "DeviceState", "Holding", "Usage"]

Holding = Literal["running", "revoking"]


@dataclass
class Usage:
    """A user's GPU-seconds on one device, decaying with a half-life (for fair share)."""

    value: float = 0.0
    stamp: float = 0.0

    def at(self, now: float, half_life: float) -> float:
        if half_life <= 0:
            return self.value
        return self.value * 0.5 ** (max(0.0, now - self.stamp) / half_life)

    def add(self, seconds: float, now: float, half_life: float) -> None:
        self.value = self.at(now, half_life) + seconds
        self.stamp = max(self.stamp, now)


@dataclass
class ClientState:
    id: str
    device: str
    user: str
    seq: int  # join order: the last tie-breaker, so every ordering is deterministic
    weight: float = 1.0
    quota: int = 0
    uid: int = -1
    pid: int = 0
    label: str = ""
    # memory as last reported (bytes)
    used: int = 0
    managed: int = 0
    pinned: int = 0
    evicted: int = 0
    # scheduling state
    holding: Holding | None = None
    waiting_since: float | None = None
    evict_pending: bool = False  # an Evict was sent, the Evicted answer has not come
    precopy_asked: bool = False  # a Precopy was sent in this idle period
    precopied: int = 0  # resident bytes with a current host copy, as last reported
    revoke_evict: bool = False  # the pending Revoke asked for eviction
    resident: bool = False  # its managed memory is on the GPU (it ran, and was not evicted since)
    restore: bool = False  # its managed memory was evicted: the next grant restores it
    idle: bool = False  # Idle seen since the last Busy/Request
    idle_since: float = 0.0  # when ``idle`` last became True (the fixed-quantum timer reads it)
    run_start: float = 0.0
    grew_at: float = float("-inf")  # when its footprint last increased (growth relief's key)
    last_active: float = 0.0  # end of its last run (or its join): the LRU key for eviction
    resume_since: float | None = None  # reconnected: its next Request queues from this time
    revoked_at: float = 0.0  # when the pending Revoke was decided (how long it goes unanswered)
    # accounting
    gpu_seconds: float = 0.0
    wait_seconds: float = 0.0
    last_restore: tuple[int, float] | None = None  # (bytes, seconds) of its last restore
    cell: CellService = field(default_factory=CellService)  # the interactive ordering's view

    @property
    def movable(self) -> int:
        """Bytes an eviction moves to the host (and a restore moves back)."""
        return max(0, self.used - self.pinned)

    @property
    def on_gpu(self) -> int:
        """Bytes this client occupies on the GPU now (as the policy accounts them)."""
        return self.used if self.resident else min(self.pinned, self.used)

    @property
    def state(self) -> str:
        if self.holding is not None:
            return self.holding
        if self.waiting_since is not None:
            return "waiting"
        return "evicting" if self.evict_pending else "idle"

    def set_memory(self, used: int, managed: int, pinned: int, evicted: int) -> None:
        self.used = max(0, used)
        self.managed = max(0, managed)
        self.pinned = min(max(0, pinned), self.used)
        self.evicted = max(0, evicted)


@dataclass
class DeviceState:
    uuid: str
    name: str
    total_bytes: int
    pool_bytes: int
    evict_bw: float
    restore_bw: float
    clients: dict[str, ClientState] = field(default_factory=dict)
    usage: dict[str, Usage] = field(default_factory=dict)
    turns: bool = False  # the last pass found a waiter blocked by running clients
