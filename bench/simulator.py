"""The multi-user replay, simulated: the real scheduling policy on a virtual clock.

The same seeded traces (:mod:`bench.trace`) that real processes replay on the GPU
(:mod:`bench.replay`) drive the pure :class:`~jupyter_gpushare.scheduler.core.policy.Policy` here;
the simulator plays the shims' part (answers revokes, evictions and restores after the time the
memory takes to move) and the GPU's (cells that run side by side share it equally: processor
sharing, which is how time-sliced contexts behave for long kernels). Use it for capacity
planning: ``python -m bench.simulator --sweep 2,4,8,12,16 --real-time --horizon 1800`` prints
users per GPU vs slowdown for the default trace at real time (think and GPU times
``TIME_SCALE`` x the replay's: the same duty cycle).

Modes driving the real policy: ``gpushare`` (the default: interactive-first ordering),
``gpushare-fair`` (ordering "fair": every kernel that fits co-runs) and ``fixed-quantum`` (the
nvshare-like lock). Modes without the policy: ``colocate`` (no shim: memory that does not fit
the pool makes the cell fail), ``dedicated`` (one GPU per user: every cell runs alone).
Reference lines, all without memory costs, on one GPU: ``equal-share`` (every running cell gets
an equal part: processor sharing, what co-running contexts do), ``las`` (ideal
least-attained-service: the cells with least GPU time so far share the GPU) and ``srpt``
(clairvoyant shortest-remaining-time-first: no online scheduler does better on mean latency;
the limit, not a bound on the p95 of every scheduler).

Every timer of every policy is in seconds of the trace, so a trace at real time
(:func:`bench.trace.scaled` with ``TIME_SCALE``) runs the idle check and the quanta at real time.

A *warm start* (``Simulation(..., warm=True)``, the policy's modes) plays what the real replay
does before its clock starts (:func:`bench.replay.run` with ``warm=True``): the users load their
memory one at a time, in the trace's order, each in a tiny cell after which its notebook says
idle and gives the device back (``release``), the next one starting only once every move and
pre-copy has ended; the trace's clock starts when the last has settled. The pool then holds what
the policy kept, pre-copied, and every allocation is old enough for its host staging to be
ready. Cells' times are reported on the trace's clock.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from jupyter_gpushare.scheduler.core import costs
from jupyter_gpushare.scheduler.core import events as ev
from jupyter_gpushare.scheduler.core.hints import CellHints
from jupyter_gpushare.scheduler.core.ordering import OrderingConfig
from jupyter_gpushare.scheduler.core.policy import REASON_ORDER, Policy, PolicyConfig
from jupyter_gpushare.scheduler.core.room import KEEP_FREE_WAIT, KeepFree

from .common import GiB, percentile
from .trace import TIME_SCALE, TraceConfig, User, generate, scaled

POLICY_MODES = ("gpushare", "gpushare-fair", "fixed-quantum")
REFERENCES = ("dedicated", "equal-share", "las", "srpt")
MODES = (*POLICY_MODES, "colocate", *REFERENCES)
#: Cells this short (solo seconds) are the "interactive" ones of the targets.
SHORT_CELL = 1.0
#: Cells at least this long (solo seconds) are the "long" ones whose throughput is compared.
LONG_CELL = 10.0
#: A warm start's loading cell (GPU seconds beside its pass over the working set), the gap
#: between one user's settled memory and the next one's load, and the longest warm-up allowed.
WARM_CELL_S = 0.005
WARM_GAP_S = 0.5
WARM_LIMIT_S = 3600.0
#: The events of memory moving: a warm start waits until none is pending.
_MOVES = ("drained", "released", "evicted", "precopied", "restored")


@dataclass
class SimConfig:
    """The simulated engine. Its costs default to the GPU measurements of
    :mod:`jupyter_gpushare.scheduler.core.costs` (each names its result file); :func:`legacy` gives
    the older model (one 10 GB/s eviction, no pre-copy, no cold staging, whole-kernel moves)."""

    pool_bytes: int = 40 * GiB
    total_bytes: int = 80 * GiB
    context_bytes: int = GiB // 2  # per process (a PyTorch context on an H100 is about this)
    evict_bw: float = costs.EVICT_STAGED_BPS  # bytes/s: device->host into ready staging
    restore_bw: float = costs.RESTORE_BPS  # bytes/s: host->device
    touch_s_per_gib: float = 0.0007  # each cell reads and writes its working set once
    handoff_s: float = costs.HANDOFF_S  # fixed cost of a grant (messages, wake-ups)
    # After a revoke, the holder's launched work runs on this long on average.
    drain_s: float = costs.DRAIN_S
    grace: float = 30.0  # seconds after the horizon before unfinished cells are cut
    base_quantum: float = 5.0
    fixed_quantum: float = 30.0
    idle_check_interval: float = 5.0
    extra_bytes: int = 0  # per user, beside the working set (e.g. matmul operands); movable
    # Model the shim's pre-copy as the daemon runs it: a PRECOPY copies the resident working set
    # to the host in the background (at precopy_bw) while it stays on the GPU, and evicting
    # bytes whose copy is still valid is an unmap (unmap_s_per_gib), not a copy.
    model_precopy: bool = True
    unmap_s_per_gib: float = costs.UNMAP_S_PER_GIB
    precopy_bw: float = costs.PRECOPY_BPS
    # Cold staging: an eviction before the kernel's host staging is ready (within
    # costs.staging_ready_after of its allocation) runs at cold_evict_bw. 0: never cold.
    cold_evict_bw: float = costs.EVICT_COLD_BPS
    # Partial eviction: the engine frees what is asked, in blocks; False: whole kernels move.
    partial: bool = True
    block_bytes: int = costs.BLOCK_BYTES
    keep_free: bool = True  # the daemon's keep_free "auto" (needs model_precopy to act)
    keep_free_wait: float = KEEP_FREE_WAIT  # ... kept only where on demand it would cost this
    # Restore ahead (the policy's .ahead): evicted memory moves back at restore_bw before its
    # owner's turn, overlapping others' compute; a grant that comes first waits for the move.
    restore_ahead: bool = False
    # A kernel's first restore runs at first_restore_bw (costs.FIRST_RESTORE_BPS; 0: at
    # restore_bw like the others).
    first_restore_bw: float = costs.FIRST_RESTORE_BPS
    # One bus, full duplex: moves in one direction (evictions; restores) run one after another,
    # a move decided while another is under way starting when it ends. False: each move alone.
    shared_bus: bool = True
    # The node's host staging is one queue (costs.STAGING_SHARED_S_PER_GIB): an allocation's
    # staging waits for the allocations still staging before it. False: each alone.
    shared_staging: bool = True
    ordering: OrderingConfig = field(default_factory=OrderingConfig)  # for "gpushare"
    # Cell hints (the policy's .hints, on as in the daemon): the notebook says a cell is coming
    # hint_ahead_s seconds before it arrives (0: no hints), for a hint_fraction of the cells,
    # and false_hints wrong ones per real one (each for another user, whose cell does not come),
    # drawn from hint_seed.
    # Contention of co-running cells (the GPU's, not time-slicing's): (a short cell's slowdown
    # beside one long cell, the long cell's speed beside it); None: processor sharing. Cells under
    # SHORT_CELL solo seconds are the short ones.
    contention: tuple[float, float] | None = None
    # What a pause (the ordering's revoke without eviction) costs the paused cell when it
    # resumes, beyond the drain: seconds before its work goes on (0: nothing more).
    pause_overhead_s: float = 0.0
    # The policy's cap on long cells holding memory under overload (0: off, the daemon's
    # default; bench/nbmix.py runs with 1).
    overload_long_cap: int = 0
    hint_ahead_s: float = 0.0
    hint_fraction: float = 1.0
    false_hints: float = 0.0
    hint_seed: int = 1


def legacy(cfg: SimConfig | None = None) -> SimConfig:
    """The simulator before issue 21: 10 GB/s eviction, 48 GB/s restore, 2 ms per grant, no
    pre-copy model, no cold staging, whole kernels moved (the 'before' column)."""
    return replace(
        cfg or SimConfig(),
        evict_bw=10e9,
        restore_bw=48e9,
        handoff_s=0.002,
        model_precopy=False,
        unmap_s_per_gib=0.1946 / 12,
        cold_evict_bw=0.0,
        partial=False,
        first_restore_bw=0.0,
        shared_bus=False,
        shared_staging=False,
    )


@dataclass
class _U:
    user: User
    cell: int = -1
    in_cell: bool = False
    work: float = 0.0  # solo seconds of work left in the current cell
    solo: float = 0.0  # solo seconds of the current cell (attained service = solo - work)
    arrival: float = 0.0
    holding: bool = False
    blocked_until: float = 0.0  # restoring, or the grant's fixed cost
    allocated: bool = False  # colocate: its working set is on the card
    copied: int = 0  # model_precopy: resident bytes with a valid host copy
    copy_gen: int = 0  # bumped whenever a copy in flight goes stale (a cell, an eviction)
    on_gpu: int = 0  # bytes of its working set on the GPU
    allocated_at: float | None = None  # when its working set was first backed (staging clock)
    warming: bool = False  # its current cell is a warm start's loading cell (not recorded)
    ahead_until: float = 0.0  # a restore ahead moves its memory back until then
    staged_at: float = math.inf  # when its host staging is ready (set at its allocation)
    restored: bool = False  # it restored once: later restores run at the steady bandwidth
    room: int | None = None  # its grant's room as the policy last told it (Room, Grant)
    paused: bool = False  # the ordering paused it: its next grant pays SimConfig.pause_overhead_s


def solo_seconds(user: User, cell: dict[str, float], cfg: SimConfig) -> float:
    """A cell's time on a dedicated GPU: its bursts plus one pass over the working set."""
    return float(cell["gpu"]) + user.working_set / GiB * cfg.touch_s_per_gib


