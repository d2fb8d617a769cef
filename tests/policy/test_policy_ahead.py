"""Restore ahead (issue 21, item 6; core/ahead.py): evicted memory back before its owner's turn."""

from __future__ import annotations

from test_policy_scenarios import DEV, GB, b_takes_20_of_idle_a, join, make_policy, part, request

from jupyter_gpushare.scheduler.core.ahead import IDLE_AHEAD_WINDOW, ahead_choices
from jupyter_gpushare.scheduler.core.events import (
    Busy,
    Coming,
    Evict,
    Grant,
    Idle,
    Leave,
    Precopied,
    Precopy,
    Released,
    Request,
    RestoreAhead,
    Restored,
    Tick,
)
from jupyter_gpushare.scheduler.core.policy_state import ClientState, DeviceState
from jupyter_gpushare.scheduler.core.room import KeepFree


def _a_partly_evicted(p, leave_b: bool = True):
    """a (60 GB) ran and went idle; b's 60 GB took 20 of a's; b's cell ended (and b left)."""
    b_takes_20_of_idle_a(p)
    p.handle(Idle(4, "b"))
    if leave_b:
        return p.handle(Leave(5, "b"))
    return []


def _resident(p) -> int:
    return p._devices[DEV].resident_bytes


def test_an_idle_kernel_gets_its_memory_back_when_room_frees_and_nobody_waits():
    p = make_policy(restore_ahead=True)
    assert _a_partly_evicted(p) == [RestoreAhead("a", part(20))]
    a = p._clients["a"]
    # counted on the GPU from the decision on: the pool holds it, and nothing else is promised
    assert a.on_gpu == 60 * GB and _resident(p) == 60 * GB
    assert not a.restore


def test_without_restore_ahead_the_memory_stays_on_the_host_until_the_turn():
    p = make_policy()
    assert _a_partly_evicted(p) == []
    assert p._clients["a"].restore


def test_no_restore_ahead_into_room_kept_for_the_next_arrival():
    # 100 GB pool, a keeps 40 on the GPU after b leaves: 60 free, 50 kept: 10 < a's 20
    p = make_policy(restore_ahead=True, keep_free=KeepFree(size=50 * GB))
    assert not any(isinstance(d, RestoreAhead) for d in _a_partly_evicted(p))
    p2 = make_policy(restore_ahead=True, keep_free=KeepFree(size=30 * GB))
    assert _a_partly_evicted(p2)[-1:] == [RestoreAhead("a", part(20))]


def _dev(pool_gb: float, *clients: ClientState) -> DeviceState:
    dev = DeviceState(DEV, "", int(pool_gb * GB), int(pool_gb * GB), 1e10, 5e10)
    dev.clients = {c.id: c for c in clients}
    return dev


def _client(cid: str, used_gb: float, away_gb: float = 0, waiting: bool = False) -> ClientState:
    """A client that ran (resident), ``away_gb`` of it on the host now."""
    c = ClientState(cid, DEV, cid, seq=len(cid), idle=not waiting, last_active=0.0)
    c.set_memory(int(used_gb * GB), int(used_gb * GB), 0, int(away_gb * GB))
    c.resident, c.away, c.restore = True, int(away_gb * GB), away_gb > 0
    c.waiting_since = 0.0 if waiting else None
    return c


def test_the_room_a_waiter_is_owed_goes_to_no_one_behind_it():
    # 93 GB pool, 20 free. The head waiter h needs 30 back: it does not fit, so neither the
    # waiter behind it (12 away) nor the idle kernel i (5 away) takes the 20 that are free.
    h, w, i = _client("h", 50, 30, True), _client("w", 20, 12, True), _client("i", 50, 5)
    dev = _dev(93, h, w, i)
    assert dev.pool_bytes - dev.resident_bytes == 20 * GB
    assert ahead_choices(dev, [h, w], 0, 1.0) == []
    # the head fits (15 of 25 free): it comes back; w (12) would not fit what is left
    h2 = _client("h", 30, 15, True)
    dev2 = _dev(93, h2, w, i)
    assert [(c.id, n) for c, n in ahead_choices(dev2, [h2, w], 0, 1.0)] == [("h", 15 * GB)]
    # room for both waiters: both, and still not the idle kernel while they wait
    assert [c.id for c, _ in ahead_choices(_dev(200, h, w, i), [h, w], 0, 1.0)] == ["h", "w"]


def test_nothing_is_restored_ahead_while_room_is_being_made():
    i = _client("i", 30, 5)
    dev = _dev(100, i, _client("e", 20))
    assert [c.id for c, _ in ahead_choices(dev, [], 0, 1.0)] == ["i"]
    dev.clients["e"].evict_pending, dev.clients["e"].evict_asked = True, 10 * GB
    assert ahead_choices(dev, [], 0, 1.0) == []
    dev.clients["e"].evict_pending = False
    assert ahead_choices(dev, [], 0, 1.0, [Evict("e")]) == []


