"""The fixed-quantum policy option: an exclusive lock with a timer-based idle check.

A baseline for the benchmarks (bench/replay.py mode c), run by the same scheduler
(``--policy fixed-quantum``): one holder at a time, first come first served; while others wait,
the holder keeps the device for ``fixed_quantum`` seconds unless a check every
``idle_check_interval`` seconds (from its grant) finds it idle for the whole interval.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from test_policy_properties import CONFIG, POOLS, PolicyMachine
from test_policy_scenarios import DEV, GB, device, join, part, request

from jupyter_gpushare.scheduler.core.events import (
    Busy,
    Evict,
    Evicted,
    Grant,
    Idle,
    Released,
    Revoke,
    Tick,
)
from jupyter_gpushare.scheduler.core.policy import Policy, PolicyConfig

FQ = {"policy": "fixed-quantum", "fixed_quantum": 30.0, "idle_check_interval": 5.0}


def make(pool: int = 100 * GB, **config: object) -> Policy:
    policy = Policy(PolicyConfig(**{**FQ, **config}))  # type: ignore[arg-type]
    policy.add_device(DEV, name="Test GPU", total_bytes=pool + 5 * GB, pool_bytes=pool)
    return policy


def test_config_names_a_known_policy():
    with pytest.raises(ValueError, match="unknown policy"):
        PolicyConfig(policy="round-robin")
    with pytest.raises(ValueError, match="positive"):
        PolicyConfig(policy="fixed-quantum", idle_check_interval=0)
    assert PolicyConfig().policy == "gpushare"


def test_exclusive_even_when_both_fit():
    p = make()
    join(p, "a")
    join(p, "b", user="bob")
    assert request(p, "a", 10) == [Grant("a")]
    assert request(p, "b", 10, now=1) == []  # 20 GB of 100 would fit: a lock says no
    dev = device(p, 1)
    assert dev["holders"] == ["a"] and dev["queue"] == ["b"] and dev["mode"] == "turns"
    # Deadlines: the idle checks every 5 s from the grant, and the quantum.
    assert p.next_deadline() == 5.0


def test_cell_end_is_seen_by_the_timer_not_at_once():
    p = make()
    join(p, "a")
    join(p, "b", user="bob")
    request(p, "a", 10)
    request(p, "b", 10, now=1)
    assert p.handle(Idle(2.0, "a")) == []  # the gpushare policy would revoke here
    assert p.handle(Tick(5.0)) == []
    # At the check of t=5, a had been idle since 2 only: not the whole interval [0, 5].
    assert p.next_deadline() == 10.0
    assert p.handle(Tick(10.0)) == [Revoke("a", evict=False, reason="idle")]
    assert p.handle(Released(10.01, "a")) == [Grant("b")]


def test_busy_holder_keeps_the_lock_for_the_quantum():
    p = make()
    join(p, "a")
    join(p, "b", user="bob")
    request(p, "a", 10)
    request(p, "b", 10, now=1)
    for t in (5.0, 10.0, 15.0, 20.0, 25.0):
        assert p.handle(Tick(t)) == []
    # A new cell resets the idle view: idle at 26, busy again at 27, checked at 30 = quantum.
    p.handle(Idle(26.0, "a"))
    p.handle(Busy(27.0, "a"))
    assert p.handle(Tick(30.0)) == [Revoke("a", evict=False, reason="quantum expired")]


def test_first_come_first_served_and_no_deadline_without_waiters():
    p = make()
    for cid, user in (("a", "alice"), ("b", "bob"), ("c", "carol")):
        join(p, cid, user=user)
    request(p, "a", 10)
    p.handle(Idle(1.0, "a"))
    assert p.next_deadline() is None  # an idle holder nobody waits for keeps the device
    request(p, "c", 10, now=2)
    request(p, "b", 10, now=3)
    assert p.handle(Tick(10.0)) == [Revoke("a", evict=False, reason="idle")]
    assert p.handle(Released(10.0, "a")) == [Grant("c")]  # c asked first


def test_memory_moves_as_under_gpushare():
    p = make()
    join(p, "a")
    join(p, "b", user="bob")
    request(p, "a", 60)
    request(p, "b", 60, now=1)
    # b needs the room: the holder is revoked with eviction at the end of its quantum.
    assert p.handle(Tick(30.0)) == [Revoke("a", evict=True, reason="quantum expired")]
    assert p.handle(Released(31.0, "a", evicted=True)) == [Grant("b")]
    p.handle(Idle(32.0, "b"))
    request(p, "a", 60, now=33)
    # Checks from b's grant at 31: at 36 it had been idle since 32 only; at 41, the whole interval.
    assert p.handle(Tick(36.0)) == []
    assert p.handle(Tick(41.0)) == [Revoke("b", evict=True, reason="idle")]
    assert p.handle(Released(42.0, "b", evicted=True)) == [Grant("a", restore=True)]


def test_idle_clients_are_evicted_for_the_next_holder():
    p = make()
    join(p, "a")
    join(p, "b", user="bob")
    request(p, "a", 60)
    p.handle(Idle(1.0, "a"))
    p.handle(Released(2.0, "a"))  # gave the device back (e.g. %gpushare release): resident
    # Only the 20 GB b misses leave (partial eviction, rounded up to the engine's block).
    assert request(p, "b", 60, now=3) == [Evict("a", reason="room for b", bytes=part(20))]
    assert p.handle(Evicted(4.0, "a", 59 * GB, 1_000_000)) == [Grant("b")]


class FixedQuantumMachine(PolicyMachine):
    """The property-based machine of the gpushare policy, run against the fixed-quantum lock:
    every decision legitimate for its receiver, and every waiter granted within the bound."""

    def __init__(self) -> None:
        super().__init__()
        base = {k: v for k, v in CONFIG.__dict__.items() if k not in FQ}
        self.policy = Policy(PolicyConfig(**{**base, **FQ}))  # type: ignore[arg-type]
        for uuid, pool in POOLS.items():
            self.policy.add_device(uuid, name=uuid, total_bytes=pool * 2, pool_bytes=pool)


TestFixedQuantumProperties = FixedQuantumMachine.TestCase
TestFixedQuantumProperties.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_the_scheduler_configures_the_policy():
    from traitlets import TraitError

    from jupyter_gpushare.cli import SchedulerApp
    from jupyter_gpushare.scheduler.shell.server import GPUShareScheduler

    sched = GPUShareScheduler(
        scheduling_policy="fixed-quantum", fixed_quantum=12.0, idle_check_interval=2.0
    )
    cfg = sched.policy_config()
    assert (cfg.policy, cfg.fixed_quantum, cfg.idle_check_interval) == ("fixed-quantum", 12, 2)
    assert GPUShareScheduler().policy_config().policy == "gpushare"
    with pytest.raises(TraitError):
        GPUShareScheduler(scheduling_policy="round-robin")
    app = SchedulerApp()
    app.initialize(["--policy", "fixed-quantum"])
    assert GPUShareScheduler(parent=app).policy_config().policy == "fixed-quantum"