def policy_config(mode: str, cfg: SimConfig) -> PolicyConfig:
    """The policy's configuration for a simulated mode: the daemon's, with the simulated costs."""
    ordering = replace(cfg.ordering, mode="fair") if mode == "gpushare-fair" else cfg.ordering
    return PolicyConfig(
        base_quantum=cfg.base_quantum,
        evict_bandwidth=cfg.evict_bw,
        restore_bandwidth=cfg.restore_bw,
        policy="fixed-quantum" if mode == "fixed-quantum" else "gpushare",
        fixed_quantum=cfg.fixed_quantum,
        idle_check_interval=cfg.idle_check_interval,
        # The daemon's defaults: pre-copy idle kernels and keep room for the next arrival.
        precopy_idle=True,
        keep_free=KeepFree(auto=cfg.keep_free, min_wait=cfg.keep_free_wait),
        ordering=ordering,
        restore_ahead=cfg.restore_ahead,
        cell_hints=CellHints(on=True),
        overload_long_cap=cfg.overload_long_cap,
        # The daemon's default; a simulated working set is whole from its grant, so a Room
        # decision changes nothing the simulator models.
        room_updates=True,
    )


class Simulation:
    def __init__(
        self,
        users: list[User],
        mode: str,
        horizon: float,
        cfg: SimConfig,
        config: PolicyConfig | None = None,
        warm: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (one of: {', '.join(MODES)})")
        self.mode, self.horizon, self.cfg = mode, horizon, cfg
        self.users = {u.name: _U(u) for u in users}
        self.now = 0.0
        #: When the trace's clock started (after a warm start's loading; 0 without one).
        self.t0 = 0.0
        # A warm start (policy modes only: without a scheduler memory does not move): the
        # users still to load, and whether one's loading cell is on its way or running.
        self._to_warm = list(self.users.values()) if warm and mode in POLICY_MODES else []
        self._warming = bool(self._to_warm)
        self._warm_busy = False
        #: A warm start's pool when the clock started: each user's bytes on the GPU and off it.
        self.warm_pool: dict[str, dict[str, int]] = {}
        self.heap: list[tuple[float, int, str, str, Any]] = []
        self._seq = 0
        self.cells: list[dict[str, Any]] = []
        self.policy: Policy | None = None
        #: Every event sent to the policy with the decisions it returned (for the tests).
        self.log: list[tuple[ev.Event, list[ev.Decision]]] | None = None
        #: Revokes by reason (the ordering's pauses are REASON_ORDER).
        self.revokes: Counter[str] = Counter()
        #: When the bus is free in each direction (SimConfig.shared_bus).
        self.bus_free = {"d2h": 0.0, "h2d": 0.0}
        #: Bytes moved in each direction over the run (restores ahead included).
        self.moved = {"d2h": 0, "h2d": 0}
        self._hint_rng = random.Random(cfg.hint_seed)
        #: Hints sent: (true, false).
        self.hints = [0, 0]
        if mode in POLICY_MODES:
            self.policy = Policy(config or policy_config(mode, cfg))
            self.policy.add_device(
                "GPU-sim", total_bytes=cfg.total_bytes, pool_bytes=cfg.pool_bytes
            )

    # -- plumbing ---------------------------------------------------------------------------

    def _bus(self, direction: str, nbytes: int, secs: float) -> float:
        """A move of ``nbytes`` taking ``secs`` alone, decided now: seconds until it ends, after
        the moves in the same direction already on the bus (SimConfig.shared_bus)."""
        self.moved[direction] += max(0, nbytes)
        if not self.cfg.shared_bus or secs <= 0:
            return secs
        end = max(self.now, self.bus_free[direction]) + secs
        self.bus_free[direction] = end
        return end - self.now

    def _restore_time(self, u: _U, nbytes: int) -> float:
        """Seconds to restore ``nbytes`` of ``u`` now: its first restore is the slow one."""
        if nbytes <= 0:
            return 0.0
        first = not u.restored and self.cfg.first_restore_bw > 0
        u.restored = True
        bps = self.cfg.first_restore_bw if first else self.cfg.restore_bw
        return self._bus("h2d", nbytes, nbytes / bps)

    def _allocate(self, u: _U) -> None:
        """``u``'s working set is backed now: its host staging starts (SimConfig.shared_staging)."""
        u.allocated_at = self.now
        queued = 0
        if self.cfg.shared_staging:
            queued = sum(
                self._movable(x)
                for x in self.users.values()
                if x.staged_at > self.now and x is not u and x.allocated_at is not None
            )
        u.staged_at = self.now + costs.staging_ready_after(self._movable(u), queued)

    def _at(self, t: float, kind: str, name: str, arg: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, self._seq, kind, name, arg))

    def _movable(self, u: _U) -> int:
        return u.user.working_set + self.cfg.extra_bytes

    def _mem(self, u: _U) -> dict[str, int]:
        ctx, ws = self.cfg.context_bytes, self._movable(u)
        return {"used": ctx + ws, "managed": ws, "pinned": ctx, "evicted": 0}

    def _evict_bytes(self, u: _U, asked: int) -> int:
        """What the engine frees for an ask of ``asked`` bytes (0: all): whole blocks."""
        if asked <= 0 or not self.cfg.partial:
            return u.on_gpu
        blocks = -(-asked // self.cfg.block_bytes)
        return min(u.on_gpu, blocks * self.cfg.block_bytes)

    def _evict(self, u: _U, asked: int) -> tuple[int, float]:
        """Evict ``asked`` bytes of ``u`` now (pre-copied ones first): (bytes copied, seconds).

        Like the engine (native/src/memory_move.c), the bytes reported are those copied: blocks
        with a valid pre-copy are only unmapped and count as none, so the policy's bandwidth
        estimate follows the copies, not the unmaps (which would put it at terabytes a second).
        """
        n = self._evict_bytes(u, asked)
        cfg = self.cfg
        staged = cfg.cold_evict_bw <= 0 or u.allocated_at is None or self.now >= u.staged_at
        secs = costs.evict_seconds(
            n,
            u.copied,
            staged,
            staged_bps=cfg.evict_bw,
            cold_bps=cfg.cold_evict_bw or cfg.evict_bw,
            unmap_s_per_gib=cfg.unmap_s_per_gib,
        )
        copied = n - min(n, u.copied)
        u.copied = max(0, u.copied - n)
        u.on_gpu -= n
        u.copy_gen += 1  # a copy in flight covered blocks that may have left
        if copied > 0:  # an unmap moves nothing over the bus
            secs = self._bus("d2h", copied, secs)
        return copied, secs

    def _stale(self, u: _U) -> None:
        u.copied = 0
        u.copy_gen += 1

    def _send(self, event: ev.Event) -> None:
        assert self.policy is not None
        decisions = self.policy.handle(event)
        if self.log is not None:
            self.log.append((event, decisions))
        for d in decisions:
            self._decide(d)

    def _decide(self, d: ev.Decision) -> None:
        u = self.users[d.client]
        ws = self._movable(u)
        if isinstance(d, ev.Grant):
            u.holding = True
            back = ws - u.on_gpu if u.allocated_at is not None else 0  # only what left
            if u.allocated_at is None:
                self._allocate(u)
            u.on_gpu = ws
            u.room = d.room_bytes
            move = self._restore_time(u, back) if d.restore else 0.0
            # A restore ahead still in flight ends before the gate opens.
            resume = self.cfg.pause_overhead_s if u.paused else 0.0
            u.paused = False
            u.blocked_until = max(self.now + self.cfg.handoff_s + move + resume, u.ahead_until)
            if d.restore:
                self._at(u.blocked_until, "restored", u.user.name, (back, move))
        elif isinstance(d, ev.Room):
            # Room updates: a simulated working set is whole from its first grant and never
            # grows, so nothing waits unbacked (deferred); the room is kept for the tests.
            u.room = d.room_bytes
        elif isinstance(d, ev.Revoke):
            self.revokes[d.reason] += 1
            u.paused = d.reason == REASON_ORDER and u.in_cell
            # The shim closes the gate at once; the work already launched runs on (drains).
            arg = (d.evict_bytes or -1) if d.evict else 0
            self._at(self.now + self.cfg.drain_s, "drained", u.user.name, arg)
        elif isinstance(d, ev.Evict):
            moved, secs = self._evict(u, d.bytes)
            self._at(self.now + secs, "evicted", u.user.name, (moved, secs))
        elif isinstance(d, ev.RestoreAhead):
            back = ws - u.on_gpu
            u.on_gpu = ws  # counted on the GPU from now on, as the policy counts it
            secs = self._restore_time(u, back)
            u.ahead_until = self.now + secs
            self._at(u.ahead_until, "ahead", u.user.name, (back, secs))
        elif isinstance(d, ev.Precopy) and self.cfg.model_precopy:
            todo = max(0, u.on_gpu - u.copied)
            # It copies what is resident now (not what a restore ahead brings back meanwhile).
            arg = (u.copy_gen, u.on_gpu)
            self._at(self.now + todo / self.cfg.precopy_bw, "precopied", u.user.name, arg)

    def _active(self) -> list[_U]:
        return [
            u
            for u in self.users.values()
            if u.in_cell
            and u.work > 0
            and u.blocked_until <= self.now
            and (u.holding or self.policy is None)
        ]

    def _rates(self, active: list[_U]) -> tuple[dict[str, float], float]:
        """Each running cell's part of the GPU, and how long these parts hold at most.

        Processor sharing among the cells that run (for the policy's modes, those the policy
        lets through); ``las`` shares among the cells with the least attained service until
        they catch up with the next; ``srpt`` runs the cells with the least work left.
        """
        if not active:
            return {}, math.inf
        if self.mode == "dedicated":
            return {u.user.name: 1.0 for u in active}, math.inf
        run, until = active, math.inf
        if self.mode == "las":
            attained = {u.user.name: u.solo - u.work for u in active}
            low = min(attained.values())
            run = [u for u in active if attained[u.user.name] <= low + 1e-9]
            above = [a for a in attained.values() if a > low + 1e-9]
            if above:
                until = (min(above) - low) * len(run)
        elif self.mode == "srpt":
            least = min(u.work for u in active)
            run = [u for u in active if u.work <= least + 1e-9]
        elif self.cfg.contention is not None:
            return self._contended(active), until
        return {u.user.name: 1.0 / len(run) for u in run}, until

    def _contended(self, active: list[_U]) -> dict[str, float]:
        """Rates under SimConfig.contention: short cells beside long ones run at 1/slowdown (one
        long cell; each further one adds its part), the long ones share ``long_rate`` less what
        each further short cell takes; without both kinds, processor sharing."""
        assert self.cfg.contention is not None
        slowdown, long_rate = self.cfg.contention
        shorts = [u for u in active if u.solo < SHORT_CELL]
        longs = [u for u in active if u.solo >= SHORT_CELL]
        if not shorts or not longs:
            return {u.user.name: 1.0 / len(active) for u in active}
        short = 1.0 / (len(shorts) + len(longs) * (slowdown - 1))
        long_ = max(0.05, 1.0 - len(shorts) * (1.0 - long_rate)) / len(longs)
        return {u.user.name: short if u.solo < SHORT_CELL else long_ for u in active}

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> list[dict[str, Any]]:
        if self.policy is not None:
            for name in self.users:
                self._send(
                    ev.Join(0.0, name, "GPU-sim", name, context_bytes=self.cfg.context_bytes)
                )
        if self._warming:
            self._warm_step()
        else:
            for u in self.users.values():
                self._next_cell(u, 0.0)
        while True:
            end = math.inf if self._warming else self.t0 + self.horizon + self.cfg.grace
            if self.now > WARM_LIMIT_S and self._warming:
                raise RuntimeError(f"the warm start did not settle in {WARM_LIMIT_S:.0f} s")
            active = self._active()
            t_next = self.heap[0][0] if self.heap else math.inf
            if self.policy is not None:
                deadline = self.policy.next_deadline()
                if deadline is not None:
                    t_next = min(t_next, deadline)
            blocked = [
                u.blocked_until
                for u in self.users.values()
                if u.in_cell and u.holding and u.blocked_until > self.now
            ]
            t_next = min([t_next, *blocked])
            rates, until = self._rates(active)
            if rates:
                t_done = min(self.users[n].work / r for n, r in rates.items())
                t_next = min(t_next, self.now + min(t_done, until))
            if t_next == math.inf or t_next > end:
                break
            for n, r in rates.items():
                self.users[n].work -= (t_next - self.now) * r
            self.now = t_next
            for u in active:
                if u.work <= 1e-9:
                    self._finish(u, ok=True)
            while self.heap and self.heap[0][0] <= self.now:
                _, _, kind, name, arg = heapq.heappop(self.heap)
                self._on(kind, self.users[name], arg)
            if self.policy is not None:
                self._send(ev.Tick(self.now))
            if self._warming:
                self._warm_step()
        for u in self.users.values():
            if u.in_cell and not u.warming:
                self.cells.append(self._cell_record(u, None, ok=False, error="unfinished"))
        return sorted(self.cells, key=lambda c: (c["arrival"], c["user"]))

    def _next_cell(self, u: _U, ready: float) -> None:
        u.cell += 1
        if u.cell >= len(u.user.cells):
            return
        arrival = ready + u.user.cells[u.cell]["think"]
        if arrival <= self.t0 + self.horizon:
            self._at(arrival, "arrive", u.user.name)
            self._hint(u, ready, arrival)

    def _hint(self, u: _U, ready: float, arrival: float) -> None:
        """The notebook's hints for a cell arriving at ``arrival`` (SimConfig.hint_ahead_s)."""
        cfg, rng = self.cfg, self._hint_rng
        if cfg.hint_ahead_s <= 0 or self.policy is None or rng.random() >= cfg.hint_fraction:
            return
        at = max(ready, arrival - cfg.hint_ahead_s)
        self._at(at, "hint", u.user.name, True)
        others = [x for x in self.users if x != u.user.name]
        wrong = int(cfg.false_hints) + (rng.random() < cfg.false_hints % 1)
        for _ in range(wrong if others else 0):
            self._at(at, "hint", rng.choice(others), False)

    def _warm_step(self) -> None:
        """A warm start: load the next user once nothing moves; start the clock after the last."""
        if self._warm_busy or any(kind in _MOVES for _, _, kind, _, _ in self.heap):
            return
        if self._to_warm:
            u = self._to_warm.pop(0)
            self._warm_busy = True
            self._at(self.now + WARM_GAP_S, "warm", u.user.name)
            return
        self._warming = False
        self.t0 = self.now + WARM_GAP_S
        self.warm_pool = {
            u.user.name: {"resident": u.on_gpu, "evicted": self._movable(u) - u.on_gpu}
            for u in self.users.values()
        }
        for u in self.users.values():
            self._next_cell(u, self.t0)

    def _cell_record(self, u: _U, end: float | None, ok: bool, error: str = "") -> dict[str, Any]:
        cell = u.user.cells[u.cell]
        return {
            "user": u.user.name,
            "cell": u.cell,
            "arrival": u.arrival - self.t0,
            "end": None if end is None else end - self.t0,
            "ok": ok,
            "error": error,
            "solo": solo_seconds(u.user, cell, self.cfg),
        }

    def _finish(self, u: _U, ok: bool, error: str = "") -> None:
        u.in_cell = False
        u.work = 0.0
        if u.warming:  # loaded: its notebook says idle and gives the device back (the worker)
            u.warming = self._warm_busy = False
            self._send(ev.Idle(self.now, u.user.name))
            self._send(ev.AdminRelease(self.now, u.user.name))
            return
        self.cells.append(self._cell_record(u, self.now, ok, error))
        if self.policy is not None:
            self._send(ev.Idle(self.now, u.user.name))
        self._next_cell(u, self.now)

    def _on(self, kind: str, u: _U, arg: Any) -> None:
        name = u.user.name
        if kind in ("arrive", "warm"):
            u.in_cell = True
            u.warming = kind == "warm"
            u.arrival = self.now
            self._stale(u)  # its cell writes its memory: a copy is no longer valid
            cell = {"gpu": WARM_CELL_S} if u.warming else u.user.cells[u.cell]
            u.work = u.solo = solo_seconds(u.user, cell, self.cfg)
            if self.mode == "colocate" and not u.allocated:
                used = sum(
                    self._movable(x) for x in self.users.values() if x.allocated
                ) + self.cfg.context_bytes * len(self.users)
                if used + self._movable(u) > self.cfg.pool_bytes:
                    self._finish(u, ok=False, error="out of memory")
                    return
                u.allocated = True
            if self.policy is not None:
                self._send(ev.Busy(self.now, name))
                if not u.holding:
                    self._send(ev.Request(self.now, name, **self._mem(u)))
        elif kind == "hint":
            self.hints[0 if arg else 1] += 1
            if not u.in_cell:
                self._send(ev.Coming(self.now, name))
        elif kind == "drained":
            u.holding = False
            moved, evict_s = self._evict(u, max(0, arg)) if arg else (0, 0.0)
            self._at(self.now + evict_s, "released", name, (bool(arg), moved, evict_s))
        elif kind == "released":
            evicted, moved, evict_s = arg
            micros = int(evict_s * 1e6)
            self._send(ev.Released(self.now, name, evicted, moved, micros))
            if u.in_cell and u.work > 0 and not u.holding:
                self._send(ev.Request(self.now, name, **self._mem(u)))
        elif kind == "evicted":
            moved, secs = arg
            self._send(ev.Evicted(self.now, name, moved, int(secs * 1e6)))
        elif kind == "precopied" and arg[0] == u.copy_gen:  # valid: no cell, no eviction since
            u.copied = min(u.on_gpu, arg[1])
            mem = self._mem(u)
            self._send(ev.Memory(self.now, name, **mem, precopied=u.copied))
        elif kind == "ahead":
            back, secs = arg
            # As the engine: a restore does not mark its blocks clean (no valid host copy), so
            # only the bytes that stayed resident keep theirs; a later PRECOPY copies the rest.
            copied = u.copied if self.cfg.model_precopy else 0
            self._send(ev.Restored(self.now, name, back, int(secs * 1e6), True, 0, copied))
        elif kind == "restored":
            back, secs = arg
            self._send(ev.Restored(self.now, name, back, int(secs * 1e6)))


def summarize(cells: list[dict[str, Any]], horizon: float, warmup: float = 0.0) -> dict[str, Any]:
    """Slowdown and added latency percentiles, failed and unfinished cells, GPU busy fraction.

    Cells that arrived before ``warmup`` are left out (the start-up transient: every user's
    first cell arrives within one think time of the start). Unfinished cells (cut at the end of
    the run) enter the distributions with the lower bound of their latency (cut time -
    arrival), so a stuck queue cannot look fast. ``added`` is latency minus solo time: the
    seconds a user waits beyond a dedicated GPU. ``short_*`` are the cells under
    ``SHORT_CELL`` solo seconds; ``long_throughput`` is the solo seconds of the cells of at
    least ``LONG_CELL`` divided by their latency (1 on a dedicated GPU).
    """
    kept = [c for c in cells if c["arrival"] >= warmup]
    done = [c for c in kept if c["ok"] and c["end"] is not None]
    failed = [c for c in kept if not c["ok"] and c.get("error") != "unfinished"]
    unfinished = [c for c in kept if c.get("error") == "unfinished"]
    cut = max([horizon, *(c["end"] for c in done)])
    measured = [(c, c["end"] - c["arrival"]) for c in done]
    measured += [(c, cut - c["arrival"]) for c in unfinished]
    slow = [lat / c["solo"] for c, lat in measured]
    added = [lat - c["solo"] for c, lat in measured]
    short = [lat - c["solo"] for c, lat in measured if c["solo"] < SHORT_CELL]
    long_ = [(c["solo"], lat) for c, lat in measured if c["solo"] >= LONG_CELL]
    busy = sum(c["solo"] for c in done)
    span = cut - warmup
    return {
        "cells": len(kept),
        "completed": len(done),
        "failed": len(failed),
        "unfinished": len(unfinished),
        "slowdown_p50": percentile(slow, 50),
        "slowdown_p95": percentile(slow, 95),
        "slowdown_max": max(slow) if slow else float("nan"),
        "added_p50": percentile(added, 50),
        "added_p95": percentile(added, 95),
        "short_cells": len(short),
        "short_added_p95": percentile(short, 95),
        "long_cells": len(long_),
        "long_throughput": (
            sum(s for s, _ in long_) / sum(lat for _, lat in long_) if long_ else float("nan")
        ),
        "gpu_busy_fraction": busy / span if span > 0 else 0.0,
        "makespan": cut,
    }


def simulate(trace_cfg: TraceConfig, mode: str, cfg: SimConfig | None = None) -> dict[str, Any]:
    cfg = cfg or SimConfig()
    cells = Simulation(generate(trace_cfg), mode, trace_cfg.horizon, cfg).run()
    out = summarize(cells, trace_cfg.horizon)
    if mode == "dedicated":
        out["gpu_busy_fraction"] /= trace_cfg.users  # one GPU per user
        out["gpus"] = trace_cfg.users
    else:
        out["gpus"] = 1
    return {"mode": mode, "users": trace_cfg.users, "summary": out, "cells": cells}


def capacity_sweep(
    base: TraceConfig, users: list[int], modes: tuple[str, ...], cfg: SimConfig, seeds: int = 5
) -> list[dict[str, Any]]:
    """Users per GPU vs p95 slowdown, each point pooled over ``seeds`` seeded traces."""
    rows = []
    for n in users:
        for mode in modes:
            cells: list[dict[str, Any]] = []
            for s in range(seeds):
                tc = TraceConfig(**{**base.__dict__, "users": n, "seed": base.seed + 1000 * s})
                cells += Simulation(generate(tc), mode, tc.horizon, cfg).run()
            summary = summarize(cells, base.horizon)
            summary["gpu_busy_fraction"] /= seeds
            rows.append({"users": n, "mode": mode, **summary})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description="Simulate the multi-user replay (capacity planning).")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--horizon", type=float, default=100.0)
    ap.add_argument("--pool-gib", type=float, default=40.0)
    ap.add_argument(
        "--think", type=float, default=TraceConfig.think_mean, help="mean think time (seconds)"
    )
    ap.add_argument(
        "--real-time",
        action="store_true",
        help="scale think and GPU times by TIME_SCALE (the trace at real time, same duty cycle)",
    )
    ap.add_argument("--evict-gbps", type=float, default=10.0, help="eviction bandwidth, GB/s")
    ap.add_argument("--restore-gbps", type=float, default=48.0, help="restore bandwidth, GB/s")
    ap.add_argument("--sweep", help="comma-separated user counts: print a capacity table")
    args = ap.parse_args()
    cfg = SimConfig(
        pool_bytes=int(args.pool_gib * GiB),
        evict_bw=args.evict_gbps * 1e9,
        restore_bw=args.restore_gbps * 1e9,
    )
    tc = TraceConfig(users=args.users, seed=args.seed, horizon=args.horizon, think_mean=args.think)
    if args.real_time:
        tc = scaled(tc, TIME_SCALE, horizon=args.horizon)
    if args.sweep:
        rows = capacity_sweep(tc, [int(x) for x in args.sweep.split(",")], MODES, cfg)
        for r in rows:
            print(
                json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
            )
        return
    for mode in MODES:
        s = simulate(tc, mode, cfg)["summary"]
        print(
            mode,
            json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()}),
        )


if __name__ == "__main__":
    main()
