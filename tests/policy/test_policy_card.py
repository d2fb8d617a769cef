"""The real card (issue 34, item 1): no CUDA out of memory while others' memory can move.

At the default pool (the whole card) an idle notebook's memory fills the card as surely as a busy
one's. Counted as room, it let the shim back a newcomer's 80 GiB beside an idle 80 GiB notebook,
and the driver answered out of memory (H200, e5353ea). Here: idle memory is room only once it
has left; a newcomer past its room waits while the idle kernel is evicted (pre-copied first),
never evicted itself; and a shim whose driver refused memory the accounting calls free says by
how much (``Request.short``), so that admission makes that room too, once.
"""

from __future__ import annotations

from test_policy_scenarios import DEV, GB, join, make_policy, part, request

from jupyter_gpushare.scheduler.core.events import (
    Evict,
    Evicted,
    Grant,
    Idle,
    Memory,
    Precopied,
    Released,
    Request,
)

CARD = 139 * GB  # an H200's default pool (the card less what the driver keeps)


def _idle_notebook(p, cid: str = "a", gb: float = 80, precopied: bool = True) -> None:
    """``cid`` ran ``gb`` GB, went idle (its cell ended) and gave the device back, resident."""
    join(p, cid)
    assert request(p, cid, gb) == [Grant(cid)]
    p.handle(Idle(1, cid))
    if precopied:
        p.handle(Precopied(1.5, cid, precopied=int((gb - 0.5) * GB)))
    p.handle(Released(2, cid))


def test_a_grant_beside_an_idle_notebook_has_room_only_for_what_is_free():
    p = make_policy(pool=CARD)
    _idle_notebook(p)
    join(p, "b", user="bob")
    (grant,) = request(p, "b", 1, now=3)  # its first cell: context and a small tensor
    # 139 - 80 GB: the idle notebook's memory is not b's to back into (it was: 139 GB)
    assert grant == Grant("b") and grant.room_bytes == CARD - 80 * GB


def test_a_newcomer_past_its_room_waits_while_the_idle_notebook_leaves_never_itself():
    """b holds the device and allocates 80 GB: its shim leaves them unbacked (past the room),
    reports them on the host, gives the device back and asks again. The idle notebook is
    evicted for b (an unmap: it is pre-copied), b is not, and b's grant restores (backs) them."""
    p = make_policy(pool=CARD)
    _idle_notebook(p)
    join(p, "b", user="bob")
    request(p, "b", 1, now=3)
    used = 81 * GB
    pin = GB // 2
    # the report of the unbacked 80 GB, then the unsolicited release and the request
    assert (
        p.handle(Memory(4, "b", used=used, managed=used - pin, pinned=pin, evicted=80 * GB)) == []
    )
    assert p.handle(Released(4.1, "b")) == []
    decisions = p.handle(
        Request(4.2, "b", used=used, managed=used - pin, pinned=pin, evicted=80 * GB)
    )
    assert [type(d) for d in decisions] == [Evict] and decisions[0].client == "a"
    # what b misses: its 80 GB less what the pool has free beside a's 80 and b's backed 1 GB
    assert p._clients["a"].evict_asked >= 80 * GB - (CARD - 80 * GB - GB)
    assert p._clients["b"].on_gpu == GB  # its backed 1 GB stayed; nothing of b was asked to move
    (grant,) = p.handle(Evicted(4.3, "a", bytes_moved=0, micros=9000))
    assert grant == Grant("b", restore=True, room_bytes=grant.room_bytes)
    assert grant.room_bytes >= used  # room for all of it now


def test_a_driver_refusal_makes_room_the_accounting_called_free():
    """The accounting says b's 20 GB fit beside a's 80 (139 GB pool), but the driver refused 8
    of them (memory the pool does not see). b's request says so: a gives at least those 8 GB,
    though b's own need fits the accounting's free room."""
    p = make_policy(pool=CARD)
    _idle_notebook(p)
    join(p, "b", user="bob")
    used, pin = 20 * GB, GB // 2
    decisions = p.handle(
        Request(3, "b", used=used, managed=used - pin, pinned=pin, evicted=0, short=8 * GB)
    )
    assert [(type(d), d.client) for d in decisions] == [(Evict, "a")]
    assert p._clients["a"].evict_asked == part(8)
    (grant,) = p.handle(Evicted(3.5, "a", bytes_moved=0, micros=5000))
    assert grant.client == "b"
    assert p._clients["b"].short == 0


