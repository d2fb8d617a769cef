"""The simulated engine as the GPU measured it (issue 35, item 6): a kernel's first restore is the
slow one, moves in one direction share the bus, and the node's host staging is one queue."""

from __future__ import annotations

import dataclasses

import pytest

from bench.simulator import SimConfig, Simulation
from bench.trace import GiB, User
from jupyter_gpushare.scheduler.core import costs
from jupyter_gpushare.scheduler.core import events as ev

CFG = SimConfig(pool_bytes=40 * GiB, handoff_s=0.0)


def _sim(cfg: SimConfig, n: int = 2, ws: int = 8 * GiB) -> Simulation:
    users = [User(f"u{i}", ws, [{"think": 1.0, "gpu": 0.5}]) for i in range(n)]
    sim = Simulation(users, "gpushare", 100.0, cfg)
    for u in sim.users.values():
        u.allocated_at, u.staged_at, u.on_gpu = 0.0, 0.0, 0  # backed long ago, all of it away
    sim.now = 10.0
    return sim


def test_a_kernels_first_restore_runs_at_the_measured_first_restore_bandwidth():
    sim = _sim(CFG, n=1)
    u = sim.users["u0"]
    sim._decide(ev.Grant("u0", restore=True))
    first = u.blocked_until - sim.now
    u.on_gpu, sim.now = 0, 20.0
    sim._decide(ev.Grant("u0", restore=True))
    second = u.blocked_until - sim.now
    assert first == pytest.approx(8 * GiB / costs.FIRST_RESTORE_BPS)
    assert second == pytest.approx(8 * GiB / costs.RESTORE_BPS)
    assert first > 7 * second  # 6.1 against 48.5 GB/s
    # switched off: the first is as fast as the rest
    sim = _sim(dataclasses.replace(CFG, first_restore_bw=0.0), n=1)
    sim._decide(ev.Grant("u0", restore=True))
    assert sim.users["u0"].blocked_until - sim.now == pytest.approx(second)


def test_restores_decided_together_share_the_bus_and_evictions_take_the_other_direction():
    for u in (sim := _sim(CFG)).users.values():
        u.restored = True
    alone = 8 * GiB / costs.RESTORE_BPS
    sim._decide(ev.Grant("u0", restore=True))
    sim._decide(ev.Grant("u1", restore=True))
    ends = sorted(u.blocked_until - sim.now for u in sim.users.values())
    assert ends == pytest.approx([alone, 2 * alone])  # one after the other
    # an eviction at the same moment runs beside them (device to host: the other direction)
    sim.users["u0"].copied = 0
    moved, secs = sim._evict(sim.users["u0"], 4 * GiB)
    assert moved == 4 * GiB and secs == pytest.approx(4 * GiB / costs.EVICT_STAGED_BPS)
    assert sim.moved == {"d2h": 4 * GiB, "h2d": 16 * GiB}
    # each alone (shared_bus off): both restores take the time of one
    sim = _sim(dataclasses.replace(CFG, shared_bus=False))
    for u in sim.users.values():
        u.restored = True
    sim._decide(ev.Grant("u0", restore=True))
    sim._decide(ev.Grant("u1", restore=True))
    assert [u.blocked_until - sim.now for u in sim.users.values()] == pytest.approx([alone] * 2)


def test_an_unmap_of_pre_copied_memory_does_not_wait_for_the_bus():
    sim = _sim(CFG)
    sim.bus_free["d2h"] = sim.now + 5.0  # a long eviction under way
    u = sim.users["u1"]
    u.on_gpu = u.copied = 8 * GiB
    moved, secs = sim._evict(u, 0)
    assert moved == 0 and secs == pytest.approx(8 * costs.UNMAP_S_PER_GIB)


def test_thirty_two_allocations_at_once_stage_one_after_another():
    """32 kernels of 1 GiB backed at once (the GPU record: ready 0.81-4.9 s): the last one's
    staging is ready about 4.9 s after its allocation; an eviction before that is cold."""
    users = [User(f"k{i}", GiB, [{"think": 1.0, "gpu": 0.1}]) for i in range(32)]
    sim = Simulation(users, "gpushare", 100.0, CFG)
    sim.now = 1.0
    for u in sim.users.values():
        sim._allocate(u)
    ready = sorted(u.staged_at - sim.now for u in sim.users.values())
    assert ready[0] == pytest.approx(costs.staging_ready_after(GiB))
    assert ready[-1] == pytest.approx(4.9, abs=0.1)
    last = max(sim.users.values(), key=lambda u: u.staged_at)
    last.on_gpu = GiB
    sim.now = 1.0 + 3.0  # a lone allocation's staging would be ready by now
    _, secs = sim._evict(last, 0)
    assert secs == pytest.approx(GiB / costs.EVICT_COLD_BPS)
    alone = Simulation(users, "gpushare", 100.0, dataclasses.replace(CFG, shared_staging=False))
    alone.now = 1.0
    for u in alone.users.values():
        alone._allocate(u)
    assert max(u.staged_at for u in alone.users.values()) - 1.0 == pytest.approx(ready[0])
