"""Pre-copy of idle kernels (docs/architecture.md, "Pre-copy"): the policy asks an idle, resident
client to copy its memory to the host in the background, least recently used first, once per
idle period, and never a client that is about to run or move anyway."""

from __future__ import annotations

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
    Precopy,
    Released,
    Request,
)
from jupyter_gpushare.scheduler.core.policy import Policy, PolicyConfig, precopy_candidates

GB = 10**9
DEV = "GPU-0"


def make_policy(precopy: bool = True, pool: int = 100 * GB, **config: object) -> Policy:
    policy = Policy(PolicyConfig(precopy_idle=precopy, **config))  # type: ignore[arg-type]
    policy.add_device(DEV, name="Test GPU", total_bytes=pool + 5 * GB, pool_bytes=pool)
    return policy


def run(policy: Policy, client: str, gb: float, now: float) -> list:
    """Join, ask for the device with `gb` GB (0.5 GB pinned), get it."""
    policy.handle(Join(now, client, DEV, client))
    used = int(gb * GB)
    return policy.handle(Request(now, client, used=used, managed=used - GB // 2, pinned=GB // 2))


def test_an_idle_resident_kernel_is_asked_to_precopy_once():
    p = make_policy()
    assert run(p, "a", 10, now=0) == [Grant("a")]
    assert p.handle(Idle(1, "a")) == [Precopy("a")]
    # Once per idle period: not again while it stays idle, whatever the answer.
    assert p.handle(Idle(2, "a")) == []
    assert p.handle(Precopied(3, "a", bytes_moved=int(9.5 * GB), precopied=int(9.5 * GB))) == []
    assert p.handle(Idle(4, "a")) == []


def test_running_again_makes_the_copy_stale_and_the_next_idle_asks_again():
    p = make_policy()
    run(p, "a", 10, now=0)
    p.handle(Idle(1, "a"))
    p.handle(Precopied(2, "a", precopied=int(9.5 * GB)))
    assert p.handle(Busy(3, "a")) == []
    assert p.handle(Idle(4, "a")) == [Precopy("a")]


def test_a_partial_copy_is_not_asked_again_in_the_same_idle_period():
    """Memory the shim cannot pre-copy (the program's own managed memory) must not make every
    later event ask again."""
    p = make_policy()
    run(p, "a", 10, now=0)
    assert p.handle(Idle(1, "a")) == [Precopy("a")]
    p.handle(Precopied(2, "a", precopied=4 * GB))
    assert p.handle(Memory(3, "a", used=10 * GB, managed=int(9.5 * GB), pinned=GB // 2,
                           evicted=0, precopied=4 * GB)) == []  # fmt: skip


def test_a_partial_copy_is_completed_on_the_next_idle():
    p = make_policy()
    run(p, "a", 10, now=0)
    p.handle(Idle(1, "a"))
    # The shim copied half (its host budget ran out or a call interrupted it).
    p.handle(Precopied(2, "a", precopied=4 * GB))
    p.handle(Busy(3, "a"))
    p.handle(Memory(3.5, "a", used=10 * GB, managed=int(9.5 * GB), pinned=GB // 2, evicted=0))
    assert p.handle(Idle(4, "a")) == [Precopy("a")]


def test_off_by_configuration_and_in_the_fixed_quantum_baseline():
    for p in (make_policy(precopy=False), make_policy(policy="fixed-quantum")):
        run(p, "a", 10, now=0)
        assert Precopy("a") not in p.handle(Idle(1, "a"))


def test_an_evicted_kernel_is_not_asked():
    p = make_policy(pool=30 * GB)
    run(p, "a", 20, now=0)
    p.handle(Idle(1, "a"))
    p.handle(Precopied(1.5, "a", precopied=int(19.5 * GB)))
    # b arrives and does not fit: a (idle) is revoked with eviction, then b runs.
    decisions = run(p, "b", 20, now=2)
    assert any(getattr(d, "client", "") == "a" for d in decisions), decisions
    p.handle(Released(2.1, "a", evicted=True, bytes_moved=0, micros=1000))
    (dev,) = p.snapshot(2.1)
    (a,) = [c for c in dev["clients"] if c["id"] == "a"]
    # Only the 10 GB b missed left (partial eviction), pre-copied blocks first: what stays
    # keeps its host copy.
    gone = -(-10 * GB // BLOCK_BYTES) * BLOCK_BYTES
    assert a["evicted_bytes"] == gone, a
    assert a["precopied_bytes"] == int(19.5 * GB) - gone, a
    # What is on the GPU is all pre-copied: nothing to pre-copy even when it says it is idle.
    assert Precopy("a") not in p.handle(Idle(3, "a"))


def test_a_partial_eviction_reported_before_its_answer_is_taken_off_the_copy_once():
    """The shim reports its memory before it answers a move (client/lifecycle.c): that MEMORY
    already says the pre-copied bytes left. The EVICTED after it must not take them off again:
    it did, the rest of a partly evicted idle kernel read as not pre-copied for its whole idle
    period (asked once per period), and the stand-in replay's warm start never settled."""
    p = make_policy(pool=30 * GB)
    run(p, "a", 20, now=0)
    p.handle(Idle(1, "a"))
    p.handle(Precopied(1.5, "a", precopied=int(19.5 * GB)))
    p.handle(Released(1.6, "a"))  # idle, resident, all of it pre-copied
    (evict,) = [d for d in run(p, "b", 20, now=2) if isinstance(d, Evict)]
    gone = -(-10 * GB // BLOCK_BYTES) * BLOCK_BYTES
    assert evict == Evict("a", reason="room for b", bytes=gone)
    left = int(19.5 * GB) - gone  # pre-copied blocks leave first: what stays keeps its copy
    p.handle(Memory(2.1, "a", used=20 * GB, managed=int(19.5 * GB), pinned=GB // 2,
                    evicted=gone, precopied=left))  # fmt: skip
    p.handle(Evicted(2.2, "a", bytes_moved=0, micros=1000, evicted_bytes=gone))
    (dev,) = p.snapshot(2.2)
    (a,) = [c for c in dev["clients"] if c["id"] == "a"]
    assert a["evicted_bytes"] == gone and a["precopied_bytes"] == left, a


def test_candidates_are_least_recently_used_first_and_skip_busy_ones():
    p = make_policy()
    run(p, "old", 5, now=0)
    run(p, "new", 5, now=1)
    run(p, "busy", 5, now=2)
    # The policy's clients, as precopy_candidates sees them: make old the least recently used.
    clients = {c.id: c for c in p._clients.values()}
    for cid, active in (("old", 1.0), ("new", 5.0), ("busy", 0.5)):
        clients[cid].idle = cid != "busy"
        clients[cid].last_active = active
    assert precopy_candidates(clients.values(), []) == ["old", "new"]
    # A client another decision of the same batch moves is left alone.
    assert precopy_candidates(clients.values(), [Evict("old")]) == ["new"]
    clients["new"].precopy_asked = True
    assert precopy_candidates(clients.values(), []) == ["old"]


def test_an_idle_report_says_how_much_of_the_copy_is_still_valid():
    """A holder that ran again without a Busy (no Jupyter) reports its stale copy in IDLE."""
    p = make_policy()
    run(p, "a", 10, now=0)
    p.handle(Idle(1, "a"))
    p.handle(Precopied(2, "a", precopied=int(9.5 * GB)))
    assert p.handle(Idle(3, "a", precopied=int(9.5 * GB))) == []
    assert p.handle(Idle(4, "a", precopied=0)) == [Precopy("a")]