def test_a_shortfall_is_made_once_not_again_at_every_pass():
    """The room asked for a shortfall counts against it: the passes that follow (another
    client's event) do not evict the shortfall again while the first eviction is in flight."""
    p = make_policy(pool=CARD)
    _idle_notebook(p, "a", 40)
    _idle_notebook(p, "c", 40)
    join(p, "b", user="bob")
    used, pin = 20 * GB, GB // 2
    first = p.handle(
        Request(3, "b", used=used, managed=used - pin, pinned=pin, evicted=0, short=8 * GB)
    )
    assert len(first) == 1 and isinstance(first[0], Evict)
    (evicted,) = [p._clients[d.client] for d in first]
    # another event while that eviction is in flight: no second eviction for the same 8 GB,
    # and no grant before the room the driver lacked has left
    assert p.handle(Idle(3.2, "c")) == []
    assert p.handle(Idle(3.3, "a")) == []
    (grant,) = p.handle(Evicted(3.5, evicted.id, bytes_moved=0, micros=5000))
    assert grant.client == "b"


def test_a_shortfall_claim_is_bounded_by_the_pool():
    p = make_policy(pool=CARD)
    join(p, "b", user="bob")
    used, pin = GB, GB // 2
    p.handle(Request(1, "b", used=used, managed=used - pin, pinned=pin, short=10**18))
    assert p._clients["b"].short <= p._devices[DEV].pool_bytes


def test_a_kernel_growing_in_steps_gets_room_that_doubles():
    """B fills memory in 1 GB steps beside an idle notebook (PyTorch filling 80 GiB in 1 GiB
    tensors): each step past its room is a round trip. On an H200 that was 56 round trips and
    5.5 s for 80 GiB (2026-12-02). A step that comes back within GROWTH_WINDOW of its grant gets
    twice the room of the last one, taken from idle memory only: the steps past the room ask
    1, 2 and 4 GB, and 8 steps need 3 evictions, not 4 (without doubling: one per step)."""
    p = make_policy(pool=CARD)
    _idle_notebook(p, "a", 134, precopied=True)  # 4 GB of the pool left beside it
    join(p, "b", user="bob")
    request(p, "b", 1, now=3)
    pin, used, now = GB // 2, GB, 3.0
    asked = []
    for _step in range(8):
        used += GB  # one more 1 GB tensor past the room: unbacked, the device given back
        now += 0.1
        p.handle(Memory(now, "b", used=used, managed=used - pin, pinned=pin, evicted=GB))
        p.handle(Released(now + 0.01, "b"))
        decisions = p.handle(
            Request(now + 0.02, "b", used=used, managed=used - pin, pinned=pin, evicted=GB)
        )
        evicts = [d for d in decisions if isinstance(d, Evict)]
        asked.append(sum(p._clients[d.client].evict_asked for d in evicts))
        if evicts:
            (grant,) = p.handle(Evicted(now + 0.05, "a", bytes_moved=0, micros=1000))
        else:
            (grant,) = decisions
        assert grant.client == "b" and grant.restore, grant
        now += 0.06
        p.handle(Memory(now, "b", used=used, managed=used - pin, pinned=pin, evicted=0))
    evictions = [a for a in asked if a]
    assert len(evictions) == 3, asked
    assert evictions[0] == part(1), asked  # the first step past the room: what it misses
    assert evictions[1:] == [2 * evictions[0], 4 * evictions[0]], asked


def test_growth_room_takes_only_idle_memory():
    from jupyter_gpushare.scheduler.core.policy_moves import growth_room

    p = make_policy(pool=CARD)
    _idle_notebook(p, "a", 40)
    join(p, "busy", user="carol")
    request(p, "busy", 40, now=3)
    b = p._clients["a"]
    w = p._clients["busy"]
    w.grow_streak = 4
    assert growth_room(w, GB, [b]) == 8 * GB  # 2 ** 3 times what it misses
    w.grow_streak = 1
    assert growth_room(w, GB, [b]) == 0  # one step is no growth
    w.grow_streak = 30
    assert growth_room(w, GB, [b]) == b.evictable  # never more than idle kernels hold
    busy = p._clients["busy"]
    assert growth_room(w, GB, [busy]) == 0  # a busy kernel's memory is not taken for it
