"""Issue 21's memory rules in the policy: partial eviction, cost-aware choice, room in grants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from test_policy_scenarios import DEV, GB, join, make_policy, part, request

from jupyter_gpushare.scheduler.core.costs import BLOCK_BYTES
from jupyter_gpushare.scheduler.core.events import (
    Busy,
    Evict,
    Evicted,
    Grant,
    Idle,
    Join,
    Memory,
    Precopied,
    Released,
    Request,
    Restored,
    Revoke,
    Room,
    Tick,
)
from jupyter_gpushare.scheduler.core.ordering import OrderingConfig
from jupyter_gpushare.scheduler.shell.translate import decision_message


def _freed(policy, decisions) -> int:
    """Bytes the decisions ask to free on the GPU (an ask of 0: everything the client has)."""
    total = 0
    for d in decisions:
        c = policy._clients[d.client]
        if isinstance(d, Evict):
            total += d.bytes or c.evict_asked
        elif isinstance(d, Revoke) and d.evict:
            total += d.evict_bytes or c.revoke_bytes
    return total


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 30), min_size=1, max_size=6).filter(lambda s: sum(s) <= 99),
    copied=st.lists(st.booleans(), min_size=6, max_size=6),
    want=st.integers(1, 90),
)
def test_partial_eviction_frees_what_is_missing_and_at_most_a_block_more(sizes, copied, want):
    p = make_policy()
    for i, gb in enumerate(sizes):
        cid = f"i{i}"
        join(p, cid, user=cid)
        request(p, cid, gb, now=i)
        p.handle(Idle(i + 0.5, cid))
        if copied[i]:
            p.handle(Precopied(i + 0.6, cid, precopied=int((gb - 0.5) * GB)))
        p.handle(Released(i + 0.7, cid))  # idle, resident
    join(p, "w", user="w")
    assert not any(c.evict_pending or c.holding for c in p._clients.values())
    dev = p._devices[DEV]
    w_gb = min(want, 99)
    need = int(w_gb * GB) - int(0.5 * GB)  # its context is on the GPU once it asks
    free = dev.pool_bytes - dev.resident_bytes - int(0.5 * GB)
    short = need - free
    decisions = request(p, "w", w_gb, now=100)
    freed = _freed(p, decisions)
    if short <= 0:
        assert freed == 0 and decisions == [Grant("w")]
        return
    assert freed >= short
    assert freed <= short + BLOCK_BYTES
    # pre-copied idle kernels give first: a copying eviction only once the unmaps are not enough
    asked = [p._clients[d.client] for d in decisions if isinstance(d, Evict)]
    firsts = [c.precopied >= c.movable for c in asked]
    assert firsts == sorted(firsts, reverse=True)


def _idle_a(p):
    """a (60 GB) ran and went idle; b (bob) has joined: b's 60 GB miss 20 of a's."""
    join(p, "a")
    join(p, "b", user="bob")
    request(p, "a", 60)
    p.handle(Idle(1, "a"))
    return p


def test_a_grant_restores_only_what_left_and_says_its_room():
    p = _idle_a(make_policy())
    assert request(p, "b", 60, now=2) == [
        Revoke("a", evict=True, reason="idle", evict_bytes=part(20))
    ]
    (grant,) = p.handle(Released(3, "a", evicted=True))
    # a kept its 40 GB (less the block rounding) on the GPU: b may hold the rest of the pool.
    # a's part is not b's room although a is idle: idle memory is room only once it has left
    # (at the default pool the driver refused b's memory backed into it: issue 34).
    a_left = 100 * GB - p._clients["a"].on_gpu
    assert grant == Grant("b") and grant.room_bytes == a_left
    msg = decision_message(grant)
    assert msg.fields["room_bytes"] == a_left
    client_a = p._clients["a"]
    assert client_a.on_gpu == 60 * GB - part(20) and client_a.restore


def _thirty_second_cells(p):
    """a (60 GB) ran two cells of 30 s, which teach the policy its usual cell; its third
    began at 80 s. b (60 GB, bob) has joined."""
    join(p, "a")
    join(p, "b", user="bob")
    assert request(p, "a", 60) == [Grant("a")]
    for start in (0, 40):
        if start:
            p.handle(Busy(start, "a"))
        p.handle(Idle(start + 30, "a"))
    p.handle(Busy(80, "a"))
    return p


def test_a_busy_kernel_is_not_evicted_for_a_wait_shorter_than_the_move():
    """a's cells last ~30 s; b (60 GB, does not fit beside it) arrives 29 s into a's cell: a's
    cell should end in ~1 s, less than moving 20 GB out and back (2 s + 0.4 s at the default
    10/50 GB/s): b waits for the cell. Once a's cell outlives its usual length, it is moved."""
    p = _thirty_second_cells(make_policy())
    assert request(p, "b", 60, now=109) == []  # a's quantum (since 0) expired long ago
    deadline = p.next_deadline()
    assert deadline is not None and deadline <= 110.0 + 1e-9
    assert p.handle(Tick(110.5)) == [
        Revoke("a", evict=True, reason="quantum expired", evict_bytes=part(20))
    ]


