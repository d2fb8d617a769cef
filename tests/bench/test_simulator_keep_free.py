"""keep_free in the simulator (SimConfig.model_precopy): the same policy object, with the shim's
pre-copy and the driver's unmap modelled, keeps room before an arrival, so the arrival is
granted at once instead of after an unmap."""

from __future__ import annotations

import dataclasses

import pytest

from bench.simulator import SimConfig, Simulation, policy_config
from bench.trace import GiB, User
from jupyter_gpushare.scheduler.core import events as ev
from jupyter_gpushare.scheduler.core.room import REASON_ROOM, KeepFree

CFG = SimConfig(pool_bytes=40 * GiB, model_precopy=True, handoff_s=0.0)


def users() -> list[User]:
    """Three 12 GiB notebooks run a cell and idle; a fourth arrives at t = 100 s."""
    idle = [User(f"u{i}", 12 * GiB, [{"think": 1.0 + i, "gpu": 0.5}]) for i in range(3)]
    return [*idle, User("late", 12 * GiB, [{"think": 100.0, "gpu": 0.5}])]


def run(keep: KeepFree) -> Simulation:
    config = dataclasses.replace(policy_config("gpushare", CFG), keep_free=keep)
    sim = Simulation(users(), "gpushare", 200.0, CFG, config=config)
    sim.log = []
    sim.run()
    return sim


def grant_wait(sim: Simulation, client: str) -> float:
    """Seconds from the client's first Request to its first Grant."""
    assert sim.log is not None
    asked = next(e.now for e, _ in sim.log if isinstance(e, ev.Request) and e.client == client)
    granted = next(
        e.now
        for e, ds in sim.log
        if any(isinstance(d, ev.Grant) and d.client == client for d in ds)
    )
    return granted - asked


def room_revokes(sim: Simulation) -> list[tuple[float, str]]:
    assert sim.log is not None
    return [
        (e.now, d.client)
        for e, ds in sim.log
        for d in ds
        if isinstance(d, ev.Revoke | ev.Evict) and d.reason == REASON_ROOM
    ]


def test_with_room_kept_the_arrival_is_granted_at_once():
    sim = run(KeepFree(auto=True))
    # auto: room for the 12 GiB arrivals seen, at most a quarter of the pool (10 GiB); 2.5 GiB
    # were free, so u0 (least recently used, its copy done) left long before "late" came.
    (when, who), *_ = room_revokes(sim)
    assert who == "u0" and when < 100.0
    assert grant_wait(sim, "late") == 0.0
    assert all(c["ok"] for c in sim.cells) and len(sim.cells) == 4


def test_without_it_the_arrival_waits_for_the_unmap():
    sim = run(KeepFree())
    assert room_revokes(sim) == []
    # u0, an idle holder, is revoked (its launched work drains) and evicted in the arrival's
    # wait: an unmap (its copy was valid), not a copy at evict_bw, of only the 10 GiB "late"
    # misses (40 GiB pool, 3 x 12.5 GiB held, "late"'s own 0.5 GiB context: partial eviction).
    unmap = 10 * CFG.unmap_s_per_gib
    assert grant_wait(sim, "late") == pytest.approx(CFG.drain_s + unmap)
    assert unmap < 12 * GiB / CFG.evict_bw / 4


def test_an_unmap_reports_no_bytes_copied_as_the_engine_does():
    """The engine reports the bytes it copied (native/src/memory_move.c): evicting pre-copied
    memory is an unmap and reports none, so the policy's eviction bandwidth (an EWMA of the
    reports) follows the copies, and its unmap estimate the unmaps."""
    sim = run(KeepFree())
    assert sim.log is not None
    (unmap,) = [e for e, _ in sim.log if isinstance(e, ev.Released) and e.evicted]
    assert unmap.client == "u0" and unmap.bytes_moved == 0 and unmap.micros > 0
    assert sim.policy is not None
    (dev,) = sim.policy._devices.values()
    assert dev.evict_bw == CFG.evict_bw  # no copy was measured
    assert dev.unmap_s_per_byte == pytest.approx(CFG.unmap_s_per_gib / GiB, rel=0.01)
