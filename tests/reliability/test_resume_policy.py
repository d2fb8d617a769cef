"""The policy's side of a scheduler restart and of long holders (pure: events in, decisions out).

A restarted scheduler's policy learns each survivor from its HELLO (a Join with ``resume``): a
holder gets its grant back if it fits beside the holders already back, waiters queue from when
they began to wait, and no grant is decided during the recovery window. For waiters the status
says why they wait (``wait.reason`` / ``wait.text``).
"""

from __future__ import annotations

import asyncio

from jupyter_gpushare.scheduler.core.costs import BLOCK_BYTES
from jupyter_gpushare.scheduler.core.events import Grant, Join, Released, Request, Revoke, Tick
from jupyter_gpushare.scheduler.core.policy import Policy, PolicyConfig

GB = 10**9
#: What w1 misses of the 100 GB pool beside h's 70 (partial eviction asks whole blocks).
W1_MISSES = -(-40 * GB // BLOCK_BYTES) * BLOCK_BYTES
DEV = "GPU-0"


def make_policy(pool: int = 100 * GB, **config: float) -> Policy:
    p = Policy(PolicyConfig(**config))  # type: ignore[arg-type]
    p.add_device(DEV, name="Test GPU", total_bytes=pool, pool_bytes=pool)
    return p


def rejoin(p: Policy, cid: str, now: float, gb: float, resume: str, since: float, **kw):
    used = int(gb * GB)
    return p.handle(
        Join(
            now,
            cid,
            DEV,
            kw.pop("user", cid),
            used=used,
            managed=used,
            resume=resume,
            since=since,
            **kw,
        )
    )


def req(p: Policy, cid: str, now: float, gb: float):
    used = int(gb * GB)
    return p.handle(Request(now, cid, used=used, managed=used))


def status(p: Policy, now: float) -> dict:
    (dev,) = p.snapshot(now)
    return {"dev": dev, **{c["id"]: c for c in dev["clients"]}}


def test_resumed_holder_keeps_its_turn_and_waiters_their_order():
    p = make_policy(base_quantum=5, max_quantum=60)
    p.recover_until(103.0)
    assert rejoin(p, "w2", 100.0, 70, "waiting", since=10) == []
    assert rejoin(p, "h", 100.5, 70, "holding", since=40, gpu_seconds=40) == [Grant("h")]
    assert rejoin(p, "w1", 101.0, 70, "waiting", since=80) == []
    assert req(p, "w2", 101.2, 70) == [] and req(p, "w1", 101.3, 70) == []
    st = status(p, 101.5)
    assert st["dev"]["holders"] == ["h"] and st["h"]["gpu_seconds"] == 41.0
    # The holder's turn began 40 s before it came back, and its memory counts from the start.
    assert st["h"]["held_seconds"] == 41.0 and st["dev"]["resident_bytes"] == 70 * GB
    # w1 began waiting at 21 (overdue: first), w2 at 90.
    assert st["dev"]["queue"] == ["w1", "w2"]
    assert st["w1"]["wait"]["reason"] == "recovering"
    # After the window the old turn is long over: h is revoked for w1.
    out = p.handle(Tick(103.0))
    assert out == [Revoke("h", evict=True, reason="quantum expired", evict_bytes=W1_MISSES)]
    assert p.handle(Released(103.1, "h", evicted=True))[0] == Grant("w1")


def test_two_resumed_holders_that_do_not_fit_first_back_keeps_the_device():
    p = make_policy()
    p.recover_until(0.15)
    assert rejoin(p, "a", 0.0, 60, "holding", since=3) == [Grant("a")]
    assert rejoin(p, "b", 0.1, 60, "holding", since=8) == []  # 120 GB do not fit 100 GB
    st = status(p, 0.2)
    assert st["dev"]["holders"] == ["a"] and st["b"]["state"] == "idle"
    # After the window: b's memory was on the GPU and the pool is over: b is evicted for a.
    assert [type(d).__name__ for d in req(p, "b", 0.3, 60)] in (["Evict"], [])
    st = status(p, 0.4)
    # b queues from its old grant (8 s ago).
    assert st["b"]["state"] in ("waiting", "evicting") and st["dev"]["queue"] == ["b"]
    assert abs(st["b"]["waiting_since"] - (0.1 - 8)) < 1e-9, st["b"]


def test_resumed_holders_that_fit_both_keep_the_device():
    p = make_policy()
    p.recover_until(3.0)
    assert rejoin(p, "a", 0.0, 40, "holding", since=3) == [Grant("a")]
    assert rejoin(p, "b", 0.1, 40, "holding", since=3) == [Grant("b")]
    assert status(p, 0.2)["dev"]["holders"] == ["a", "b"]


def test_claims_are_not_believed_outside_a_recovery_window():
    """A client that says it held the device, or waited since long ago, when the scheduler did
    not just restart: a new client, queued as any other."""
    p = make_policy(base_quantum=5, max_quantum=60)
    p.handle(Join(0.0, "h", DEV, "h"))
    assert req(p, "h", 0.0, 70) == [Grant("h")]
    p.handle(Join(1.0, "w", DEV, "w"))
    assert req(p, "w", 1.0, 70) == []
    assert rejoin(p, "liar", 2.0, 10, "holding", since=500) == []
    assert rejoin(p, "liar2", 2.0, 70, "waiting", since=500) == []
    assert req(p, "liar2", 2.1, 70) == []
    st = status(p, 2.2)
    assert st["dev"]["holders"] == ["h"] and st["dev"]["queue"] == ["w", "liar2"], st["dev"]
    assert st["liar"]["used_bytes"] == 10 * GB  # its memory is taken as reported


def test_no_grant_during_recovery_window():
    p = make_policy()
    p.recover_until(3.0)
    p.handle(Join(0.0, "new", DEV, "alice"))
    assert req(p, "new", 0.5, 10) == []
    assert p.next_deadline() == 3.0
    assert p.handle(Tick(3.0)) == [Grant("new")]


def test_waiters_are_told_why_they_wait():
    p = make_policy(base_quantum=60, max_quantum=600)
    for cid in ("h", "w1", "w2"):
        p.handle(Join(0.0, cid, DEV, cid))
    assert req(p, "h", 0.0, 70) == [Grant("h")]
    req(p, "w1", 1.0, 70)
    req(p, "w2", 2.0, 70)
    st = status(p, 10.0)
    assert st["w1"]["wait"]["reason"] == "turn"
    assert st["w1"]["wait"]["text"] == "waiting for h's kernel: its turn ends in 50 s"
    assert st["w2"]["wait"]["reason"] == "queue"
    assert "behind 1 other kernel" in st["w2"]["wait"]["text"]
    assert "wait" not in st["h"] and st["h"]["quantum_seconds"] == 60.0
    # At the quantum, h is revoked; a cell that keeps the GPU busy answers only at its next
    # kernel boundary: meanwhile the waiters see how long it has been asked.
    assert p.handle(Tick(60.0)) == [
        Revoke("h", evict=True, reason="quantum expired", evict_bytes=W1_MISSES)
    ]
    st = status(p, 300.0)
    w = st["w1"]["wait"]
    assert w["reason"] == "releasing", w
    assert w["text"] == (
        "waiting for h's kernel to finish its GPU work: asked to release 4 min ago, "
        "4 min past its 60 s quantum"
    )
    assert w["holders"][0]["past_quantum_seconds"] == 240.0
    assert st["h"]["revoking_seconds"] == 240.0 and st["h"]["held_seconds"] == 300.0


async def test_the_operator_is_warned_of_an_unanswered_revoke(
    make_scheduler, connect, caplog
) -> None:
    """A holder that does not answer its revoke (a long GPU kernel) is logged once, with its pid,
    after revoke_warning_seconds; one that answers in time is not."""
    import logging

    from jupyter_gpushare.protocol import MsgType

    await make_scheduler(base_quantum=0.2, max_quantum=0.2, revoke_warning_seconds=0.5)
    a, b = await connect(), await connect()
    await a.hello("a")
    await b.hello("b")
    await a.request(700 << 20)
    await a.expect(MsgType.GRANT)
    with caplog.at_level(logging.WARNING):
        await b.request(700 << 20)
        await a.expect(MsgType.REVOKE, timeout=5)
        await asyncio.sleep(0.8)
        warned = [r.getMessage() for r in caplog.records if "has not released" in r.getMessage()]
        assert len(warned) == 1 and "client a (pid" in warned[0], warned
        await a.send(MsgType.RELEASED, flag=1)
        await b.expect(MsgType.GRANT)
        await a.request(700 << 20)  # a waits in turn: b's quantum ends, b answers at once
        await b.expect(MsgType.REVOKE, timeout=5)
        await b.send(MsgType.RELEASED, flag=1)
        await a.expect(MsgType.GRANT)
        await asyncio.sleep(0.8)
    warned = [r.getMessage() for r in caplog.records if "has not released" in r.getMessage()]
    assert len(warned) == 1, warned
