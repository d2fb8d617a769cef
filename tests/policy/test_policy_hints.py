"""Cell hints (issue 35, item 1; core/hints.py): a notebook about to run a cell gets its memory
back first, idle pre-copied kernels unmapped for its room; per user, rate-limited, switchable."""

from __future__ import annotations

import pytest
from test_policy_scenarios import DEV, b_takes_20_of_idle_a, join, make_policy, part, request

from jupyter_gpushare.scheduler.core.events import (
    Busy,
    Coming,
    Evict,
    Evicted,
    Grant,
    Idle,
    Precopied,
    Released,
    RestoreAhead,
    Restored,
    Revoke,
)
from jupyter_gpushare.scheduler.core.hints import REASON_HINT, CellHints, HintLimiter

HINTS = CellHints(on=True)


def _a_away_b_copied(p, b_idle: bool = True, b_copied: bool = True):
    """a (60 GB) ran and went idle; b's 60 GB took 20 of a's; b's cell ended and (with
    ``b_copied``) its 60 GB have a host copy: the pool (100 GB) is full, a has 20 GB away."""
    b_takes_20_of_idle_a(p)
    if b_idle:
        p.handle(Idle(4, "b"))
        p.handle(Released(4.5, "b"))  # it gave the device back: idle, resident
    if b_copied:
        p.handle(Precopied(5, "b", precopied=p._clients["b"].evictable))


def test_a_hint_unmaps_an_idle_pre_copied_kernel_and_then_restores_ahead():
    p = make_policy(cell_hints=HINTS)
    _a_away_b_copied(p)
    assert p.handle(Coming(10, "a")) == [Evict("b", reason=REASON_HINT, bytes=part(20))]
    # the unmap's answer: the room is there, a's memory comes back before its cell
    assert p.handle(Evicted(10.01, "b", 0, 8000)) == [RestoreAhead("a", part(20))]
    a = p._clients["a"]
    assert a.on_gpu == a.used and not a.restore
    # its cell comes: granted at once, nothing left to restore
    assert request(p, "a", 60, now=12) == [Grant("a", restore=True)]


def test_without_cell_hints_a_hint_moves_nothing():
    p = make_policy()
    _a_away_b_copied(p)
    assert p.handle(Coming(10, "a")) == []
    assert p._clients["a"].restore


def test_a_hint_never_evicts_a_busy_kernel_nor_one_without_a_host_copy():
    p = make_policy(cell_hints=HINTS)
    _a_away_b_copied(p, b_idle=False, b_copied=False)  # b holds the device and computes
    assert p.handle(Coming(10, "a")) == []
    p = make_policy(cell_hints=HINTS)
    _a_away_b_copied(p, b_copied=False)  # b idle, but evicting it would be a copy
    assert p.handle(Coming(10, "a")) == []
    assert p._clients["b"].on_gpu == p._clients["b"].used


def test_a_hint_takes_no_room_from_a_waiter():
    p = make_policy(cell_hints=HINTS)
    _a_away_b_copied(p)
    join(p, "c", user="carol")
    p.handle(Busy(6, "c"))
    moves = request(p, "c", 30, now=6)  # c needs room: admission evicts for it
    assert Evict("a", reason="room for c", bytes=part(29.5)) in moves
    assert p._clients["c"].waiting_since is not None
    assert all(not isinstance(d, RestoreAhead) for d in p.handle(Coming(10, "a")))
    assert p._clients["a"].restore


def test_hints_are_rate_limited_per_user():
    p = make_policy(cell_hints=CellHints(on=True, burst=1, refill_s=30.0))
    _a_away_b_copied(p)
    assert p.handle(Coming(10, "a")) != []
    p2 = make_policy(cell_hints=CellHints(on=True, burst=1, refill_s=30.0))
    _a_away_b_copied(p2)
    p2._hint_limiter.allow("alice", 9.0)  # alice hinted a moment ago (another notebook)
    assert p2.handle(Coming(10, "a")) == []  # over her rate: ignored
    assert not p2._clients["a"].coming
    assert p2.handle(Coming(40, "a")) != []  # refilled


def test_the_limiter_is_a_token_bucket_per_user():
    lim = HintLimiter(CellHints(on=True, burst=3, refill_s=10.0))
    assert [lim.allow("u", 0.0) for _ in range(4)] == [True, True, True, False]
    assert lim.allow("v", 0.0)  # another user's hints are their own
    assert not lim.allow("u", 9.0) and lim.allow("u", 10.5)
    assert not lim.allow("u", 10.6)
    with pytest.raises(ValueError):
        CellHints(burst=0)


def test_a_wrong_hint_costs_only_the_bytes_it_moved():
    """A hint whose cell never comes: a's memory is back, b's left as an unmap; nothing else
    moved, and b's next cell restores what it lost (the cost is those bytes)."""
    p = make_policy(cell_hints=HINTS)
    _a_away_b_copied(p)
    p.handle(Coming(10, "a"))
    p.handle(Evicted(10.01, "b", 0, 8000))
    b = p._clients["b"]
    assert b.used - b.on_gpu == part(20)
    assert p.handle(Restored(12, "a", part(20), 400_000, True, 0, 0)) == []
    assert request(p, "b", 60, now=20) == [Evict("a", reason="room for b", bytes=part(20))]
    assert DEV in p._devices


def test_an_idle_holder_gives_its_pre_copied_memory_with_its_grant():
    p2 = make_policy(cell_hints=HINTS)
    join(p2, "a")
    join(p2, "b", user="bob")
    request(p2, "a", 60)
    p2.handle(Idle(1, "a"))
    request(p2, "b", 60, now=2)
    p2.handle(Released(3, "a", evicted=True))
    p2.handle(Idle(4, "b"))  # b keeps its grant while nobody wants the device
    p2.handle(Precopied(5, "b", precopied=p2._clients["b"].evictable))
    assert p2._clients["b"].holding == "running"
    assert p2.handle(Coming(10, "a")) == [
        Revoke("b", evict=True, reason=REASON_HINT, evict_bytes=part(20))
    ]
    assert p2.handle(Released(10.01, "b", evicted=True)) == [RestoreAhead("a", part(20))]


def test_only_the_pre_copied_part_of_an_idle_kernel_leaves_for_a_hint():
    p = make_policy(cell_hints=HINTS)
    _a_away_b_copied(p, b_copied=False)
    p.handle(Precopied(5, "b", precopied=part(10)))  # half of what a needs has a host copy
    assert p.handle(Coming(10, "a")) == []
    p.handle(Precopied(6, "b", precopied=part(30)))
    assert p.handle(Coming(11, "a")) == [Evict("b", reason=REASON_HINT, bytes=part(20))]
