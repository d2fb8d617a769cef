"""The scheduling policy: a pure state machine, events in, decisions out.

One :class:`Policy` serves every GPU of a node; each device is an independent queue and a client
belongs to the device named in its :class:`~.events.Join`. The policy does no I/O, reads no clock
and draws no random numbers: time comes only from the events' ``now``. That makes it the same
object in the live daemon, in property-based tests and in a trace-replaying simulator.

The rules, in the order a scheduling pass applies them (:meth:`Policy._schedule`):

1. **Growth relief.** Clients that run side by side were admitted because their footprints fit
   the pool. If one of them grows and the running set no longer fits, the longest-running holders
   are revoked (with eviction) until it fits again or one is left: the newest holder has had the
   least of its turn. If memory left resident by idle clients is what overflows, the least recently
   used idle clients are evicted. Nothing else is evicted without a need for the room, but for
   the room kept free for the next arrival (``keep_free``, :mod:`.room`): while nobody waits,
   idle clients whose memory has a host copy are evicted (an unmap), least recently used first.
2. **Admission.** Waiters are taken in priority order (:meth:`Policy._queue`). A waiter whose
   footprint fits the free room is granted at once (side by side); ``restore`` is set when its
   memory was evicted. One that would fit after evicting idle clients (least recently used first,
   then lower-priority waiters' resident memory) gets those evictions and waits for the answers;
   the room they free is reserved for it.
3. **Turns.** The first waiter that cannot fit even then is *blocked* by running clients: the
   device is in ``turns`` mode. Holders that are idle (their cell finished) are revoked at once;
   holders past a full quantum (or on a higher level than a short cell's, .policy_short) with
   eviction, oldest run first, only as many as the blocked waiter needs. The quantum grows,
   ``clamp(base, move_factor * (movable/evict_bw + movable/restore_bw), max)``, so that moving
   memory out and back never takes more than ``1/move_factor`` of a turn. The bandwidths are the
   client's own, measured from its reports (each cut to what the hardware can do) once it has
   any, else the device's configured estimates: no client's report moves another's quantum.
4. **No starvation.** Once the blocked waiter has waited one ``base_quantum`` it *reserves*: no
   waiter behind it is admitted, so small late-comers cannot keep a large waiter out forever.
   Waiters order by fair share (lowest decayed per-user GPU-seconds / weight first, waiters Jupyter
   calls idle after busy ones, then first come first served) until they have waited
   ``max_quantum``; from then on they are *overdue* and served first, in arrival order, ahead of
   fair share, after short cells only (.policy_short). A waiter is thus granted within about
   (clients + 1) * max_quantum of contention, each cell passing it for ``first_level`` at most.
5. **Last resort.** A waiter that cannot fit even with every other client evicted is granted
   alone once nobody holds the device and no eviction (or restore ahead) is in flight.

Residency follows the policy's decisions and their answers (Grant: resident; Released(evicted),
Evicted: restore at the next grant), not the displayed ``evicted`` counters. A footprint is
``used`` while resident, else ``pinned``; a client that never held the device is not resident.
``policy="fixed-quantum"``: a baseline lock replaces rules 2-5 (:mod:`.policy_fixed`).
``restore_ahead``: evicted memory goes back before a turn, into room nobody is owed (:mod:`.ahead`);
``cell_hints``: a kernel the notebook says has a cell coming gets it back, idle pre-copied memory
unmapped for its room (:mod:`.hints`; room, pre-copies, restore ahead and hints: .policy_ahead).
``host_budget``: no move passes the node's host budget; staging idle first (:mod:`.host_budget`).
``room_updates``: holders hear their grant's room change (:class:`~.events.Room`); memory past it
waits unbacked, off the GPU's count (``ClientState.deferred``), while its shim asks again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .ahead import on_ahead_restored
from .events import (
    AdminRelease,
    Busy,
    Coming,
    Decision,
    Event,
    Evict,
    Evicted,
    Grant,
    HostMemory,
    Idle,
    Join,
    Leave,
    Memory,
    Precopied,
    Released,
    Request,
    Restored,
    Revoke,
    Room,
    SetQuota,
    SetWeight,
    Tick,
)
from .hints import HintLimiter
from .idle_timer import next_idle_check
from .ordering import Ordering
from .overload import capped_swap, overload_window, swap_deadlines
from .policy_ahead import MovesAhead
from .policy_config import POLICIES, PolicyConfig
from .policy_fixed import REASON_IDLE, REASON_QUANTUM, FixedQuantumLock
from .policy_host import HostBudgetRules
from .policy_moves import (
    ask,
    count_evicted,
    freed_by,
    growth_room,
    new_rooms,
    note_cell_end,
    note_growth,
    order_candidates,
    room_for,
    worth_evicting,
)
from .policy_resume import Resume
from .policy_short import preempts, queue_key
from .policy_state import ClientState, DeviceState, Usage
from .policy_status import DeviceFacts, device_status
from .room import precopy_candidates, room_deadline

__all__ = ["POLICIES", "Policy", "PolicyConfig", "precopy_candidates"]

REASON_GREW = "memory grew past the pool"
REASON_PRESSURE = "memory pressure"
REASON_ADMIN = "released by request"
REASON_ORDER = "paused: shorter cells first"


class Policy(FixedQuantumLock, HostBudgetRules, Resume, MovesAhead):
    """Decides who uses each GPU; see the module docstring for the rules."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self._order = Ordering(self.config.ordering)
        self._devices: dict[str, DeviceState] = {}
        self._clients: dict[str, ClientState] = {}
        self._now: float | None = None
        self._seq = 0
        self._recover_until: float | None = None  # see recover_until()
        self._hint_limiter = HintLimiter(self.config.cell_hints)  # per user (.hints)

    # ----------------------------------------------------------------------------------------
    # Public API

    def add_device(self, uuid: str, *, name: str = "", total_bytes: int, pool_bytes: int) -> None:
        """Register a device, or update its name and sizes if it is known (idempotent)."""
        dev = self._devices.get(uuid)
        if dev is None:
            self._devices[uuid] = DeviceState(
                uuid,
                name,
                total_bytes,
                pool_bytes,
                self.config.evict_bandwidth,
                self.config.restore_bandwidth,
            )
            return
        dev.name = name or dev.name
        dev.total_bytes = total_bytes
        dev.pool_bytes = pool_bytes

    def handle(self, event: Event) -> list[Decision]:
        """Apply one event; return what the shell must tell the clients, in order."""
        decisions = self._handle(event)
        if self.config.room_updates and self.config.policy == "gpushare":
            decisions += [Room(c.id, c.room) for d in self._devices.values() for c in new_rooms(d)]
        return decisions + self._host_decisions()  # the node's host budget (.host_budget)

    def _handle(self, event: Event) -> list[Decision]:
        self._advance(event.now)
        if isinstance(event, Tick):
            out: list[Decision] = []
            for dev in self._devices.values():
                decided = self._schedule(dev)
                out += decided + self._keep_room(dev, decided)
            return out
        if isinstance(event, Join):
            return self._on_join(event)
        client = self._clients.get(event.client)
        if client is None:
            return []  # the shell may race with a disconnect: an unknown client is no error
        if isinstance(event, HostMemory):
            return self._on_host(client, event)
        dev = self._devices[client.device]
        if isinstance(event, Request | Memory) and event.used > client.used:
            client.grew_at = self._clock
        if isinstance(event, Request):
            self._on_request(client, event)
            client.precopied = 0  # it is about to run: the host copy goes stale
            client.precopy_asked = False
            client.room_tried = False
        elif isinstance(event, Memory):
            client.set_memory(event.used, event.managed, event.pinned, event.evicted)
            client.precopied = event.precopied
        elif isinstance(event, Released):
            self._on_released(dev, client, event)
        elif isinstance(event, Evicted):
            self._on_evicted(dev, client, event)
        elif isinstance(event, Precopied):
            client.precopied = event.precopied
            return self._keep_room(dev, [])  # a complete copy makes it evictable for room
        elif isinstance(event, Restored):
            client.measure(dev, "restore", event.bytes_moved, event.micros)
            if event.ahead:  # its room is settled now: the pass may use what stayed free
                on_ahead_restored(client, event)
            else:
                client.evicted = 0
                client.last_restore = (max(0, event.bytes_moved), max(0, event.micros) / 1e6)
                return []
        elif isinstance(event, Idle):
            if event.precopied >= 0 or not client.idle:
                client.precopy_asked = False  # a new idle period (the shim says IDLE once per)
            if event.precopied >= 0:
                client.precopied = event.precopied
            if not client.idle:
                client.idle_since = self._clock
                note_cell_end(client, self._clock)
            client.idle, client.coming, client.hinted = True, False, False
            if event.from_jupyter:  # a notebook's kernel, even if its first busy was missed
                client.cell.tracked = True
        elif isinstance(event, Coming):  # a cell comes: its memory may come ahead (.hints)
            return self._on_coming(dev, client)
        elif isinstance(event, Busy):
            client.coming = client.holding is None  # a cell comes: its memory may come ahead
            client.idle = False
            client.precopied = 0  # it runs again: the host copy is about to go stale
            client.precopy_asked = False
            client.room_tried = False
            client.cell.new_cell(from_jupyter=True)
            client.cell_start = self._clock
        elif isinstance(event, Leave):
            self._remove(client)
        elif isinstance(event, AdminRelease):
            return self._on_admin_release(dev, client, event)
        elif isinstance(event, SetQuota):
            # The shell tells the shim (SET_QUOTA) once access has checked the quota.
            client.quota = max(0, event.quota)
            return []
        elif isinstance(event, SetWeight):
            client.weight = event.weight if event.weight > 0 else client.weight
        decisions = self._schedule(dev)
        decisions += self._keep_room(dev, decisions)
        if self.config.precopy_idle and self.config.policy == "gpushare":
            decisions += self._precopy(dev, decisions)
        return decisions + self._restore_ahead(dev, decisions)

    def recover_until(self, until: float) -> None:
        """Hold back every grant and eviction until ``until`` (the scheduler restarted).

        After a crash the clients reconnect one by one (the shims retry within ~2.5 s). A waiter
        that came back first must not be granted the device while the holder, still running
        unshared, has not said so yet; during the window only resumed holders are accepted
        (:meth:`_resume`), and the first pass after it sees everyone.
        """
        self._recover_until = until

    def recovering(self, now: float) -> bool:
        return self._recover_until is not None and now < self._recover_until

    def next_deadline(self) -> float | None:
        """The earliest future time at which a Tick may change a decision, or None.

        Devices with waiters need ticks: a holder's quantum expiry, and the moments a waiter
        starts reserving or becomes overdue; so does missing room (.room): the moment a held
        client may be evicted for it. Times already past are left out (a holder whose quantum
        expired but who was not needed stays until an event changes the picture), so the shell
        never spins.
        """
        if self._now is None:
            return None
        now = self._now
        best: float | None = None
        if self._recover_until is not None and self._recover_until > now:
            best = self._recover_until
        for dev in self._devices.values():
            for t in self._deadlines(dev):
                if t > now and (best is None or t < best):
                    best = t
            t = room_deadline(dev, self._room_target(dev), now)
            if t is not None and (best is None or t < best):
                best = t
        return best

    def snapshot(self, now: float) -> list[dict[str, Any]]:
        """One dict per device in the status document's shape (docs/protocol.md).

        Times (``waiting_since``) are on the events' clock. ``queue_position`` counts from 1.
        """
        t = now if self._now is None else max(now, self._now)
        dt = 0.0 if self._now is None else t - self._now
        return [device_status(dev, self._facts(dev, t), t, dt) for dev in self._devices.values()]

    def _facts(self, dev: DeviceState, now: float) -> DeviceFacts:
        """The policy's rulings that the status snapshot (:mod:`.policy_status`) shows."""
        return DeviceFacts(
            queue=self._queue(dev, now),
            quantum=lambda c: self._quantum(dev, c),
            paused_for_order=lambda c: self._paused_for_order(dev, c),
            recovering=self.recovering(now),
            resident_bytes=dev.resident_bytes,
            base_quantum=self.config.base_quantum,
            starvation_window=overload_window(self.config, dev),
            host_full=self._host_full(dev),
        )

    def client_device(self, client: str) -> str | None:
        c = self._clients.get(client)
        return None if c is None else c.device

    def has_client(self, client: str) -> bool:
        return client in self._clients

    # ----------------------------------------------------------------------------------------
    # Events

    @property
    def _clock(self) -> float:
        assert self._now is not None
        return self._now

    def _advance(self, now: float) -> None:
        """Move the clock forward (never back) and account the elapsed time."""
        if self._now is None:
            self._now = now
            return
        if now <= self._now:
            return
        dt = now - self._now
        half_life = self.config.usage_half_life
        for dev in self._devices.values():
            busy = [c for c in dev.clients.values() if c.holding == "running" and not c.idle]
            for c in busy:  # co-running cells share the GPU: each gets its part of the time
                c.cell.service += dt / len(busy)
            for c in dev.clients.values():
                if c.holding is not None:
                    c.gpu_seconds += dt
                    dev.usage.setdefault(c.user, Usage(stamp=self._now)).add(dt, now, half_life)
                elif c.waiting_since is not None:
                    c.wait_seconds += dt
        self._now = now

    def _on_join(self, evt: Join) -> list[Decision]:
        dev = self._devices.get(evt.device)
        if dev is None:
            raise ValueError(f"unknown device {evt.device!r}: call add_device first")
        out: list[Decision] = []
        old = self._clients.get(evt.client)
        if old is not None:  # a reconnect under the same id: the old connection is gone
            self._remove(old)
            out += self._schedule(self._devices[old.device])
        self._seq += 1
        c = ClientState(
            id=evt.client,
            device=evt.device,
            user=evt.user,
            seq=self._seq,
            weight=evt.weight if evt.weight > 0 else 1.0,
            quota=max(0, evt.quota),
            uid=evt.uid,
            pid=evt.pid,
            label=evt.label,
            last_active=self._clock,
        )
        c.set_memory(evt.context_bytes, 0, evt.context_bytes, 0)
        dev.clients[c.id] = c
        self._clients[c.id] = c
        if evt.used >= 0 or evt.resume:
            out += self._resume(dev, c, evt)
        return out

    def _on_request(self, c: ClientState, evt: Request) -> None:
        """The client wants the device; a Request from a holder only updates its footprint."""
        c.set_memory(evt.used, evt.managed, evt.pinned, evt.evicted)
        # A claim: never more room than the device's pool could give.
        c.short = min(max(0, evt.short), self._devices[c.device].pool_bytes)
        c.short_waits = c.short > 0
        if c.holding is not None:
            return
        if c.idle:  # it wants the GPU again after its cell ended: a new cell
            c.cell.new_cell()
            c.cell_start = self._clock
        elif c.cell_start is None:
            c.cell_start = self._clock
        c.idle = False
        if c.waiting_since is None:
            since = c.resume_since
            c.waiting_since = self._clock if since is None else min(since, self._clock)
        c.resume_since = None
        if evt.evicted > 0 and not c.moving:
            # Some of its memory is on the host (the shim's total): the grant restores it.
            if c.resident and evt.evicted < c.movable:
                c.away = max(c.away, evt.evicted)
                c.restore = True
                c.evicted = c.away
            else:
                count_evicted(c)

    def _on_released(self, dev: DeviceState, c: ClientState, evt: Released) -> None:
        """The client stopped using the device (answer to Revoke, or unsolicited).

        A Released from a client that does not hold the device (a late answer to a Revoke that
        crossed an unsolicited release) changes nothing but residency: a waiter stays waiting.
        """
        part = c.revoke_bytes if c.holding == "revoking" and c.revoke_evict else 0
        if (deferred := c.deferred) and not evt.evicted:  # past its room: never on the GPU
            c.away = max(c.away, deferred)
            c.evicted, c.restore = c.away, True
            note_growth(c, self._clock)
        if evt.evicted:
            c.measure(dev, "evict", evt.bytes_moved, evt.micros)
            dev.measure_unmap(evt.bytes_moved, evt.micros, part or c.evictable)
        if c.holding is not None:
            c.holding = None
            c.revoke_evict = False
            c.revoke_bytes = 0
            c.last_active = self._clock
            c.resident = True
        if evt.evicted:
            count_evicted(c, part, evt.evicted_bytes, evt.bytes_moved)

    def _on_evicted(self, dev: DeviceState, c: ClientState, evt: Evicted) -> None:
        c.evict_pending = False
        part, c.evict_asked = c.evict_asked, 0
        if not evt.ok:
            return  # still resident: the room it was to free does not exist (the next pass retries)
        c.measure(dev, "evict", evt.bytes_moved, evt.micros)
        dev.measure_unmap(evt.bytes_moved, evt.micros, part or c.evictable)
        if c.holding is None:
            count_evicted(c, part, evt.evicted_bytes, evt.bytes_moved)

    def _on_admin_release(
        self, dev: DeviceState, c: ClientState, evt: AdminRelease
    ) -> list[Decision]:
        """An operator asks for the device back: revoke a holder, or evict a non-holder."""
        out: list[Decision] = []
        if c.holding == "running":
            out.append(self._revoke(c, evt.evict, REASON_ADMIN))
        elif (
            c.holding is None and evt.evict and c.resident and not c.moving and self._host_cap(c, 1)
        ):
            out.append(self._evict(c, REASON_ADMIN))
        return out + self._schedule(dev)

    def _remove(self, c: ClientState) -> None:
        """Forget a client at once: its grant and its memory leave the accounting."""
        del self._clients[c.id]
        del self._devices[c.device].clients[c.id]

    # ----------------------------------------------------------------------------------------
    # Decisions (each one updates the state it implies)

    def _grant(self, c: ClientState) -> Grant:
        arrived = c.used - c.on_gpu  # what this grant brings onto the GPU
        if arrived > 0:
            self._devices[c.device].arrivals.append(arrived)
        if c.room_evicted and c.restore:  # it came back after its memory left for room
            c.room_returns += 1  # (.room holds it longer before the next room eviction)
        c.room_evicted = False
        restore = (
            c.restore or c.ahead_pending
        )  # a restore ahead in flight ends before the gate opens
        c.restore = c.coming = c.hinted = c.ahead_short = c.ahead_pending = False
        c.holding = "running"
        c.run_start = self._clock
        c.waiting_since = None
        c.resident = True
        c.away = 0  # the grant restores what left (only that: the shim knows which blocks)
        c.stuck = 0
        c.short, c.short_waits = 0, False  # the room it was short of is made (else it asks again)
        c.idle = False
        room = None
        if self.config.policy == "gpushare":  # never less than it holds (a grant alone, rule 5)
            room = max(c.used, room_for(self._devices[c.device], c))
        c.room = room
        return Grant(c.id, restore=restore, room_bytes=room)

    def _revoke(self, c: ClientState, evict: bool, reason: str, nbytes: int = 0) -> Revoke:
        """Revoke ``c``; with ``evict``, freeing ``nbytes`` of it (0: everything)."""
        c.holding = "revoking"
        partial = evict and nbytes > 0 and self.config.partial_eviction
        c.revoke_bytes = ask(c, nbytes) if partial else c.evictable
        if evict and (cap := self._host_cap(c, c.revoke_bytes)) < c.revoke_bytes:
            c.revoke_bytes, evict = cap, cap > 0  # the node's host budget (.host_budget)
        c.revoke_evict = evict
        c.revoked_at = self._clock
        part = c.revoke_bytes if evict and c.revoke_bytes < c.evictable else 0
        return Revoke(c.id, evict=evict, reason=reason, evict_bytes=part)

    def _evict(self, c: ClientState, reason: str, nbytes: int = 0) -> Evict:
        """Evict ``nbytes`` of ``c`` (rounded up to a block; 0: everything)."""
        c.evict_pending = True
        partial = nbytes > 0 and self.config.partial_eviction
        c.evict_asked = ask(c, nbytes) if partial else c.evictable  # callers: ._host_fit
        part = c.evict_asked if c.evict_asked < c.evictable else 0
        return Evict(c.id, reason=reason, bytes=part)

    def _evict_for(self, cands: Iterable[ClientState], short: int, reason: str) -> list[Decision]:
        """Partial eviction: free ``short`` bytes from ``cands`` in order (.policy_moves)."""
        out: list[Decision] = []
        cands = self._host_fit(cands)  # again: revokes decided since took host room
        for c in cands:
            if short <= 0:
                break
            out.append(self._evict(c, reason, short))
            short -= c.evict_asked
        return out

    # ----------------------------------------------------------------------------------------
    # Accounting helpers

    def _quantum(self, dev: DeviceState, c: ClientState) -> float:
        """The time slice of a holder: long enough that moving its memory is a small part."""
        moved = c.movable
        evict_bw, restore_bw = c.bandwidths(dev)
        move_time = moved / evict_bw + moved / restore_bw
        cfg = self.config
        return min(max(cfg.base_quantum, cfg.move_factor * move_time), cfg.max_quantum)

    # Deadlines are compared as ``now >= start + span``, the very sum next_deadline() returns:
    # ``now - start >= span`` can be False at that instant by a rounding error, and stall.

    def _expires_at(self, dev: DeviceState, c: ClientState) -> float:
        return c.run_start + self._quantum(dev, c)

    def _expired(self, dev: DeviceState, c: ClientState) -> bool:
        return self._clock >= self._expires_at(dev, c)

    def _yields_to(self, dev: DeviceState, w: ClientState, h: ClientState, n: int) -> str | None:
        """Why the busy holder ``h`` may be revoked for ``w``, ``n`` bytes missing (None: not):
        past its quantum, or for a short cell (.policy_short); cost-aware, only when its cell is
        expected to last longer than the move would take."""
        if self.config.cost_aware and not worth_evicting(dev, h, ask(h, n), self._clock):
            return None
        if self.config.host_budget and not self._host_cap(h, ask(h, n)):
            return None  # its memory has no room on the host (.host_budget)
        pre = self.config.short_first and preempts(self._order, w, h, self._clock)
        return REASON_QUANTUM if self._expired(dev, h) else REASON_ORDER if pre else None

    def _reserves(self, c: ClientState, now: float) -> bool:
        assert c.waiting_since is not None
        return now >= c.waiting_since + self.config.base_quantum

    def _overdue(self, c: ClientState, now: float) -> bool:
        assert c.waiting_since is not None
        return now >= c.waiting_since + self.config.max_quantum

    def _share(self, dev: DeviceState, c: ClientState, now: float) -> float:
        usage = dev.usage.get(c.user)
        used = 0.0 if usage is None else usage.at(now, self.config.usage_half_life)
        return used / c.weight

    def _queue(self, dev: DeviceState, now: float) -> list[ClientState]:
        """Waiters, highest priority first.

        Short cells first (``short_first``, .policy_short), then overdue waiters (waited ≥
        max_quantum) in arrival order: that bounds every wait. The rest order by: not marked
        idle by Jupyter, then fair share (the user's decayed GPU-seconds divided by the
        client's weight), then arrival.
        """

        def key(c: ClientState) -> tuple[int, int, int, float, float, int]:
            share, late, first = self._share(dev, c, now), self._overdue(c, now), short_first
            return queue_key(self._order, c, now, share, late, first)

        short_first = self.config.short_first and self.config.policy == "gpushare"
        return sorted((c for c in dev.clients.values() if c.waiting_since is not None), key=key)

    def _eviction_candidates(
        self, dev: DeviceState, behind: Iterable[ClientState]
    ) -> list[ClientState]:
        """Clients whose memory may be evicted for a waiter, cheapest loss first.

        Idle clients, pre-copied ones first (an unmap), then least recently used first; then
        waiters behind the one being served, lowest priority first (their memory would block it,
        and they cannot run before it). Each gives only what is missing (.policy_moves). Cost-aware
        (``PolicyConfig.cost_aware``), the kernels whose cell is expected to be longest give first
        (.policy_moves.order_candidates).
        """
        idle = [
            c
            for c in dev.clients.values()
            if c.holding is None and c.waiting_since is None and c.resident
        ]
        waiters = [c for c in reversed(list(behind)) if c.resident]
        now = self._clock if self.config.cost_aware else None
        cands = order_candidates(idle, waiters, now)
        return self._host_fit(c for c in cands if not c.moving and c.evictable > 0)

    def _deadlines(self, dev: DeviceState) -> Iterable[float]:
        self._order.window = overload_window(self.config, dev)  # .overload
        yield from swap_deadlines(
            self._order, dev, self.config.overload_long_cap, self._order.window
        )
        if self.config.policy == "gpushare":
            waiters = [c for c in dev.clients.values() if c.waiting_since is not None]
            yield from self._order.deadlines(self._busy_holders(dev), waiters, self._clock)
        if not any(c.waiting_since is not None for c in dev.clients.values()):
            return
        if self.config.policy == "fixed-quantum":
            for c in dev.clients.values():
                if c.holding == "running":
                    yield c.run_start + self.config.fixed_quantum
                    yield next_idle_check(c, self._clock, self.config.idle_check_interval)
            return
        for c in dev.clients.values():
            if c.holding == "running" and not c.idle:
                yield self._expires_at(dev, c)
                yield c.run_start + self.config.ordering.min_slice  # a short waiter may pre-empt
                if self.config.cost_aware and c.cell_start is not None:
                    yield c.cell_start + c.turn_s  # it outlives its usual cell: weigh it again
            elif c.waiting_since is not None:
                yield c.waiting_since + self.config.base_quantum
                yield c.waiting_since + self.config.max_quantum

    # ----------------------------------------------------------------------------------------
    # The scheduling pass

    def _schedule(self, dev: DeviceState) -> list[Decision]:
        self._order.window = overload_window(self.config, dev)  # .overload
        if self.recovering(self._clock):
            return []  # recover_until(): wait until every survivor had time to come back
        if self.config.policy == "fixed-quantum":
            return self._relieve(dev) + self._admit_fixed(dev)
        return self._relieve(dev) + self._admit(dev) + self._pause(dev)

    def _relieve(self, dev: DeviceState) -> list[Decision]:
        """Rule 1: restore the fit after a holder grew, revoking or evicting as little as needed.

        Holders that fitted side by side can stop fitting when one allocates more (a holder's
        allocations and launches do not ask the scheduler first). They are revoked, with
        eviction, in this order until the rest fit: holders marked idle (their cell has
        finished: revoking them interrupts no one), then the one that grew most recently (its
        new allocation is what no longer fits, so it waits rather than pre-empting a neighbour in
        the middle of its work), then the longest run. Idle resident memory that overflows the
        pool is evicted, least recently used first.
        """
        out: list[Decision] = []
        running = sorted(
            (c for c in dev.clients.values() if c.holding == "running"),
            key=lambda c: (not c.idle, -c.grew_at, c.run_start, c.seq),
        )
        # What a holder allocated past its grant's room is not on the GPU (ClientState.deferred):
        # its shim gives the device back and asks again, and admission makes the room.
        total = sum(c.used - c.deferred for c in running)
        while len(running) > 1 and total > dev.pool_bytes:
            c = running.pop(0)
            out.append(self._revoke(c, True, REASON_GREW, total - dev.pool_bytes))
            total -= c.revoke_bytes
        excess = dev.resident_bytes - dev.incoming_bytes - dev.pool_bytes
        if excess > 0:
            cands = self._eviction_candidates(dev, self._queue(dev, self._clock))
            out += self._evict_for(cands, excess, REASON_PRESSURE)
        return out

    def _admit(self, dev: DeviceState) -> list[Decision]:
        """Rules 2-4: grant the waiters that fit; make room for the first one that does not."""
        now = self._clock
        out: list[Decision] = []
        free = dev.pool_bytes - dev.resident_bytes
        incoming = dev.incoming_bytes
        queue = self._queue(dev, now)
        dev.turns = False
        gate = self._gate_level(dev)
        for i, w in enumerate(queue):
            if w.evict_pending:
                continue  # its own eviction is in flight: grant it (with restore) after Evicted
            if not self._order.passes(w, gate, now):
                continue  # a longer cell, paused while shorter ones run (interactive ordering)
            # -- No thrashing (.overload): a capped long waiter only takes a long holder's place.
            cfg = self.config
            held, swap = capped_swap(
                self._order, dev, w, cfg.overload_long_cap, cfg.overload_window, now
            )
            if held:
                if swap is not None:
                    out.append(self._revoke(swap, True, REASON_QUANTUM, w.used - w.on_gpu))
                continue
            # -- end of no thrashing
            need = w.used - w.on_gpu
            if need <= free and w.short <= 0:
                if w.short_waits and incoming > 0:
                    continue  # the room it was short of is still leaving: the driver needs it
                out.append(self._grant_in_order(dev, w))
                gate = min(gate, self._order.level(w))
                free -= need
                continue
            if dev.turns:
                continue  # behind a blocked waiter that does not reserve yet: free room only
            cands = self._eviction_candidates(dev, queue[i + 1 :])
            # What the driver refused beyond the accounting's free room (Request.short) is room
            # to make all the same: the card is fuller than the pool says.
            short = max(need - free, w.short)
            short = max(short, growth_room(w, need, cands))  # a kernel growing in steps
            if short <= incoming + sum(c.evictable for c in cands):
                # Fits once idle memory leaves: claim in-flight room first, then evict LRU.
                use = min(short, incoming)
                incoming -= use
                short -= use
                moves = self._evict_for(cands, short, f"room for {w.id}")
                out += moves
                asked = sum(self._clients[d.client].evict_asked for d in moves)
                short -= asked
                w.short = max(0, w.short - use - asked)  # room on its way: not asked twice
                incoming += max(0, -short)
                free = 0
                continue
            dev.turns = True
            made = self._make_room(dev, w, short - incoming, cands)
            out += made
            w.short = max(0, w.short - incoming - freed_by(made, self._clients))
            if w.holding is not None:  # granted alone (rule 5)
                dev.turns = False
                free -= need
                continue
            if self._reserves(w, now):
                break  # rule 4: it reserves; nobody behind it is admitted
        return out

    def _make_room(
        self, dev: DeviceState, w: ClientState, short: int, cands: list[ClientState]
    ) -> list[Decision]:
        """Rule 3 (and 5) for the blocked waiter ``w``, ``short`` bytes beyond in-flight room.

        Idle holders are revoked at once (evicting only while ``w`` still needs room); holders
        past their quantum are revoked with eviction, oldest run first, while room is missing.
        Idle clients are evicted in the same breath only when the plan is complete, so that a
        handoff moves memory in parallel yet never moves what the revocations already free.
        """
        out: list[Decision] = []
        deficit = short - sum(c.evictable for c in cands)  # what only running holders can give
        freed = 0
        running = sorted(
            (c for c in dev.clients.values() if c.holding == "running"),
            key=lambda c: (c.run_start, c.seq),
        )
        for h in (c for c in running if c.idle):
            evict = deficit > 0
            out.append(self._revoke(h, evict, REASON_IDLE, deficit))
            if evict:
                deficit -= h.revoke_bytes
                freed += h.revoke_bytes
        for h in (c for c in running if not c.idle):
            why = None if deficit <= 0 else self._yields_to(dev, w, h, deficit)
            if why is not None:
                out.append(self._revoke(h, True, why, deficit))
                deficit -= h.revoke_bytes
                freed += h.revoke_bytes
        if deficit <= 0:
            return out + self._evict_for(cands, short - freed, f"room for {w.id}")
        if any(c.holding is not None for c in dev.clients.values()):
            return out  # wait for the holders' quanta (a Tick) or their answers
        # Rule 5: even an empty device (but for memory that cannot move) has no room for w.
        if cands:  # everything that can move moves: w does not fit even so
            out += [self._evict(c, f"room for {w.id}") for c in cands]
        elif not any(c.moving for c in dev.clients.values()) and not self._host_holds(dev, w):
            out.append(self._grant(w))
        return out

    # ----------------------------------------------------------------------------------------
    # Interactive-first ordering (PolicyConfig.ordering; the rules are in .ordering)

    @staticmethod
    def _busy_holders(dev: DeviceState) -> list[ClientState]:
        return [c for c in dev.clients.values() if c.holding == "running" and not c.idle]

    def _gate_level(self, dev: DeviceState) -> int:
        return self._order.gate(self._busy_holders(dev))

    def _paused_for_order(self, dev: DeviceState, w: ClientState) -> bool:
        """``w`` waits only because shorter cells run (the status says so)."""
        return not self._order.passes(w, self._gate_level(dev), self._clock)

    def _grant_in_order(self, dev: DeviceState, w: ClientState) -> Grant:
        """Grant ``w``; one let through by the starvation bound holds for its weighted slice."""
        if self._order.starved(w, self._clock):
            busy = self._busy_holders(dev)
            busy += [c for c in dev.clients.values() if c.waiting_since is not None]
            self._order.protect(w, sum(c.weight for c in busy), self._clock)
        return self._grant(w)

    def _pause(self, dev: DeviceState) -> list[Decision]:
        """Pause (revoke, no eviction: the memory stays) what the ordering says to pause."""
        paused = self._order.to_pause(self._busy_holders(dev), self._clock)
        return [self._revoke(c, False, REASON_ORDER) for c in paused]
