"""Waiters of one user ranked by their cells' levels (scheduler/core/ordering.py ``Ordering.rank``).

Two kernels of the same user have the same fair share, so among them only the level of each
one's current cell says who goes first. The more-served cell must rank after the fresh one even
when it has waited longer, and the two must not fit together, so that the order decides
something: whose memory makes room for whom.
"""

from __future__ import annotations

from jupyter_gpushare.scheduler.core.costs import BLOCK_BYTES
from jupyter_gpushare.scheduler.core.events import (
    Busy,
    Evict,
    Evicted,
    Grant,
    Idle,
    Join,
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
