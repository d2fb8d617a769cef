"""Host memory is a budget (docs/architecture.md): no move past it is decided, staging goes to
idle kernels first, and a waiter that can never fit is told so once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from test_policy_scenarios import DEV, GB, POOL, client, join, make_policy, request

from jupyter_gpushare.protocol import ErrorCode, MsgType
from jupyter_gpushare.scheduler.core.costs import BLOCK_BYTES
from jupyter_gpushare.scheduler.core.events import (
    Busy,
    Evict,
    Grant,
    HostMemory,
    Idle,
    Refuse,
    Released,
    Revoke,
    Staging,
)
from jupyter_gpushare.scheduler.core.host_budget import eviction_need
from jupyter_gpushare.scheduler.shell.translate import decision_message


def _idle_a(p, gb: float = 60, host: float = 0, staging: float = 0) -> None:
    """a ran ``gb`` GB, went idle and gave the device back (resident); its engine holds
    ``host`` GB on the host, ``staging`` GB of it staging of its resident memory."""
    join(p, "a")
    join(p, "b", user="bob")
    assert request(p, "a", gb) == [Grant("a")]
    p.handle(Idle(1, "a"))
    p.handle(Released(1.5, "a"))
    p.handle(HostMemory(1.6, "a", int(host * GB), int(staging * GB)))


def _moves(decisions) -> list:
    return [d for d in decisions if isinstance(d, Evict) or (isinstance(d, Revoke) and d.evict)]


def test_an_eviction_that_would_pass_the_host_budget_is_not_decided():
    # Without a budget the waiter's room is made from a's memory (the old behaviour) ...
    p = make_policy()
    _idle_a(p)
    assert _moves(request(p, "b", 60, now=2))
    # ... with a 10 GB budget, 5 GB of it a's staging, a's 20 GB cannot go to the host:
    # nothing moves, b waits, and its status says why, in the words the notebook's wait line
    # shows.
    p = make_policy(host_budget=10 * GB)
    _idle_a(p, host=5, staging=5)
    decisions = request(p, "b", 60, now=2)
    assert not _moves(decisions) and Grant("b") not in decisions
    wait = client(p, "b", 2)["wait"]
    assert wait["reason"] == "host_memory"
    assert wait["text"].startswith("the node's host memory is full")
    assert "by 1 idle notebook" in wait["text"]


def test_a_partial_eviction_needs_room_for_all_that_may_go():
    # b needs 20 GB of a's 59.5 GB (its context is on the GPU). The shim frees whole blocks
    # (one 60 GB tensor goes whole for a 20 GB ask), so the host must have room for all of a:
    # a 60 GB budget has, and the eviction still asks for the 20 GB only ...
    p = make_policy(host_budget=60 * GB)
    _idle_a(p)
    (evict,) = _moves(request(p, "b", 60, now=2))
    assert isinstance(evict, Evict) and evict.client == "a"
    assert 20 * GB <= evict.bytes <= 20 * GB + BLOCK_BYTES
    # ... a 30 GB budget has not, though the 20 GB asked for would fit.
    p = make_policy(host_budget=30 * GB)
    _idle_a(p)
    assert not _moves(request(p, "b", 60, now=2))


def test_staging_already_made_takes_no_more_host_room():
    # a's staging holds its whole resident memory and fills the budget: its eviction copies into
    # that staging and needs no more host memory, so it is decided.
    p = make_policy(host_budget=60 * GB)
    _idle_a(p, host=60, staging=60)
    assert _moves(request(p, "b", 60, now=2))
    # The same host memory held as evicted data of another kernel leaves no room: not decided.
    p = make_policy(host_budget=60 * GB)
    _idle_a(p, host=60, staging=0)
    assert not _moves(request(p, "b", 60, now=2))


def test_host_memory_given_back_lets_the_waiter_in():
    p = make_policy(host_budget=70 * GB)
    _idle_a(p, host=25, staging=0)  # 25 GB of older evicted data: 45 GB of room, not 59.5
    assert not _moves(request(p, "b", 60, now=2))
    decisions = p.handle(HostMemory(3, "a", 0, 0))  # that memory came back and was released
    assert [d.client for d in _moves(decisions)] == ["a"]


def test_staging_goes_to_idle_kernels_first_least_recently_used_first():
    p = make_policy(host_budget=50 * GB)
    for cid in ("busy", "new", "old"):  # joined in the order opposite to their use
        join(p, cid, user=cid)
    for cid, t in (("old", 1.0), ("new", 2.0)):
        request(p, cid, 30, now=t)
        p.handle(Idle(t + 0.1, cid))
        p.handle(Released(t + 0.2, cid))
    request(p, "busy", 30, now=3)
    p.handle(Busy(3.1, "busy"))
    out: dict[str, int] = {}
    for i, cid in enumerate(("busy", "new", "old")):  # each says what it holds: nothing yet
        for d in p.handle(HostMemory(4 + i, cid, 0, 0)):
            if isinstance(d, Staging):
                out[d.client] = d.bytes
    resident = 29.5 * GB  # each one's movable memory (0.5 GB of context is pinned)
    assert out["old"] >= resident  # the least recently used idle kernel: all it holds
    assert out["new"] == (50 * GB - out["old"]) // BLOCK_BYTES * BLOCK_BYTES  # the rest
    assert out["busy"] == 0  # busy last: nothing left
    assert sum(out.values()) <= 50 * GB
    # Evicted memory on the host comes first: the allowances shrink to leave it room.
    shrunk = {d.client: d.bytes for d in p.handle(HostMemory(8, "busy", 40 * GB, 0))}
    assert shrunk["old"] == 10 * GB // BLOCK_BYTES * BLOCK_BYTES
    assert shrunk["new"] == 0


def test_without_a_budget_no_staging_allowance_is_sent():
    p = make_policy()
    _idle_a(p)
    assert not [d for d in p.handle(HostMemory(2, "a", 0, 0)) if isinstance(d, Staging)]


def test_a_waiter_that_can_never_fit_is_refused_once():
    p = make_policy(host_budget=10 * GB)
    join(p, "w")
    decisions = request(p, "w", POOL / GB + 11)  # more than the pool and the budget together
    (refuse,) = [d for d in decisions if isinstance(d, Refuse)]
    assert "can never fit" in refuse.message and "host memory budget" in refuse.message
    assert not [d for d in request(p, "w", POOL / GB + 11, now=1) if isinstance(d, Refuse)]
    msg = decision_message(refuse)
    assert msg.type == MsgType.ERROR and msg["error_code"] == ErrorCode.NO_ROOM
    # One that fits the pool and the budget together is not refused.
    p = make_policy(host_budget=10 * GB)
    join(p, "w")
    assert not [d for d in request(p, "w", POOL / GB + 9) if isinstance(d, Refuse)]


def test_a_staging_allowance_goes_on_the_wire():
    msg = decision_message(Staging("a", 5 * GB))
    assert msg.type == MsgType.STAGING and msg["staging_bytes"] == 5 * GB


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(2, 30), min_size=1, max_size=5).filter(lambda s: sum(s) <= 95),
    staged=st.lists(st.floats(0, 1), min_size=5, max_size=5),
    evicted_gb=st.integers(0, 40),
    budget_gb=st.integers(1, 80),
    want=st.integers(2, 95),
    holder_idle=st.booleans(),
)
def test_no_decided_move_passes_the_host_budget(
    sizes, staged, evicted_gb, budget_gb, want, holder_idle
):
    budget = budget_gb * GB
    p = make_policy(host_budget=budget)
    for i, gb in enumerate(sizes):
        cid = f"i{i}"
        join(p, cid, user=cid)
        request(p, cid, gb, now=i)
        p.handle(Idle(i + 0.5, cid))
        if i or not holder_idle:
            p.handle(Released(i + 0.7, cid))  # the first may stay an idle holder
        stage = int(staged[i] * (gb - 0.5) * GB)
        p.handle(HostMemory(i + 0.8, cid, stage + (evicted_gb * GB if i == 0 else 0), stage))
    held = sum(c.host for c in p._clients.values())
    join(p, "w", user="w")
    decisions = request(p, "w", want, now=100)
    # Whatever each eviction takes (whole blocks: up to all of its client), the host holds it.
    need = sum(eviction_need(p._clients[d.client]) for d in _moves(decisions))
    assert held + need <= max(budget, held), decisions
    dev = p._devices[DEV]
    if Grant("w") in decisions:  # granted: it fits beside what stays on the device
        assert dev.resident_bytes - dev.incoming_bytes <= dev.pool_bytes
