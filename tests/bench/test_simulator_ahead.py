"""Restore ahead in the simulator (SimConfig.restore_ahead): the move takes its time at the
restore bandwidth while others compute, the grant that comes first waits for it, and the memory
comes back without a host copy, as in the engine since a restore stopped marking its blocks clean
(only the bytes that stayed resident keep theirs; a later pre-copy copies the rest)."""

from __future__ import annotations

import dataclasses
import heapq

from bench.simulator import SimConfig, Simulation, policy_config
from bench.trace import GiB, User
from jupyter_gpushare.scheduler.core import events as ev

CFG = SimConfig(pool_bytes=40 * GiB, model_precopy=True, handoff_s=0.0, restore_ahead=True)


def sim_with_a_away() -> tuple[Simulation, int]:
    """u0 (12 GiB) ran and 8 GiB of it left, the 4 GiB that stayed pre-copied; its restore ahead
    is decided at t = 10 s."""
    users = [User("u0", 12 * GiB, [{"think": 1.0, "gpu": 0.5}])]
    sim = Simulation(users, "gpushare", 100.0, CFG)
    sim.log = []
    u = sim.users["u0"]
    u.allocated_at, u.on_gpu, u.copied = 0.0, 4 * GiB, 4 * GiB
    u.restored = True  # not its first restore (that one is slower: test_simulator_engine.py)
    sim.now = 10.0
    return sim, 8 * GiB


def test_the_policy_of_the_simulation_restores_ahead_when_configured():
    assert policy_config("gpushare", CFG).restore_ahead
    assert not policy_config(
        "gpushare", dataclasses.replace(CFG, restore_ahead=False)
    ).restore_ahead


def test_a_restore_ahead_takes_the_restore_time_and_its_bytes_come_back_without_a_copy():
    sim, back = sim_with_a_away()
    sim._decide(ev.RestoreAhead("u0", back))
    u = sim.users["u0"]
    assert u.on_gpu == 12 * GiB  # counted on the GPU from the decision, as the policy counts it
    secs = back / CFG.restore_bw
    (t, _, kind, name, _arg) = sim.heap[0]
    assert (kind, name) == ("ahead", "u0") and abs(t - (10.0 + secs)) < 1e-9
    sim.now = t
    sent: list[ev.Event] = []
    sim._send = sent.append  # type: ignore[method-assign]
    sim._on(kind, u, _arg)
    (answer,) = sent
    assert isinstance(answer, ev.Restored) and answer.ahead and answer.bytes_moved == back
    assert answer.evicted_bytes == 0 and answer.precopied == 4 * GiB
    assert u.copied == 4 * GiB  # evicting the restored 8 GiB again is a copy, not an unmap


def test_a_pre_copy_after_the_restore_ahead_copies_the_restored_bytes():
    sim, back = sim_with_a_away()
    sim._decide(ev.RestoreAhead("u0", back))
    (t, _, kind, _name, arg) = heapq.heappop(sim.heap)
    sim.now = t
    sim._send = lambda e: None  # type: ignore[method-assign]
    sim._on(kind, sim.users["u0"], arg)
    sim._decide(ev.Precopy("u0"))
    (t, _, kind, _name, arg) = heapq.heappop(sim.heap)
    assert kind == "precopied" and abs(t - (sim.now + back / CFG.precopy_bw)) < 1e-9
    sim.now = t
    sim._on(kind, sim.users["u0"], arg)
    assert sim.users["u0"].copied == 12 * GiB


def test_a_grant_during_the_restore_ahead_waits_for_it():
    sim, back = sim_with_a_away()
    sim._decide(ev.RestoreAhead("u0", back))
    sim.now = 10.05  # granted before the move is done
    sim._decide(ev.Grant("u0", restore=True))
    u = sim.users["u0"]
    assert abs(u.blocked_until - (10.0 + back / CFG.restore_bw)) < 1e-9