def _a_long_evicted(p) -> float:
    """As _a_partly_evicted, but b left IDLE_AHEAD_WINDOW after a's last use: returns when."""
    join(p, "a")
    join(p, "b", user="bob")
    request(p, "a", 60)
    p.handle(Idle(1, "a"))
    request(p, "b", 60, now=2)
    p.handle(Released(3, "a", evicted=True))
    late = 5 + IDLE_AHEAD_WINDOW
    p.handle(Idle(late - 1, "b"))
    assert p.handle(Leave(late, "b")) == []  # a forgotten notebook's memory stays on the host
    return late


def test_a_kernel_idle_for_long_is_restored_only_when_a_cell_is_coming():
    p = make_policy(restore_ahead=True)
    late = _a_long_evicted(p)
    assert p.handle(Coming(late + 1, "a")) == [RestoreAhead("a", part(20))]


def test_a_busy_kernel_that_holds_nothing_is_restored_ahead_of_its_request():
    p = make_policy(restore_ahead=True)
    late = _a_long_evicted(p)
    assert p.handle(Busy(late + 1, "a")) == [RestoreAhead("a", part(20))]


def test_a_grant_during_the_restore_ahead_still_restores_and_the_request_keeps_the_count():
    p = make_policy(restore_ahead=True)
    _a_partly_evicted(p)
    # the shim's REQUEST crossed the restore: it still says 20 GB on the host
    out = p.handle(
        Request(6, "a", used=60 * GB, managed=int(59.5 * GB), pinned=GB // 2, evicted=part(20))
    )
    assert out == [Grant("a", restore=True)]
    assert _resident(p) == 60 * GB  # not counted off the GPU by the stale evicted figure
    assert not p._clients["a"].moving  # the grant restores what is left: it may be evicted
    # a's revoke evicts it all; the restore ahead's answer, come late, changes nothing
    p.handle(Tick(20))
    p.handle(Released(21, "a", evicted=True))
    assert p.handle(Restored(22, "a", part(20), 1000, ahead=True, evicted_bytes=0)) == []
    assert p._clients["a"].restore and p._clients["a"].on_gpu == GB // 2


def test_memory_restored_ahead_is_not_evicted_in_flight_and_leaves_as_an_unmap_after():
    p = make_policy(restore_ahead=True)
    _a_partly_evicted(p)
    join(p, "c", user="carol")
    # c needs 60: a (60, its restore ahead in flight) is not asked yet
    out = request(p, "c", 60, now=6)
    assert not any(d.client == "a" for d in out)
    # the answer: everything back, and (as the shim says here) the host copy still current: now
    # a gives
    out = p.handle(
        Restored(7, "a", part(20), 400_000, ahead=True, evicted_bytes=0, precopied=int(59.5 * GB))
    )
    assert out == [Evict("a", reason="room for c", bytes=part(20))]
    assert p._clients["a"].precopied == int(59.5 * GB)


def test_what_a_restore_ahead_left_on_the_host_is_restored_by_the_grant():
    p = make_policy(restore_ahead=True)
    _a_partly_evicted(p)
    p.handle(Restored(7, "a", GB, 20_000, ahead=True, evicted_bytes=part(20) - GB))
    a = p._clients["a"]
    assert a.restore and a.on_gpu == 60 * GB - (part(20) - GB)
    assert request(p, "a", 60, now=8) == [Grant("a", restore=True)]


def test_memory_restored_ahead_is_pre_copied_again_in_the_same_idle_period():
    # A restore does not mark its blocks clean (native/src/memory/move.c): what came back has no
    # host copy, so evicting it would be a copy. The policy asks for a pre-copy again although a
    # was already asked in this idle period (before its memory left).
    p = make_policy(restore_ahead=True, precopy_idle=True)
    join(p, "a")
    join(p, "b", user="bob")
    request(p, "a", 60)
    assert p.handle(Idle(1, "a")) == [Precopy("a")]
    p.handle(Precopied(2, "a", precopied=int(59.5 * GB)))
    request(p, "b", 60, now=3)  # b's 60 GB takes 20 of a's (pre-copied: an unmap)
    p.handle(Released(4, "a", evicted=True))
    p.handle(Idle(5, "b"))
    assert p.handle(Leave(6, "b")) == [RestoreAhead("a", part(20))]
    clean = int(59.5 * GB) - part(20)  # what stayed resident kept its copy
    out = p.handle(
        Restored(7, "a", part(20), 400_000, ahead=True, evicted_bytes=0, precopied=clean)
    )
    assert out == [Precopy("a")]
    assert p._clients["a"].precopied == clean
