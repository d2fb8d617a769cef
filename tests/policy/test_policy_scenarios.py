"""The scheduling policy's main scenarios, one story per test."""

from __future__ import annotations

import pytest

from jupyter_gpushare.scheduler.core.costs import BLOCK_BYTES
from jupyter_gpushare.scheduler.core.events import (
    AdminRelease,
    Busy,
    Evict,
    Evicted,
    Grant,
    Idle,
    Join,
    Leave,
    Memory,
    Released,
    Request,
    Restored,
    Revoke,
    SetQuota,
    Tick,
)
from jupyter_gpushare.scheduler.core.ordering import OrderingConfig
from jupyter_gpushare.scheduler.core.policy import Policy, PolicyConfig

GB = 10**9
DEV = "GPU-0"
POOL = 100 * GB


def part(gb: float) -> int:
    """What a partial eviction asks for ``gb`` missing GB: rounded up to the engine's block."""
    return -(-int(gb * GB) // BLOCK_BYTES) * BLOCK_BYTES


def make_policy(pool: int = POOL, **config: object) -> Policy:
    # These stories are the memory rules: under the "fair" ordering every kernel that fits runs,
    # so each decision here is memory's. The interactive ordering has its own tests
    # (test_ordering.py), which also run these rules beneath it.
    config.setdefault("ordering", OrderingConfig("fair"))
    policy = Policy(PolicyConfig(**config))  # type: ignore[arg-type]
    policy.add_device(DEV, name="Test GPU", total_bytes=pool + 5 * GB, pool_bytes=pool)
    return policy


def join(policy: Policy, client: str, user: str = "alice", now: float = 0.0, **kw: object) -> None:
    assert policy.handle(Join(now, client, DEV, user, **kw)) == []  # type: ignore[arg-type]


def request(policy: Policy, client: str, gb: float, now: float = 0.0, pinned: float = 0.5):
    used = int(gb * GB)
    pin = min(used, int(pinned * GB))
    return policy.handle(Request(now, client, used=used, managed=used - pin, pinned=pin))


def device(policy: Policy, now: float = 0.0) -> dict:
    (dev,) = policy.snapshot(now)
    return dev


def client(policy: Policy, cid: str, now: float = 0.0) -> dict:
    return next(c for c in device(policy, now)["clients"] if c["id"] == cid)


def b_takes_20_of_idle_a(policy: Policy) -> None:
    """a (60 GB) ran and went idle; b's 60 GB took 20 of a's (the pool is 100 GB): b holds the
    device at t=3. The start that restore-ahead and cell-hint stories share."""
    join(policy, "a")
    join(policy, "b", user="bob")
    request(policy, "a", 60)
    policy.handle(Idle(1, "a"))
    assert request(policy, "b", 60, now=2) == [
        Revoke("a", evict=True, reason="idle", evict_bytes=part(20))
    ]
    assert policy.handle(Released(3, "a", evicted=True)) == [Grant("b")]


# ------------------------------------------------------------------------------------------------


def test_two_that_fit_run_side_by_side():
    p = make_policy()
    join(p, "a")
    join(p, "b", user="bob")
    assert request(p, "a", 40) == [Grant("a")]
    assert request(p, "b", 50) == [Grant("b")]
    dev = device(p)
    assert dev["mode"] == "shared"
    assert dev["holders"] == ["a", "b"]
    assert dev["queue"] == []
    assert dev["resident_bytes"] == 90 * GB
    assert p.next_deadline() is None  # nobody waits: no quantum runs


def test_two_that_do_not_fit_take_turns_with_evict_and_restore():
    p = make_policy()
    join(p, "a")
    join(p, "b", user="bob")
    assert request(p, "a", 60) == [Grant("a")]
    assert request(p, "b", 60, now=1) == []  # a is inside its quantum: b waits
    dev = device(p, 1)
    assert dev["mode"] == "turns"
    assert dev["queue"] == ["b"]
    assert client(p, "b", 1)["queue_position"] == 1
    quantum_a = 4 * (59.5 / 10 + 59.5 / 50)  # movable bytes / bandwidths, x move_factor
    assert dev["quantum_ms"] == round(quantum_a * 1000)
    deadline = p.next_deadline()
    assert deadline is not None and deadline <= quantum_a

    # Partial eviction: a frees only the 20 GB that b misses (rounded up to a block).
    assert p.handle(Tick(quantum_a)) == [
        Revoke("a", evict=True, reason="quantum expired", evict_bytes=part(20))
    ]
    assert client(p, "a", quantum_a)["state"] == "revoking"
    # a's memory goes to the host; b (never evicted) runs without a restore
    assert p.handle(Released(quantum_a + 2, "a", evicted=True)) == [Grant("b", restore=False)]
    assert request(p, "a", 60, now=quantum_a + 2) == []  # a wants it back: its turn comes next

    t = quantum_a + 2 + quantum_a
    assert p.handle(Tick(t)) == [
        Revoke("b", evict=True, reason="quantum expired", evict_bytes=part(20))
    ]
    assert p.handle(Released(t + 1, "b", evicted=True)) == [Grant("a", restore=True)]
    assert p.handle(Restored(t + 2, "a", bytes_moved=int(59.5 * GB), micros=1_200_000)) == []
    # The status says what the last restore moved and took (the wait line shows it).
    assert client(p, "a", t + 2)["last_restore"] == {"bytes": int(59.5 * GB), "seconds": 1.2}
    assert client(p, "b", t + 2)["last_restore"] is None


def test_idle_holder_is_revoked_at_once_for_a_waiter():
    p = make_policy()
    join(p, "a")
    join(p, "b", user="bob")
    request(p, "a", 60)
    assert p.handle(Idle(1, "a")) == []  # nobody waits: an idle holder keeps the device
    assert request(p, "b", 60, now=2) == [
        Revoke("a", evict=True, reason="idle", evict_bytes=part(20))
    ]


def test_idle_holder_is_evicted_only_if_the_waiter_needs_its_room():
    p = make_policy()
    for cid in ("a1", "a2", "b"):
        join(p, cid, user=cid)
    request(p, "a1", 30)
    request(p, "a2", 30)
    request(p, "c", 1)  # unknown client: ignored
    p.handle(Idle(1, "a1"))
    p.handle(Idle(1, "a2"))
    # b needs 50: 40 are free, a1's eviction frees the rest; a2 is revoked but keeps its memory
    assert request(p, "b", 50, now=2) == [
        Revoke("a1", evict=True, reason="idle", evict_bytes=part(10)),
        Revoke("a2", evict=False, reason="idle"),
    ]
    assert p.handle(Released(3, "a2")) == []
    assert p.handle(Released(3, "a1", evicted=True)) == [Grant("b")]
    assert client(p, "a2", 3)["state"] == "idle"
    # a1 keeps what b did not need (partial eviction)
    assert device(p, 3)["resident_bytes"] == 30 * GB + 50 * GB + (30 * GB - part(10))


def test_busy_holder_is_not_revoked_as_idle():
    p = make_policy()
    join(p, "a")
    join(p, "b", user="bob")
    request(p, "a", 60)
    p.handle(Idle(1, "a"))
    p.handle(Busy(2, "a"))  # a new cell started
    assert request(p, "b", 60, now=3) == []  # a keeps its quantum


def test_idle_memory_is_evicted_least_recently_used_first_and_only_when_needed():
    p = make_policy()
    for cid in ("old", "new", "w"):
        join(p, cid, user=cid)
    request(p, "old", 40)
    request(p, "new", 40)
    assert p.handle(Released(1, "old")) == []  # memory stays: nobody needs the room
    assert p.handle(Released(2, "new")) == []
    assert device(p, 2)["resident_bytes"] == 80 * GB
    # w needs 30, 20 are free: the missing 10 leave the least recently used idle client
    # (partial eviction: only what is missing, rounded up to the engine's block)
    assert request(p, "w", 30, now=3) == [Evict("old", reason="room for w", bytes=part(10))]
    assert client(p, "w", 3)["state"] == "waiting"
    assert client(p, "old", 3)["state"] == "evicting"
    assert p.handle(Evicted(4, "old", bytes_moved=int(39.5 * GB), micros=3_950_000)) == [Grant("w")]
    # old comes back: new (idle, resident) is evicted for it, and old is restored
    assert request(p, "old", 40, now=5) == [Evict("new", reason="room for old", bytes=part(10))]
    assert p.handle(Evicted(6, "new")) == [Grant("old", restore=True)]


def test_a_failed_eviction_never_overcommits_the_pool():
    """A shim that could not evict (a stream capture outlived its bounded wait) says so: the
    client's memory stays counted on the GPU, the waiter is not granted into room that does not
    exist, and the next pass asks again."""
    p = make_policy()
    for cid in ("old", "w"):
        join(p, cid, user=cid)
    request(p, "old", 80)
    assert p.handle(Released(1, "old")) == []
    assert request(p, "w", 30, now=2) == [Evict("old", reason="room for w", bytes=part(10))]
    resident = device(p, 2)["resident_bytes"]
    decisions = p.handle(Evicted(3, "old", bytes_moved=0, micros=0, ok=False))
    assert Grant("w") not in decisions and Grant("w", restore=False) not in decisions
    assert decisions == [Evict("old", reason="room for w", bytes=part(10))]  # retried
    assert device(p, 3)["resident_bytes"] == resident  # still counted on the GPU
    assert client(p, "w", 3)["state"] == "waiting"
    assert p.handle(Evicted(4, "old", bytes_moved=80 * GB, micros=1_000_000)) == [Grant("w")]


def test_quantum_scales_with_memory_and_is_clamped():
    p = make_policy(pool=200 * GB)
    for cid in ("small", "big", "huge", "w"):
        join(p, cid, user=cid)

    def quantum_of(cid: str, gb: float, now: float) -> float:
        assert request(p, cid, gb, now=now) == [Grant(cid)]
        return device(p, now)["quantum_ms"] / 1000

    assert quantum_of("small", 2, 0) == pytest.approx(5.0)  # base quantum
    assert device(p)["quantum_ms"] == 5000
    p.handle(Leave(0, "small"))
    assert quantum_of("big", 80, 0) == pytest.approx(4 * (79.5 / 10 + 79.5 / 50))  # 38.16 s
    p.handle(Leave(0, "big"))
    assert quantum_of("huge", 190, 0) == pytest.approx(60.0)  # max quantum


def test_measured_bandwidth_updates_the_quantum():
    p = make_policy()
    join(p, "a")
    request(p, "a", 10.5)
    assert device(p)["quantum_ms"] == 5000  # 4 x (10/10 + 10/50) = 4.8 s: the base quantum
    # evictions measured at 2 GB/s instead of the assumed 10 GB/s: turns get longer
    for t in range(1, 20):
        p.handle(Released(t, "a", evicted=True, bytes_moved=4 * GB, micros=2_000_000))
        assert request(p, "a", 10.5, now=t) == [Grant("a", restore=True)]
    assert device(p, 20)["quantum_ms"] / 1000 == pytest.approx(4 * (10 / 2 + 10 / 50), rel=0.01)


def test_fair_share_picks_the_lighter_user():
    p = make_policy()
    for cid, user in (("hog", "alice"), ("alice2", "alice"), ("bob1", "bob")):
        join(p, cid, user=user)
    assert request(p, "hog", 90) == [Grant("hog")]
    assert request(p, "alice2", 90, now=1) == []  # alice waits first ...
    assert request(p, "bob1", 90, now=2) == []  # ... but bob has used nothing
    assert device(p, 2)["queue"] == ["bob1", "alice2"]
    assert p.handle(Tick(30)) == []  # hog's quantum is 4 * (89.5/10 + 89.5/50) = 42.96 s
    assert p.handle(Tick(43)) == [
        Revoke("hog", evict=True, reason="quantum expired", evict_bytes=part(80.5))
    ]
    assert p.handle(Released(44, "hog", evicted=True)) == [Grant("bob1")]


def test_fair_share_respects_weights():
    p = make_policy(usage_half_life=0)  # no decay: alice's older use must not make her lighter
    join(p, "x", user="carol")
    join(p, "a", user="alice", weight=4.0)
    join(p, "b", user="bob")
    assert request(p, "a", 90, now=0) == [Grant("a")]  # alice uses the GPU for 10 s ...
    assert p.handle(Released(10, "a")) == []
    assert request(p, "b", 90, now=10) == [Evict("a", reason="room for b", bytes=part(80))]
    assert p.handle(Evicted(10, "a")) == [Grant("b")]  # ... and bob for 10 s
    # x's context (0.5 GB) appears with its request: a's last part pays for it ...
    assert request(p, "x", 90, now=20) == [Evict("a", reason="memory pressure", bytes=part(0.5))]
    assert p.handle(Evicted(20, "a")) == []
    # ... and once b is done, a's rest (least recently used) and as much of b as x misses go
    assert p.handle(Released(20, "b")) == [
        Evict("a", reason="room for x"),
        Evict("b", reason="room for x", bytes=part(80.5)),
    ]
    assert p.handle(Evicted(20, "a")) == []
    assert p.handle(Evicted(20, "b")) == [Grant("x")]
    request(p, "b", 90, now=21)
    request(p, "a", 90, now=22)
    # equal usage, but alice's weight is 4: she comes first although she asked last
    assert device(p, 22)["queue"] == ["a", "b"]


def test_kill_of_a_holder_grants_the_waiter_immediately():
    p = make_policy()
    join(p, "a")
    join(p, "b", user="bob")
    request(p, "a", 70)
    assert request(p, "b", 70, now=1) == []
    assert p.handle(Leave(2, "a")) == [Grant("b")]
    assert not p.has_client("a")
    assert [c["id"] for c in device(p, 2)["clients"]] == ["b"]


def test_admin_release_and_quota():
    p = make_policy()
    join(p, "a")
    join(p, "b")
    request(p, "a", 30)
    request(p, "b", 30)
    assert p.handle(AdminRelease(1, "a")) == [
        Revoke("a", evict=False, reason="released by request")
    ]
    assert p.handle(AdminRelease(1, "b", evict=True)) == [
        Revoke("b", evict=True, reason="released by request")
    ]
    p.handle(Released(2, "a"))
    assert p.handle(AdminRelease(3, "a")) == []  # idle, no eviction asked: nothing to do
    assert p.handle(AdminRelease(3, "a", evict=True)) == [Evict("a", reason="released by request")]
    assert p.handle(SetQuota(4, "a", 8 * GB)) == []  # the shell tells the shim, not the policy
    assert client(p, "a", 4)["quota_bytes"] == 8 * GB


def test_a_large_waiter_is_not_starved_by_small_ones():
    p = make_policy()
    join(p, "big", user="big")
    join(p, "s1", user="s1")
    join(p, "s2", user="s2")
    request(p, "s1", 50)
    assert request(p, "big", 80, now=1) == []  # blocked by s1
    assert request(p, "s2", 20, now=2) == [Grant("s2")]  # big waited < 5 s: backfill is fine
    p.handle(Released(3, "s2"))
    assert request(p, "s2", 20, now=7) == []  # big has waited a quantum: it reserves the room
    assert p.handle(Tick(7)) == []
    # s1's quantum expired at 5 but nothing was needed before 7; now both go for big's sake
    out = p.handle(Released(8, "s1", evicted=True))
    assert out == [Evict("s2", reason="room for big", bytes=part(0.5))]
    assert p.handle(Evicted(9, "s2")) == [Grant("big")]


def test_holders_that_grow_past_the_pool_are_separated():
    p = make_policy()
    join(p, "a")
    join(p, "b")
    request(p, "a", 40)
    request(p, "b", 40, now=1)
    used = 70 * GB
    out = p.handle(Memory(2, "b", used=used, managed=used - GB // 2, pinned=GB // 2, evicted=0))
    # b's new allocation is what no longer fits: b waits, a (busy with its own work) keeps going
    assert out == [
        Revoke("b", evict=True, reason="memory grew past the pool", evict_bytes=part(10))
    ]


def test_an_idle_holder_gives_way_before_a_busy_grower():
    """Two notebooks ran small cells side by side and both still hold the device; b's cell
    finished (idle). When a's next cell allocates past the pool, b is the one revoked."""
    p = make_policy()
    join(p, "a")
    join(p, "b")
    request(p, "a", 10)
    request(p, "b", 40, now=1)
    p.handle(Idle(2, "b"))
    used = 70 * GB
    out = p.handle(Memory(3, "a", used=used, managed=used - GB // 2, pinned=GB // 2, evicted=0))
    assert out == [
        Revoke("b", evict=True, reason="memory grew past the pool", evict_bytes=part(10))
    ]


def test_a_client_alone_may_exceed_the_pool():
    p = make_policy()
    join(p, "a")
    join(p, "b")
    request(p, "b", 10)
    p.handle(Released(1, "b"))
    # a asks for more than the pool: everything else is evicted, then a runs alone
    assert request(p, "a", 120, now=2) == [Evict("b", reason="room for a")]
    assert p.handle(Evicted(3, "b")) == [Grant("a")]


def test_overdue_waiters_are_served_in_arrival_order():
    p = make_policy(max_quantum=20.0)
    join(p, "heavy", user="heavy")
    join(p, "light", user="light")
    join(p, "holder", user="other")
    request(p, "heavy", 90)
    p.handle(Tick(15))
    p.handle(Leave(15, "heavy"))  # the heavy user has 15 s of usage
    join(p, "heavy", user="heavy", now=15)
    request(p, "holder", 90, now=15)
    request(p, "heavy", 90, now=16)
    request(p, "light", 90, now=17)
    assert device(p, 17)["queue"] == ["light", "heavy"]  # fair share
    assert device(p, 36)["queue"] == ["heavy", "light"]  # heavy waited max_quantum: overdue


def test_unknown_clients_are_ignored_and_unknown_devices_refused():
    p = make_policy()
    for evt in (
        Request(0, "ghost", used=GB),
        Released(0, "ghost"),
        Evicted(0, "ghost"),
        Idle(0, "ghost"),
        Leave(0, "ghost"),
        SetQuota(0, "ghost", 1),
    ):
        assert p.handle(evt) == []
    with pytest.raises(ValueError):
        p.handle(Join(0, "x", "GPU-unknown", "alice"))
    assert p.client_device("ghost") is None
    join(p, "x")
    assert p.client_device("x") == DEV


def test_snapshot_shape():
    p = make_policy()
    join(p, "k1", user="alice", uid=1000, pid=123, label="train.ipynb", context_bytes=GB // 2)
    request(p, "k1", 10)
    (dev,) = p.snapshot(4.0)
    assert set(dev) == {
        "uuid",
        "name",
        "total_bytes",
        "pool_bytes",
        "resident_bytes",
        "mode",
        "quantum_ms",
        "holders",
        "queue",
        "clients",
    }
    (k1,) = dev["clients"]
    assert k1 == {
        "id": "k1",
        "pid": 123,
        "uid": 1000,
        "user": "alice",
        "label": "train.ipynb",
        "state": "running",
        "idle": False,
        "notebook": False,
        "used_bytes": 10 * GB,
        "managed_bytes": int(9.5 * GB),
        "pinned_bytes": GB // 2,
        "evicted_bytes": 0,
        "precopied_bytes": 0,
        "host_bytes": 0,
        "staging_bytes": 0,
        "staging_allowed_bytes": None,
        "quota_bytes": 0,
        "weight": 1.0,
        "gpu_seconds": 4.0,
        "wait_seconds": 0.0,
        "waiting_since": None,
        "queue_position": None,
        "last_restore": None,
        "held_seconds": 4.0,
        "quantum_seconds": 5.0,
        "revoking_seconds": None,
    }


def test_a_late_answer_to_a_revoke_does_not_drop_a_new_request():
    p = make_policy()
    join(p, "a")
    join(p, "b", user="bob")
    request(p, "a", 60)
    request(p, "b", 60, now=1)
    assert p.handle(Tick(30)) == [
        Revoke("a", evict=True, reason="quantum expired", evict_bytes=part(20))
    ]
    # a released on its own before the Revoke reached it (counted as the answer) ...
    assert p.handle(Released(30, "a")) == [Evict("a", reason="room for b", bytes=part(20))]
    # meanwhile b waits for a's memory, and is told how much is on its way to the host
    wait = client(p, "b", 30.5)["wait"]
    assert wait["reason"] == "memory"
    assert wait["moving_bytes"] == part(20)  # what b misses, not all of a
    assert p.handle(Evicted(31, "a")) == [Grant("b")]
    assert request(p, "a", 60, now=32) == []
    # ... and its answer to the Revoke comes now, while it waits: it keeps waiting
    assert p.handle(Released(33, "a", evicted=True)) == []
    assert client(p, "a", 33)["state"] == "waiting"
    assert p.handle(Leave(34, "b")) == [Grant("a", restore=True)]


def test_a_request_from_a_holder_only_updates_its_footprint():
    p = make_policy()
    join(p, "a")
    assert request(p, "a", 10) == [Grant("a")]
    assert request(p, "a", 20, now=1) == []
    assert client(p, "a", 1)["used_bytes"] == 20 * GB
    assert client(p, "a", 1)["state"] == "running"


def test_a_join_under_a_known_id_replaces_the_old_connection():
    p = make_policy()
    join(p, "a")
    join(p, "b", user="bob")
    request(p, "a", 70)
    request(p, "b", 70, now=1)
    # a's shim reconnected: its old grant is gone, so b runs
    assert p.handle(Join(2, "a", DEV, "alice")) == [Grant("b")]
    assert client(p, "a", 2)["state"] == "idle"


def test_accounting_of_gpu_and_wait_time():
    p = make_policy()
    join(p, "a")
    join(p, "b", user="bob")
    request(p, "a", 60)
    request(p, "b", 60, now=2)
    p.handle(Leave(10, "a"))
    b = client(p, "b", 15)
    assert b["wait_seconds"] == pytest.approx(8.0)
    assert b["gpu_seconds"] == pytest.approx(5.0)
    assert b["waiting_since"] is None
