"""The policy's view of each client and device: what :mod:`.policy` decides from.

Plain data, no rules: the scheduling policy (:mod:`.policy`) updates these records as events and
its own decisions come, and the status snapshot (:mod:`.policy_status`) reads them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from .costs import BUS_BPS, SLOWEST_MOVE_BPS, UNMAP_S_PER_GIB
from .ordering import CellService

__all__ = ["ARRIVAL_WINDOW", "ClientState", "DeviceState", "Holding", "Usage"]

Holding = Literal["running", "revoking"]

#: Weight of a new bandwidth sample in the moving average.
EWMA_ALPHA = 0.3
#: Moves smaller than this say more about latency than bandwidth; they do not update estimates.
MIN_SAMPLE_BYTES = 1 << 20
#: Recent arrivals remembered per device (keep_free "auto" estimates the next from them).
ARRIVAL_WINDOW = 8


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
    coming: bool = False  # Jupyter said a cell is coming (Coming, Busy) and it holds nothing
    hinted: bool = False  # a cell hint (Coming, .hints) asks its memory back: until its grant
    ahead_pending: bool = False  # a RestoreAhead was sent, the Restored answer has not come
    ahead_short: bool = False  # one came back short (no room on the device): not again until run
    room_tried: bool = False  # evicted for room (.room) in this idle period, refused or not
    room_evicted: bool = False  # its memory left for room and it has not run since
    room_returns: int = 0  # how often it came back after a room eviction (.room's hold)
    revoke_evict: bool = False  # the pending Revoke asked for eviction
    revoke_bytes: int = 0  # ... of this many bytes (policy_moves.ask)
    evict_asked: int = 0  # bytes the pending Evict is to free
    away: int = 0  # movable bytes evicted while the rest stayed (a partial eviction)
    # Movable bytes the shim did not move when asked (say, memory its engine cannot move): they
    # stay counted on the GPU and are not asked for again before the client's next grant.
    stuck: int = 0
    # Bytes its last Request said the driver refused beyond the pool's free room (Request.short):
    # its admission makes at least that much room, whatever the accounting says is free.
    short: int = 0
    # Growth in steps (.policy_moves.growth_room): how many times in a row it came back past its
    # room soon after a grant, and its last grant's time then.
    grow_streak: int = 0
    short_waits: bool = False  # ... and it waits for the room asked for it to arrive, once made
    cell_start: float | None = None  # when its current cell began (Busy, or a Request after idle)
    turn_s: float = 0.0  # EWMA of its cells' lengths (expected wait, .policy_moves)
    room: int | None = None  # the room_bytes of its current grant (None: no limit)
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
    # Its own moves' bandwidths (bytes/s; 0: none measured yet): what it reports sets its own
    # quantum and the cost of moving its memory, never another client's (A28).
    evict_bw: float = 0.0
    restore_bw: float = 0.0
    cell: CellService = field(default_factory=CellService)  # the interactive ordering's view
    # Host memory (.host_budget), as its shim last said: all its engine holds on the host, and
    # the part that is staging of resident memory; whether it says so at all (it then hears its
    # staging allowance), the allowance last told, and whether it was told it can never fit.
    host: int = 0
    staging: int = 0
    host_said: bool = False
    staging_allowed: int | None = None
    refused: bool = False

    @property
    def movable(self) -> int:
        """Bytes an eviction moves to the host (and a restore moves back)."""
        return max(0, self.used - self.pinned)

    @property
    def moving(self) -> bool:
        """An eviction or a restore ahead of it is in flight (it is not asked for another)."""
        return self.evict_pending or self.ahead_pending

    @property
    def deferred(self) -> int:
        """Bytes a holder allocated past its grant's room: the shim left them unbacked (they
        count as on the host in its report) and gives the device back to wait for room, so they
        are not on the GPU. Bounded by what the room leaves: a report cannot hide more of a
        holder's memory than lies past the room it was granted."""
        if self.holding is None or self.room is None:
            return 0
        return min(self.evicted, max(0, self.used - self.room))

    @property
    def on_gpu(self) -> int:
        """Bytes this client occupies on the GPU now (as the policy accounts them)."""
        return (
            self.used - min(self.away + self.deferred, self.movable)
            if self.resident
            else min(self.pinned, self.used)
        )

    @property
    def evictable(self) -> int:
        """Bytes an eviction of this client can free on the GPU now."""
        if not self.resident:
            return 0
        return max(0, self.movable - self.away - self.deferred - self.stuck)

    @property
    def state(self) -> str:
        if self.holding is not None:
            return self.holding
        if self.waiting_since is not None:
            return "waiting"
        return "evicting" if self.evict_pending else "idle"

    def measure(self, dev: DeviceState, direction: str, moved: int, micros: int) -> None:
        """Fold one of its reported moves into its own bandwidth estimate (an EWMA starting
        from the device's): the rate is a claim, cut to what the hardware can do (between
        :data:`~.costs.SLOWEST_MOVE_BPS` and :data:`~.costs.BUS_BPS`)."""
        if moved < MIN_SAMPLE_BYTES or micros <= 0:
            return
        rate = min(max(moved * 1e6 / micros, SLOWEST_MOVE_BPS), BUS_BPS)
        if direction == "evict":
            est = self.evict_bw or dev.evict_bw
            self.evict_bw = est + EWMA_ALPHA * (rate - est)
        else:
            est = self.restore_bw or dev.restore_bw
            self.restore_bw = est + EWMA_ALPHA * (rate - est)

    def bandwidths(self, dev: DeviceState) -> tuple[float, float]:
        """(evict, restore) bytes/s of its moves: its own measurements, else the device's."""
        return self.evict_bw or dev.evict_bw, self.restore_bw or dev.restore_bw

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
    # The configured estimates (measured on the GPU, .costs): clients' reports refine their own
    # (ClientState.measure), never these, so that no client's claim moves another's quantum.
    evict_bw: float
    restore_bw: float
    clients: dict[str, ClientState] = field(default_factory=dict)
    usage: dict[str, Usage] = field(default_factory=dict)
    turns: bool = False  # the last pass found a waiter blocked by running clients
    # Bytes recent grants brought onto the GPU, newest last: keep_free "auto" reads them (.room).
    arrivals: deque[int] = field(default_factory=lambda: deque(maxlen=ARRIVAL_WINDOW))
    # Seconds an eviction that copies nothing (pre-copied memory: an unmap) takes per byte freed
    # (EWMA; keep_free "auto" weighs room made ahead against it, .room).
    unmap_s_per_byte: float = UNMAP_S_PER_GIB / (1 << 30)

    @property
    def resident_bytes(self) -> int:
        """What the clients occupy on the GPU now, as the policy accounts it."""
        return sum(c.on_gpu for c in self.clients.values())

    @property
    def incoming_bytes(self) -> int:
        """Room that evictions already asked for will free when their answers come."""
        total = 0
        for c in self.clients.values():
            if c.evict_pending:
                total += min(c.evict_asked, c.evictable)
            elif c.holding == "revoking" and c.revoke_evict:
                total += min(c.revoke_bytes, c.evictable)
        return total

    def measure_unmap(self, moved: int, micros: int, freed: int) -> None:
        """Fold an eviction that copied nothing but freed ``freed`` bytes (an unmap of pre-copied
        memory) into the device's unmap estimate (EWMA). A report is cut to the slowest copy
        measured: an unmap is never slower, and one client's forged timing must not make the
        policy keep room ahead at others' cost (A28)."""
        if moved >= MIN_SAMPLE_BYTES or freed < MIN_SAMPLE_BYTES or micros <= 0:
            return
        rate = min(micros / 1e6 / freed, 1.0 / SLOWEST_MOVE_BPS)
        self.unmap_s_per_byte += EWMA_ALPHA * (rate - self.unmap_s_per_byte)
