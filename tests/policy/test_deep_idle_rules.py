"""The pure deep-idle rules (jupyter_gpushare/scheduler/features/deep_idle.py): when a kernel
is evicted, put to sleep and woken, and that no grant reaches a process that is not awake."""

from __future__ import annotations

from jupyter_gpushare.scheduler.features.deep_idle import (
    ClientView,
    DeepIdle,
    EvictFirst,
    Phase,
    Sleep,
    Wake,
)

GiB = 1 << 30


def view(state: str = "idle", resident: int = 0, **kw: object) -> ClientView:
    args: dict[str, object] = {"id": "k", "pid": 42, "state": state, "resident_bytes": resident}
    args.update(kw)
    return ClientView(**args)  # type: ignore[arg-type]


def asleep_at(t: float = 100.0) -> DeepIdle:
    d = DeepIdle(60.0)
    d.observe([view()], 0.0)
    assert d.observe([view()], t) == [Sleep("k", 42)]
    assert d.slept("k", True, t + 1) == []
    return d


def test_an_idle_evicted_client_sleeps_after_the_idle_time_and_not_before() -> None:
    d = DeepIdle(60.0)
    assert d.observe([view()], 10.0) == []
    assert d.next_deadline() == 70.0
    assert d.observe([view()], 69.9) == []
    assert d.observe([view()], 70.0) == [Sleep("k", 42)]
    assert d.phase("k") is Phase.SLEEPING
    assert d.next_deadline() is None  # nothing else is due
    d.slept("k", True, 71.0)
    assert d.phase("k") is Phase.ASLEEP and d.asleep() == ["k"]


def test_resident_memory_is_evicted_first_then_the_client_sleeps() -> None:
    d = DeepIdle(60.0)
    d.observe([view(resident=GiB)], 0.0)
    assert d.observe([view(resident=GiB)], 60.0) == [EvictFirst("k")]
    assert d.next_deadline() is None  # the Evicted answer is what comes next, not a timer
    assert d.observe([view(state="evicting", resident=GiB)], 61.0) == []  # not activity
    assert d.observe([view()], 62.0) == [Sleep("k", 42)]


def test_an_eviction_that_freed_nothing_does_not_loop_the_sleep_goes_ahead() -> None:
    d = DeepIdle(60.0)
    d.observe([view(resident=GiB)], 0.0)
    assert d.observe([view(resident=GiB)], 60.0) == [EvictFirst("k")]
    assert d.observe([view(resident=GiB)], 60.5) == [Sleep("k", 42)]


def test_activity_restarts_the_idle_clock() -> None:
    d = DeepIdle(60.0)
    d.observe([view()], 0.0)
    d.observe([view(state="running")], 50.0)
    d.observe([view()], 55.0)
    assert d.observe([view()], 100.0) == []
    assert d.observe([view()], 115.0) == [Sleep("k", 42)]
    d2 = DeepIdle(60.0)
    d2.observe([view()], 0.0)
    assert d2.activity("k", 30.0) == []  # a busy notebook of an awake kernel
    assert d2.observe([view()], 61.0) == []


def test_off_when_zero() -> None:
    d = DeepIdle(0.0)
    assert not d.enabled
    d.observe([view()], 0.0)
    assert d.observe([view()], 1e9) == []
    assert d.next_deadline() is None


def test_a_process_the_scheduler_may_not_checkpoint_is_never_due() -> None:
    d = DeepIdle(60.0)
    assert d.observe([view(may_checkpoint=False)], 0.0) == []
    assert d.observe([view(may_checkpoint=False)], 1e6) == []
    assert d.next_deadline() is None  # and no timer spins for it


def test_request_or_busy_wakes_and_the_grant_waits_for_the_wake() -> None:
    d = asleep_at(100.0)
    assert d.activity("k", 200.0) == [Wake("k", 42)]
    assert d.activity("k", 200.1) == []  # one wake
    assert d.hold_grant("k", 200.2)  # the policy granted at once: held
    assert not d.may_grant("k")
    assert abs(d.extra_wait("k", 201.0) - 0.8) < 1e-9
    d.woke("k", 201.5)
    assert d.may_grant("k") and not d.hold_grant("k", 201.6)
    assert abs(d.extra_wait("k", 300.0) - 1.3) < 1e-9  # counted into its wait, once
    assert d.phase("k") is Phase.AWAKE


def test_a_wake_asked_during_the_checkpoint_follows_it() -> None:
    d = DeepIdle(60.0)
    d.observe([view()], 0.0)
    assert d.observe([view()], 60.0) == [Sleep("k", 42)]
    assert d.activity("k", 60.5) == []
    assert d.hold_grant("k", 60.5)
    assert d.slept("k", True, 61.0) == [Wake("k", 42)]
    assert d.phase("k") is Phase.WAKING


def test_a_failed_sleep_leaves_it_awake_and_is_not_retried_in_the_same_idle_period() -> None:
    d = DeepIdle(60.0)
    d.observe([view()], 0.0)
    assert d.observe([view()], 60.0) == [Sleep("k", 42)]
    assert d.slept("k", False, 61.0) == []
    assert d.may_grant("k")
    assert d.observe([view()], 500.0) == []
    assert d.next_deadline() is None
    d.activity("k", 600.0)  # it ran again: a new idle period may sleep
    d.observe([view()], 601.0)
    assert d.observe([view()], 661.0) == [Sleep("k", 42)]


def test_a_client_that_leaves_is_forgotten() -> None:
    d = asleep_at()
    d.leave("k")
    assert d.phase("k") is Phase.AWAKE and d.asleep() == []
    d2 = asleep_at()
    d2.observe([], 300.0)  # gone from the policy's view
    assert d2.asleep() == []


def test_an_idle_holder_is_released_with_eviction_before_it_sleeps() -> None:
    d = DeepIdle(60.0)
    d.observe([view(state="running", idle=True)], 0.0)
    assert d.observe([view(state="running", idle=True)], 60.0) == [EvictFirst("k")]
    assert d.observe([view(state="running", idle=True)], 60.1) == []  # never asleep holding
    assert d.observe([view(state="revoking")], 60.2) == []  # its own revoke is no activity
    assert d.observe([view()], 60.5) == [Sleep("k", 42)]


def test_a_busy_holder_is_never_due() -> None:
    d = DeepIdle(60.0)
    d.observe([view(state="running", resident=GiB)], 0.0)
    assert d.observe([view(state="running", resident=GiB)], 1e6) == []
    assert d.next_deadline() is None


def test_only_root_or_the_same_user_may_checkpoint() -> None:
    from jupyter_gpushare.scheduler.features.checkpoint import may_checkpoint

    assert may_checkpoint(1000, own_euid=0)
    assert may_checkpoint(1000, own_euid=1000)
    assert not may_checkpoint(1001, own_euid=1000)
    assert not may_checkpoint(-1, own_euid=1000)  # a client whose uid is unknown


def test_a_program_jupyter_does_not_report_is_never_due() -> None:
    """Only notebook kernels sleep (a busy wakes them before their first CUDA call)."""
    d = DeepIdle(60.0)
    plain = view(notebook=False)
    assert d.observe([plain], 0.0) == []
    assert d.observe([plain], 600.0) == []
    assert d.next_deadline() is None
    # The same client as a notebook kernel sleeps at the same times.
    d = DeepIdle(60.0)
    assert d.observe([view()], 0.0) == []
    assert d.observe([view()], 600.0) == [Sleep("k", 42)]
