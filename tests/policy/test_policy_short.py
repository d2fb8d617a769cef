"""Short cells first under memory pressure (jupyter_gpushare/scheduler/core/policy_short.py): a
notebook's short cell queues ahead of waiters that have waited long, and has a longer busy
holder's memory moved out before that holder's quantum ends, when the move costs less than the
holder's cell is expected to run on."""

from __future__ import annotations

from jupyter_gpushare.scheduler.core.events import (
    Busy,
    Grant,
    Join,
    Released,
    Request,
    Revoke,
    Tick,
)
from jupyter_gpushare.scheduler.core.policy import REASON_ORDER, Policy, PolicyConfig

GB = 10**9
PIN = GB // 2  # each client's context, pinned
DEV = "GPU-0"


def make_policy(**kw: object) -> Policy:
    policy = Policy(PolicyConfig(**kw))  # type: ignore[arg-type]
    policy.add_device(DEV, name="Test GPU", total_bytes=50 * GB, pool_bytes=40 * GB)
    return policy


def cell(p: Policy, client: str, gb: float, now: float, notebook: bool = True) -> list:
    """``client`` (a notebook's kernel, or a plain program) starts a cell that needs ``gb`` GB."""
    p.handle(Join(now, client, DEV, client))
    used = int(gb * GB)
    out = p.handle(Busy(now, client)) if notebook else []
    return out + p.handle(Request(now, client, used=used, managed=used - PIN, pinned=PIN))


def long_cell_then_a_waiter(p: Policy) -> None:
    """A notebook runs a long cell in 30 GB of a 40 GB pool; a plain program waits for 30 GB."""
    assert cell(p, "a", 30, now=0) == [Grant("a")]
    assert cell(p, "b", 30, now=1, notebook=False) == []  # a's quantum (14.4 s) runs on


def test_a_short_cell_goes_first_and_moves_only_what_it_misses_out_of_a_long_cell():
    p = make_policy()
    long_cell_then_a_waiter(p)
    # At 5 s a's cell has had 5 GPU-seconds (ordering level 2); s's new cell has had none. s
    # misses 11 GB: moving them out and back (~1.3 s) costs less than a's cell is expected to
    # run on (as long again as it ran), so a gives them now, not at the end of its quantum,
    # and s, not b (waiting since 1 s), gets the room.
    out = cell(p, "s", 20, now=5)
    assert out == [Revoke("a", evict=True, reason=REASON_ORDER, evict_bytes=10502537216)]
    assert p.handle(Released(5.1, "a", evicted=True, bytes_moved=11 * GB, micros=220_000)) == [
        Grant("s")
    ]


def test_without_the_rule_the_short_cell_waits_behind_the_long_one_and_the_waiter():
    p = make_policy(short_first=False)
    long_cell_then_a_waiter(p)
    assert cell(p, "s", 20, now=5) == []  # b is blocked first in line: s is not even looked at
    assert p.next_deadline() == 6.0  # b reserves then; a keeps the device until 14.4 s


def test_a_short_cell_does_not_move_a_long_cell_whose_rest_is_shorter_than_the_move():
    p = make_policy(evict_bandwidth=1e9)  # 11 GB out and back: ~11 s
    long_cell_then_a_waiter(p)
    assert cell(p, "s", 20, now=5) == []  # a is expected to run ~5 s more: s waits for it


def test_a_short_cell_does_not_move_another_short_cell():
    p = make_policy()
    assert cell(p, "a", 30, now=0) == [Grant("a")]
    assert cell(p, "s", 20, now=0.5) == []  # a's cell has had 0.5 s: short too


def test_the_daemon_puts_short_cells_first_by_default():
    from jupyter_gpushare.scheduler.shell.server import GPUShareScheduler

    assert GPUShareScheduler().policy_config().short_first
    assert not GPUShareScheduler(short_first=False).policy_config().short_first


def test_a_cell_past_its_first_level_is_not_short_and_does_not_pre_empt():
    """s's cell ran 1.5 s (level 1) before a's short cell moved it out; a's cell then runs on
    past level 1 and 2 while s waits. s is no longer short: it takes its turn when a's quantum
    ends, and never has a's memory moved out for it (counted as short until level 2, it did at
    5.5 s, when a's cell reached level 2 and had run longer than the move)."""
    p = make_policy()
    assert cell(p, "s", 20, now=0) == [Grant("s")]
    (revoke,) = cell(p, "a", 30, now=1.5)  # a is short, s's 1.5 s cell is on level 1
    assert revoke == Revoke("s", evict=True, reason=REASON_ORDER, evict_bytes=revoke.evict_bytes)
    moved = {"evicted": True, "bytes_moved": revoke.evict_bytes}
    assert p.handle(Released(1.5, "s", **moved)) == [Grant("a", room_bytes=30032775168)]
    used = 20 * GB
    assert p.handle(Request(1.5, "s", used=used, managed=used - PIN, pinned=PIN)) == []
    deadlines = []
    while (t := p.next_deadline()) is not None and t < 12:
        deadlines.append(t)
        assert p.handle(Tick(t)) == [], t
    assert 5.5 in deadlines, deadlines  # a reaches level 2: looked at, and left alone