def test_without_cost_awareness_the_busy_kernel_is_evicted_at_once():
    p = _thirty_second_cells(make_policy(cost_aware=False))
    assert request(p, "b", 60, now=109) == [
        Revoke("a", evict=True, reason="quantum expired", evict_bytes=part(20))
    ]


def test_without_partial_eviction_whole_kernels_move():
    p = _idle_a(make_policy(partial_eviction=False))
    assert request(p, "b", 60, now=2) == [Revoke("a", evict=True, reason="idle")]


def test_a_request_after_a_partial_eviction_counts_what_the_shim_says_once():
    """The shim's REQUEST carries its total evicted bytes: after a partial eviction that is
    the part that left, not a second eviction of it (nor all of it)."""
    p = _idle_a(make_policy())
    request(p, "b", 60, now=2)
    p.handle(Released(3, "a", evicted=True))
    a = p._clients["a"]
    used = 60 * GB
    p.handle(Request(4, "a", used=used, managed=used - GB // 2, pinned=GB // 2, evicted=part(20)))
    assert a.resident and a.away == part(20) and a.on_gpu == used - part(20)


def _a_past_its_room(p):
    """c's long cell is paused for a's short one, its memory in place: a's room is the pool less
    c's 30 GB. a allocates past it: its shim leaves the 10 GB past the room unbacked (on the
    host in its report) and says so in MEMORY before it gives the device back."""
    join(p, "c")
    join(p, "a", user="bob")
    p.handle(Busy(0, "c"))
    request(p, "c", 30)
    p.handle(Busy(5, "a"))
    grant, pause = request(p, "a", 10, now=5)
    assert grant == Grant("a") and grant.room_bytes == 70 * GB
    assert pause == Revoke("c", evict=False, reason="paused: shorter cells first")
    p.handle(Released(5.01, "c"))
    used = 80 * GB
    past = 10 * GB  # its room is 70 GB, its context included
    return Memory(6, "a", used=used, managed=used - GB // 2, pinned=GB // 2, evicted=past)


def test_memory_past_a_holders_room_is_not_on_the_gpu_and_is_backed_at_its_next_grant():
    """Issue 21 item 2. What a holder allocated past its room is not on the GPU: nobody is
    evicted for it while the holder holds (before: c's memory was evicted for "memory pressure",
    and without c a holder past the pool was revoked with eviction, its fresh memory copied out).
    The holder gives the device back and asks again; as a waiter its deferred memory is what it
    needs, c's memory gives the missing part, and the grant restores it (a backing: no copy),
    with room for all of it."""
    p = make_policy(ordering=OrderingConfig())
    grew = _a_past_its_room(p)
    assert p.handle(grew) == []
    a = p._clients["a"]
    assert a.deferred == grew.evicted and a.on_gpu == 80 * GB - grew.evicted
    assert p.handle(Released(6.1, "a")) == []
    past = grew.evicted
    ask = Request(6.1, "a", used=80 * GB, managed=grew.managed, pinned=GB // 2, evicted=past)
    (evict,) = p.handle(ask)
    # The pool is full (a's 70 GB on the GPU, c's 30 GB): c gives what a's deferred part needs.
    assert evict == Evict("c", reason="room for a", bytes=part(10))
    (again,) = p.handle(Evicted(7, "c"))
    assert again == Grant("a", restore=True) and again.room_bytes >= 80 * GB


def test_a_holders_room_follows_the_kernels_beside_it():
    """room_updates: b was granted while a was idle: its room is the pool less what a holds on
    the GPU, idle or not (idle memory is room only once it has left: at the default pool, room
    that counted it let the shim back 80 GiB beside an idle 80 GiB notebook and the driver
    refused it, issue 34). a's cell starts and its memory grows: b's room shrinks with it, so
    that b's next big allocation waits unbacked instead of being backed and evicted (issue 21).
    When a's cell ends b's room stays what a leaves: a's memory is still on the GPU."""
    p = make_policy(room_updates=True)
    join(p, "a")
    join(p, "b", user="bob")
    request(p, "a", 1)
    p.handle(Idle(1, "a"))
    grant, room = request(p, "b", 1, now=2)
    assert grant == Grant("b") and grant.room_bytes == 99 * GB
    assert room == Room("a", 99 * GB)  # a (idle) still holds: b's cell is beside it now
    assert p.handle(Busy(3, "a")) == []  # a's 1 GB was counted already
    used = 40 * GB
    grew = Memory(4, "a", used=used, managed=used - GB // 2, pinned=GB // 2, evicted=0)
    assert p.handle(grew) == [Room("b", 60 * GB)]
    assert decision_message(Room("b", 60 * GB)).fields == {"room_bytes": 60 * GB}
    assert p.handle(Idle(5, "a")) == []  # idle, its 40 GB are still on the GPU


def test_without_room_updates_a_holders_room_stays_its_grants():
    """The bare core (scenario tests read exact decision lists): no Room decisions."""
    p = make_policy()
    join(p, "a")
    join(p, "b", user="bob")
    request(p, "a", 1)
    p.handle(Idle(1, "a"))
    request(p, "b", 1, now=2)
    assert p.handle(Busy(3, "a")) == []


def test_without_room_grants_a_holder_is_never_granted_twice():
    """The grant invariant (a grant answers a request, never a second grant): a holder whose
    memory grew on the GPU (memory its shim cannot leave unbacked, reported resident) makes c's
    memory leave for it, and is not granted again."""
    p = make_policy(ordering=OrderingConfig())
    join(p, "c")
    join(p, "a", user="bob")
    p.handle(Busy(0, "c"))
    request(p, "c", 30)
    p.handle(Busy(5, "a"))
    request(p, "a", 10, now=5)
    p.handle(Released(5.01, "c"))
    used = 80 * GB
    grew = Memory(6, "a", used=used, managed=used - GB // 2, pinned=GB // 2, evicted=0)
    assert p.handle(grew) == [Evict("c", reason="memory pressure", bytes=part(10))]
    assert p.handle(Evicted(7, "c")) == []


def test_what_the_shim_says_left_stands_for_the_ask():
    """A shim that evicts more than asked (one that ignores evict_bytes frees everything) says
    its total in RELEASED/EVICTED: the policy counts that, not its ask."""
    p = _idle_a(make_policy())
    request(p, "b", 60, now=2)  # a is asked for 20 GB
    p.handle(Released(3, "a", evicted=True, evicted_bytes=int(59.5 * GB)))
    a = p._clients["a"]
    assert not a.resident and a.on_gpu == GB // 2 and a.restore
    p2 = _idle_a(make_policy())
    request(p2, "b", 60, now=2)
    p2.handle(Released(3, "a", evicted=True, evicted_bytes=part(20) + BLOCK_BYTES))
    assert p2._clients["a"].on_gpu == 60 * GB - part(20) - BLOCK_BYTES


def test_memory_the_shim_could_not_move_is_not_asked_for_again():
    """Seen on an H100 (tests/gpu/test_gpu_captures.py, 2026-11-27): a kernel whose shim could
    move less than the policy counted as movable (its context, say) was asked to evict again on
    every event, hundreds of EVICTs a millisecond. What an eviction left behind stays on the GPU,
    counted there, and is not asked for again before the kernel's next turn."""
    p = make_policy()
    join(p, "a")
    join(p, "b", user="bob")
    request(p, "a", 60)
    p.handle(Idle(1, "a"))
    p.handle(Released(2, "a"))  # idle, resident, not holding
    assert request(p, "b", 60, now=3) == [Evict("a", reason="room for b", bytes=part(20))]
    # the shim could move only 5 GB of the 20 asked
    after = p.handle(Evicted(4, "a", bytes_moved=5 * GB, micros=100_000, evicted_bytes=5 * GB))
    again = after + p.handle(Tick(5)) + p.handle(Tick(6))
    assert not [d for d in again if isinstance(d, Evict) and d.client == "a"], again
    a = p._clients["a"]
    assert a.on_gpu == 55 * GB and a.evictable == 0
    # what cannot move is the device's own floor (rule 5): b gets its turn beside it, once
    assert [d for d in again if isinstance(d, Grant)] == [Grant("b")], again
    # a's next grant brings back what left, and all of its memory is movable again
    p.handle(Idle(8, "b"))
    p.handle(Released(9, "b", evicted=True, evicted_bytes=60 * GB))
    assert request(p, "a", 60, now=10) == [Grant("a", restore=True)]
    assert p._clients["a"].stuck == 0 and p._clients["a"].on_gpu == 60 * GB


def test_what_a_release_moved_is_off_the_gpu_whatever_the_total_says():
    """Replays tests/gpu/test_gpu_captures.py on an H100 (2026-11-27; MiB as there): two torch
    processes (512 MiB of data, a 600 MiB context estimate each) in a 2 GiB pool. b's shim had
    lost 438 MiB from its evicted total (frees of resident blocks, memory/vmm.c): right after
    moving 512 MiB off the GPU it said 74 MiB were on the host (82 after 8 MiB more left: the
    policy's state at the peak). The policy took the other 438 MiB for memory that could not
    move and granted a beside it (rule 5): 2158 MiB counted in the pool. What a move reports it
    moved has left the GPU, whatever total comes with it."""
    mib, pool = 1 << 20, 2048 << 20
    p = make_policy(pool=pool, base_quantum=0.5)

    def mem(used: int, evicted: int) -> dict[str, int]:
        return {"used": used * mib, "managed": (used - 600) * mib, "pinned": 600 * mib,
                "evicted": evicted * mib}  # fmt: skip

    decided: list = []

    def play(*events) -> None:
        for evt in events:
            decided.extend(p.handle(evt))
            counted = p._devices[DEV].resident_bytes
            assert counted <= pool, f"{counted / mib} MiB counted after {evt}: {decided}"

    def last(kind: type, cid: str) -> None:
        d = decided[-1] if decided else None
        assert isinstance(d, kind) and d.client == cid, decided

    play(
        Join(0.0, "a", DEV, "root", context_bytes=600 * mib),
        Request(0.0, "a", **mem(1112, 512)),  # its tensor was made while it waited: unbacked
        Restored(0.01, "a"),
        Memory(0.2, "a", **mem(1120, 0)),
        Join(0.75, "b", DEV, "root", context_bytes=600 * mib),
        Request(0.76, "b", **mem(1112, 512)),  # a's quantum is over: a is revoked for b
        Released(0.93, "a", evicted=True, bytes_moved=512 * mib, evicted_bytes=520 * mib),
        Request(0.93, "a", **mem(1120, 520)),
        Restored(0.99, "b"),
        Memory(1.2, "b", **mem(1116, 0)),
        Tick(1.5),  # b's quantum is over: revoked for a, ~188 MiB missing
    )
    last(Revoke, "b")
    moved = Released(1.51, "b", evicted=True, bytes_moved=512 * mib, evicted_bytes=74 * mib)
    play(moved, Request(1.51, "b", **mem(1120, 74)))
    b = p._clients["b"]
    assert b.on_gpu == (1120 - 512) * mib and b.stuck == 0, b
    # a's turn came, restoring what left; an eviction for pressure is answered as on the H100
    # (8 MiB moved, "82 MiB" on the host)
    assert any(isinstance(d, Grant) and d.client == "a" and d.restore for d in decided[-2:])
    if any(isinstance(d, Evict) and d.client == "b" for d in decided):
        play(Evicted(1.52, "b", 8 * mib, 3_500, evicted_bytes=82 * mib))
    play(Restored(1.53, "a"), Tick(2.1))  # a's quantum is over: revoked for b
    last(Revoke, "a")
    play(Released(2.11, "a", evicted=True, bytes_moved=520 * mib, evicted_bytes=520 * mib))
    last(Grant, "b")
    assert decided[-1].restore, decided
