"""Property: a scheduler restarted from what its clients say equals the one that died.

Hypothesis drives a policy with random clients and random requests and releases, in a
cooperative environment (every revoke, eviction and restore answered at once), then "kills" it
at a random moment. A new policy hears every client again in a random order, as the shims would
reconnect: its memory, and whether it held the device or waited for it and since when. Checked:
the holders are the same, every client's memory is the same, the waiters are the same and those
that were overdue keep their order, and nothing is decided during the recovery window but the
resumed grants.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jupyter_gpushare.scheduler.core.events import (
    Decision,
    Evict,
    Evicted,
    Grant,
    Join,
    Released,
    Request,
    Restored,
    Revoke,
    Tick,
)
from jupyter_gpushare.scheduler.core.policy import Policy, PolicyConfig

MB = 1 << 20
DEV = "GPU-0"
POOL = 1000 * MB
CONFIG = PolicyConfig(
    base_quantum=10.0, max_quantum=30.0, evict_bandwidth=1e9, restore_bandwidth=5e9
)
WINDOW = 3.0


def new_policy() -> Policy:
    p = Policy(CONFIG)
    p.add_device(DEV, name="GPU", total_bytes=POOL, pool_bytes=POOL)
    return p


def answer(p: Policy, decisions: list[Decision], now: float) -> None:
    """The cooperative environment: every decision answered at once (answers may decide more)."""
    todo = list(decisions)
    while todo:
        d = todo.pop(0)
        if isinstance(d, Revoke):
            todo += p.handle(Released(now, d.client, evicted=d.evict))
        elif isinstance(d, Evict):
            todo += p.handle(Evicted(now, d.client))
        elif isinstance(d, Grant) and d.restore:
            todo += p.handle(Restored(now, d.client))


def state(p: Policy, now: float) -> dict:
    (dev,) = p.snapshot(now)
    return dev


ops = st.lists(
    st.tuples(
        st.integers(0, 5),  # which client
        st.sampled_from(["request", "request", "request", "release"]),
        st.floats(0.05, 2.0),  # time until the next operation
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    sizes=st.lists(st.integers(200, 700), min_size=2, max_size=6),
    script=ops,
    order=st.randoms(use_true_random=False),
)
def test_a_restart_rebuilds_the_same_state(sizes, script, order) -> None:
    ids = [f"k{i}" for i in range(len(sizes))]
    used = {cid: size * MB for cid, size in zip(ids, sizes, strict=True)}
    p = new_policy()
    now = 0.0
    for cid in ids:
        answer(p, p.handle(Join(now, cid, DEV, f"user-{cid}")), now)
    for which, op, dt in script:
        cid = ids[which % len(ids)]
        c = next(c for c in state(p, now)["clients"] if c["id"] == cid)
        if op == "request" and c["state"] in ("idle", "evicting"):
            answer(p, p.handle(Request(now, cid, used=used[cid], managed=used[cid])), now)
        elif op == "release" and c["state"] == "running":
            answer(p, p.handle(Released(now, cid)), now)
        now += dt
        answer(p, p.handle(Tick(now)), now)

    before = state(p, now)
    clients = {c["id"]: c for c in before["clients"]}
    assert all(c["state"] in ("idle", "waiting", "running") for c in clients.values()), before
    event(f"{len(before['holders'])} holder(s), {min(len(before['queue']), 2)}+ waiter(s)")

    # The scheduler dies; a new one hears everyone again, in a random order, within the window.
    q = new_policy()
    q.recover_until(now + WINDOW)
    rejoin_order = list(ids)
    order.shuffle(rejoin_order)
    t = now
    decided: list[Decision] = []
    for cid in rejoin_order:
        c = clients[cid]
        t += 0.01
        if c["state"] == "running":
            resume, since = "holding", t - (now - c["held_seconds"])
        elif c["state"] == "waiting":
            resume, since = "waiting", c["wait_seconds"] + (t - now)
        else:
            resume, since = "", 0.0
        decided += q.handle(
            Join(
                t,
                cid,
                DEV,
                f"user-{cid}",
                used=c["used_bytes"],
                managed=c["managed_bytes"],
                pinned=c["pinned_bytes"],
                evicted=c["evicted_bytes"],
                resume=resume,
                since=since,
                gpu_seconds=c["gpu_seconds"],
            )
        )
    for cid in rejoin_order:
        if clients[cid]["state"] == "waiting":
            t += 0.01
            # The shim's request says what it has on the host (a paused waiter's memory may
            # have been evicted for a shorter cell).
            ev = clients[cid]["evicted_bytes"]
            decided += q.handle(Request(t, cid, used=used[cid], managed=used[cid], evicted=ev))
    after = state(q, t)
    new = {c["id"]: c for c in after["clients"]}

    assert all(isinstance(d, Grant) for d in decided), decided  # the resumed grants only
    assert sorted(after["holders"]) == sorted(before["holders"]), (before, after)
    assert set(after["queue"]) == set(before["queue"]), (before, after)
    for cid, c in clients.items():
        for key in ("used_bytes", "managed_bytes", "evicted_bytes"):
            assert new[cid][key] == c[key], (cid, key, c, new[cid])
    overdue = [cid for cid in before["queue"] if clients[cid]["wait_seconds"] >= CONFIG.max_quantum]
    assert [cid for cid in after["queue"] if cid in overdue] == overdue, (before, after)

    # After the window, scheduling goes on and never puts holders over the pool together.
    out = q.handle(Tick(now + WINDOW))
    answer(q, out, now + WINDOW)
    dev = state(q, now + WINDOW)
    holders = [c for c in dev["clients"] if c["id"] in dev["holders"]]
    assert len(holders) <= 1 or sum(c["used_bytes"] for c in holders) <= POOL, dev
