"""Waiters ranked by their cells' levels (scheduler/core/ordering.py ``Ordering.rank``).

Two kernels of the same user have the same fair share, so among them only the level of each
one's current cell says who goes first. The more-served cell must rank after the fresh one even
when it has waited longer, and the two must not fit together, so that the order decides
something: whose memory makes room for whom. Between users the level comes before fair share:
a cell on a lower level goes first even when its user has had more GPU time.
"""

from __future__ import annotations

from unittest.mock import ANY

from jupyter_gpushare.scheduler.core.costs import BLOCK_BYTES
from jupyter_gpushare.scheduler.core.events import (
    Busy,
    Evict,
    Evicted,
    Grant,
    Idle,
    Join,
    Leave,
    Released,
    Request,
    Revoke,
    Tick,
)
from jupyter_gpushare.scheduler.core.ordering import OrderingConfig, level
from jupyter_gpushare.scheduler.core.policy import REASON_ORDER, Policy, PolicyConfig

GB = 10**9
DEV = "GPU-0"


def mem(gb: float) -> dict[str, int]:
    used = int(gb * GB)
    return {"used": used, "managed": used - GB // 2, "pinned": GB // 2}


def test_the_more_served_waiter_of_one_user_ranks_after_the_fresh_one():
    cfg = PolicyConfig(ordering=OrderingConfig())
    p = Policy(cfg)
    p.add_device(DEV, total_bytes=105 * GB, pool_bytes=100 * GB)
    for client, user in (("old", "alice"), ("new", "alice"), ("bob", "bob")):
        p.handle(Join(0.0, client, DEV, user))

    # Alice's first kernel runs a long cell alone: 10 GPU seconds, level 2.
    p.handle(Busy(0.0, "old"))
    assert p.handle(Request(0.0, "old", **mem(60))) == [Grant("old")]
    p.handle(Tick(10.0))
    # Bob's short cell fits beside it and goes through; the long one is paused, memory in place,
    # and asks again at once (its cell goes on): it waits from 10.0.
    p.handle(Busy(10.0, "bob"))
    assert p.handle(Request(10.0, "bob", **mem(30))) == [
        Grant("bob"),
        Revoke("old", evict=False, reason=REASON_ORDER),
    ]
    assert p.handle(Released(10.0, "old")) == []
    assert p.handle(Request(10.0, "old", **mem(60))) == []
    old = next(c for c in p.snapshot(10.0)[0]["clients"] if c["id"] == "old")
    assert level(old["gpu_seconds"], 1.0, cfg.ordering) == 2, old

    # Alice's second kernel starts a cell later: level 0, the same user's share. It and the
    # paused one (60 + 60 GB beside Bob's 30 in a 100 GB pool) do not fit together. Ranked by
    # level it comes first, and the paused one, behind it, makes room: its memory is evicted.
    p.handle(Busy(10.5, "new"))
    (evict,) = p.handle(Request(10.5, "new", **mem(60)))
    # only what is missing moves (partial eviction): 50 GB, rounded up to the engine's block
    assert evict == Evict("old", reason="room for new", bytes=evict.bytes), evict
    assert 50 * GB - GB // 2 <= evict.bytes <= 50 * GB + BLOCK_BYTES, evict
    assert p.handle(Evicted(10.6, "old", bytes_moved=evict.bytes)) == [Grant("new")]

    # When the short cells end, the long one resumes with its memory brought back.
    revokes = p.handle(Idle(11.0, "bob")) + p.handle(Idle(11.5, "new"))
    assert revokes and all(isinstance(r, Revoke) and r.client != "old" for r in revokes), revokes
    answers = [p.handle(Released(11.6, r.client, r.evict, bytes_moved=GB)) for r in revokes]
    assert answers[-1] == [Grant("old", restore=True)], answers


def test_between_users_the_lower_level_goes_first_though_its_user_is_more_served():
    """Two waiters of two users, not short (both past level 0), neither overdue nor starved, and
    they do not fit together: alice's is on level 1 and bob's on level 2, while alice has had six
    times bob's GPU time. Fair share alone would put bob first; the level puts alice's cell
    first, and it is the one granted when the room comes (ranked ``1 + level``, not one rank for
    every waiter)."""
    p = Policy(PolicyConfig(ordering=OrderingConfig()))
    p.add_device(DEV, total_bytes=11 * GB, pool_bytes=10 * GB)
    for client, user in (("batch", "alice"), ("nb", "alice"), ("bob", "bob"), ("short", "carol")):
        p.handle(Join(0.0, client, DEV, user))

    # Alice's plain program holds the device for 30 s and leaves: her usage, 30 GPU-seconds.
    assert p.handle(Request(0.0, "batch", **mem(1))) == [Grant("batch")]
    assert p.handle(Released(30.0, "batch")) == []
    (batch,) = [c for c in p.snapshot(30.0)[0]["clients"] if c["id"] == "batch"]
    assert batch["gpu_seconds"] == 30.0, batch
    p.handle(Leave(30.0, "batch"))

    # Bob's cell runs alone for 5 s (level 2), then alice's notebook wants 6 GB beside his 6 GB
    # in a 10 GB pool: his quantum (5 s) is over, his memory leaves, hers comes.
    p.handle(Busy(30.0, "bob"))
    assert p.handle(Request(30.0, "bob", **mem(6))) == [Grant("bob")]
    p.handle(Tick(35.0))
    p.handle(Busy(35.0, "nb"))
    (revoke,) = p.handle(Request(35.0, "nb", **mem(6)))
    assert revoke.client == "bob" and revoke.evict, revoke
    moved = {"evicted": True, "bytes_moved": revoke.evict_bytes}
    assert p.handle(Released(35.0, "bob", **moved)) == [Grant("nb", room_bytes=ANY)]
    assert p.handle(Request(35.0, "bob", **mem(6))) == []  # his cell goes on: he waits

    # At 36.6 s alice's cell has had 1.6 GPU-seconds (level 1); carol's short cell takes her
    # place (short cells first) and both wait, neither past a quantum of waiting.
    p.handle(Tick(36.6))
    p.handle(Busy(36.6, "short"))
    out = p.handle(Request(36.6, "short", **mem(6)))
    assert Revoke("nb", evict=True, reason=REASON_ORDER) in out, out
    for d in out:
        if isinstance(d, Evict):
            p.handle(Evicted(36.6, d.client, bytes_moved=d.bytes))
    assert p.handle(Released(36.6, "nb", evicted=True)) == [Grant("short", room_bytes=ANY)]
    assert p.handle(Request(36.6, "nb", **mem(6))) == []
    clients = {c["id"]: c for c in p.snapshot(36.6)[0]["clients"]}
    levels = {
        cid: level(clients[cid]["gpu_seconds"], 1.0, OrderingConfig()) for cid in ("nb", "bob")
    }
    assert levels == {"nb": 1, "bob": 2}, clients
    assert (clients["nb"]["queue_position"], clients["bob"]["queue_position"]) == (1, 2), clients

    # Carol's cell ends: her memory leaves, and the room goes to alice's cell, not bob's.
    out = p.handle(Idle(37.0, "short"))
    assert [type(d) for d in out if d.client == "short"] == [Revoke], out
    answers = [p.handle(Released(37.0, "short", evicted=True))]
    answers += [
        p.handle(Evicted(37.0, d.client, bytes_moved=d.bytes)) for d in out if isinstance(d, Evict)
    ]
    granted = [d.client for a in answers for d in a if isinstance(d, Grant)]
    assert granted == ["nb"], answers
