"""Property-based tests of the scheduling policy: random event sequences, invariants after each.

A model of the environment (the shims and the shell) sends the policy random but well-formed
event sequences (joins, requests of random sizes, memory growth, answers given at once or late,
unsolicited releases, idles, leaves, ticks) and checks every decision against what the clients
could legitimately receive. ``settle`` then makes the environment cooperative but greedy (every
answer prompt, every revoked client asks again at once, nobody releases by itself) and checks
that every waiter is granted within a bounded time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import HealthCheck, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from jupyter_gpushare.scheduler.core.events import (
    AdminRelease,
    Busy,
    Decision,
    Event,
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
from jupyter_gpushare.scheduler.core.policy import Policy, PolicyConfig

MB = 1 << 20
POOLS = {"GPU-A": 1000 * MB, "GPU-B": 400 * MB}
CONFIG = PolicyConfig(
    base_quantum=5.0,
    move_factor=4.0,
    max_quantum=60.0,
    evict_bandwidth=100 * MB,  # a full pool moves in 10 s: quanta between 5 and 48 s
    restore_bandwidth=500 * MB,
    usage_half_life=300.0,
    # The model's shims move all of a client's memory or none (``evicted`` is a flag): partial
    # eviction, whose asks they would not honour, has its own properties (test_policy_partial).
    partial_eviction=False,
)
MAX_CLIENTS = 7


def some(*states: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Enable a rule only while some client is in one of ``states`` (any, if none given)."""
    return precondition(
        lambda self: any(not states or s.state in states for s in self.shims.values())
    )


@dataclass
class Shim:
    """What one client's shim knows about itself."""

    device: str
    used: int = 0
    pinned: int = 0
    state: str = "idle"  # idle | waiting | running | revoking
    revoke_evict: bool = False
    evict_pending: bool = False
    evicted: bool = False  # its memory was moved to the host and not restored since

    @property
    def managed(self) -> int:
        return self.used - self.pinned


class PolicyMachine(RuleBasedStateMachine):
    config = CONFIG  # a subclass may run the same properties under another configuration

    def __init__(self) -> None:
        super().__init__()
        self.policy = Policy(self.config)
        for uuid, pool in POOLS.items():
            self.policy.add_device(uuid, name=uuid, total_bytes=pool * 2, pool_bytes=pool)
        self.now = 0.0
        self.shims: dict[str, Shim] = {}
        self.gone: set[str] = set()
        self.next_id = 0
        self.seen: dict[str, tuple[float, float]] = {}  # last gpu_seconds, wait_seconds
        self.granted_at: dict[str, float] = {}
        self.worst = 0.0  # the longest settled wait, as a fraction of its bound

    def teardown(self) -> None:
        target(self.worst, label="wait / bound")  # steer the search toward long waits

    # -- plumbing --------------------------------------------------------------------------

    def send(self, event: Event) -> None:
        for decision in self.policy.handle(event):
            self.apply(decision)

    def apply(self, d: Decision) -> None:
        """Carry out one decision, checking that the client could legitimately receive it."""
        shim = self.shims.get(d.client)
        assert shim is not None, f"{d} names a client that does not exist"  # invariant 5
        if isinstance(d, Grant):
            # invariant 1: a grant only answers a pending request, never a second grant
            assert shim.state == "waiting", f"{d} to a client in state {shim.state}"
            assert not shim.evict_pending, f"{d} while an eviction is in flight"
            assert d.restore == shim.evicted, f"{d} but evicted={shim.evicted}"
            shim.state = "running"
            shim.evicted = False
            self.granted_at[d.client] = self.now
        elif isinstance(d, Revoke):
            assert shim.state == "running", f"{d} to a client in state {shim.state}"
            shim.state = "revoking"
            shim.revoke_evict = d.evict
        else:
            assert isinstance(d, Evict), f"unknown decision {d!r}"
            assert shim.state in ("idle", "waiting"), f"{d} to a client in state {shim.state}"
            assert not shim.evict_pending, f"{d} twice"
            shim.evict_pending = True

    def pick(self, index: int, *states: str) -> str | None:
        ids = sorted(c for c, s in self.shims.items() if not states or s.state in states)
        return ids[index % len(ids)] if ids else None

    def moved_micros(self, nbytes: int, bandwidth: float, factor: float) -> int:
        return int(nbytes / bandwidth * factor * 1e6)

    # -- the environment's moves -----------------------------------------------------------

    @initialize(
        devices=st.lists(st.sampled_from(sorted(POOLS)), min_size=2, max_size=5),
        users=st.lists(st.sampled_from(["alice", "bob", "carol"]), min_size=5, max_size=5),
    )
    def start(self, devices: list[str], users: list[str]) -> None:
        for device, user in zip(devices, users, strict=False):
            self.join(device, user, 1.0, 20)

    @precondition(lambda self: len(self.shims) < MAX_CLIENTS)
    @rule(
        device=st.sampled_from(sorted(POOLS)),
        user=st.sampled_from(["alice", "bob", "carol"]),
        weight=st.sampled_from([0.5, 1.0, 2.0]),
        context=st.integers(0, 60),
    )
    def join(self, device: str, user: str, weight: float, context: int) -> None:
        self.next_id += 1
        cid = f"k{self.next_id}"
        self.shims[cid] = Shim(device, used=context * MB, pinned=context * MB)
        self.send(Join(self.now, cid, device, user, weight=weight, context_bytes=context * MB))

    @some("idle")
    @rule(
        index=st.integers(0, 99),
        size=st.one_of(st.floats(0.0, 1.0), st.floats(0.3, 0.7)),
        pinned=st.floats(0.0, 0.3),
    )
    def request(self, index: int, size: float, pinned: float) -> None:
        cid = self.pick(index, "idle")
        if cid is None:
            return
        shim = self.shims[cid]
        shim.used = max(shim.pinned, int(size * POOLS[shim.device]))
        shim.pinned = min(shim.used, max(shim.pinned, int(pinned * shim.used)))
        shim.state = "waiting"
        self.send_request(cid)

    def send_request(self, cid: str) -> None:
        s = self.shims[cid]
        evicted = s.managed if s.evicted else 0
        self.send(Request(self.now, cid, s.used, s.managed, s.pinned, evicted))

    @some()
    @rule(index=st.integers(0, 99), size=st.floats(0.0, 1.0))
    def memory(self, index: int, size: float) -> None:
        """Allocation or freeing; a running client may grow past what was admitted."""
        cid = self.pick(index)
        if cid is None:
            return
        s = self.shims[cid]
        s.used = max(s.pinned, int(size * POOLS[s.device]))
        evicted = s.managed if s.evicted else 0
        self.send(Memory(self.now, cid, s.used, s.managed, s.pinned, evicted))

    @some("revoking")
    @rule(index=st.integers(0, 99), factor=st.floats(0.5, 2.0))
    def answer_revoke(self, index: int, factor: float) -> None:
        cid = self.pick(index, "revoking")
        if cid is not None:
            self.release(cid, self.shims[cid].revoke_evict, factor)

    @some("running")
    @rule(index=st.integers(0, 99), evict=st.booleans())
    def release_unsolicited(self, index: int, evict: bool) -> None:
        cid = self.pick(index, "running")
        if cid is not None:
            self.release(cid, evict, 1.0)

    def release(self, cid: str, evict: bool, factor: float) -> None:
        s = self.shims[cid]
        s.state = "idle"
        moved = s.managed if evict else 0
        if evict:
            s.evicted = True
        micros = self.moved_micros(moved, CONFIG.evict_bandwidth, factor)
        self.send(Released(self.now, cid, evicted=evict, bytes_moved=moved, micros=micros))

    @precondition(lambda self: any(s.evict_pending for s in self.shims.values()))
    @rule(index=st.integers(0, 99), factor=st.floats(0.5, 2.0))
    def answer_evict(self, index: int, factor: float) -> None:
        ids = sorted(c for c, s in self.shims.items() if s.evict_pending)
        if ids:
            self.evicted(ids[index % len(ids)], factor)

    def evicted(self, cid: str, factor: float) -> None:
        s = self.shims[cid]
        s.evict_pending = False
        s.evicted = True
        micros = self.moved_micros(s.managed, CONFIG.evict_bandwidth, factor)
        self.send(Evicted(self.now, cid, bytes_moved=s.managed, micros=micros))

    @some("running")
    @rule(index=st.integers(0, 99), factor=st.floats(0.5, 2.0))
    def restored(self, index: int, factor: float) -> None:
        cid = self.pick(index, "running")
        if cid is not None:
            s = self.shims[cid]
            micros = self.moved_micros(s.managed, CONFIG.restore_bandwidth, factor)
            self.send(Restored(self.now, cid, bytes_moved=s.managed, micros=micros))

    @some()
    @rule(index=st.integers(0, 99), busy=st.booleans())
    def kernel_state(self, index: int, busy: bool) -> None:
        cid = self.pick(index)
        if cid is not None:
            self.send(Busy(self.now, cid) if busy else Idle(self.now, cid))

    @some()
    @rule(index=st.integers(0, 99))
    def leave(self, index: int) -> None:
        cid = self.pick(index)
        if cid is not None:
            del self.shims[cid]
            self.gone.add(cid)
            self.send(Leave(self.now, cid))

    @some()
    @rule(index=st.integers(0, 99), evict=st.booleans())
    def admin_release(self, index: int, evict: bool) -> None:
        cid = self.pick(index)
        if cid is not None:
            self.send(AdminRelease(self.now, cid, evict=evict))

    @some()
    @rule(index=st.integers(0, 99), quota=st.integers(0, 1000))
    def set_quota(self, index: int, quota: int) -> None:
        cid = self.pick(index)
        if cid is not None:
            self.send(SetQuota(self.now, cid, quota * MB))

    @rule(dt=st.floats(0.0, 40.0))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.send(Tick(self.now))

    @precondition(lambda self: self.policy.next_deadline() is not None)
    @rule()
    def tick_at_deadline(self) -> None:
        deadline = self.policy.next_deadline()
        if deadline is not None:
            self.now = deadline
            self.send(Tick(self.now))

    @precondition(lambda self: bool(self.gone))
    @rule()
    def ghost_events(self) -> None:
        """Events for clients that left (the shell races with disconnects) change nothing."""
        for cid in sorted(self.gone)[:2]:
            for evt in (Request(self.now, cid, used=MB), Released(self.now, cid), Idle(0, cid)):
                assert self.policy.handle(evt) == []

    @some("waiting")
    @rule()
    def settle(self) -> None:
        """Invariant 3: with a prompt, greedy environment every waiter is granted in time."""
        start = self.now
        waiting = {c for c, s in self.shims.items() if s.state == "waiting"}
        for cid in waiting:
            self.granted_at.pop(cid, None)
        for _ in range(10_000):
            if all(c in self.granted_at for c in waiting):
                break
            if self.answer_everything():
                continue
            deadline = self.policy.next_deadline()
            assert deadline is not None, "waiters, nothing in flight, and no deadline: stuck"
            assert deadline > self.now
            self.now = deadline
            self.send(Tick(self.now))
        else:
            raise AssertionError("no progress in 10000 steps")
        for cid in waiting:
            device = self.shims[cid].device
            clients = sum(1 for s in self.shims.values() if s.device == device)
            bound = (clients + 1) * CONFIG.max_quantum + CONFIG.base_quantum
            waited = self.granted_at[cid] - start
            self.worst = max(self.worst, waited / bound)
            assert waited <= bound, f"{cid} waited {waited:.1f} s > {bound} s"

    def answer_everything(self) -> bool:
        """Answer every outstanding Revoke and Evict at once; revoked clients ask again."""
        answered = False
        for cid in sorted(self.shims):
            s = self.shims[cid]
            if s.state == "revoking":
                self.release(cid, s.revoke_evict, 1.0)
                s.state = "waiting"
                self.send_request(cid)
                answered = True
            if s.evict_pending:
                self.evicted(cid, 1.0)
                answered = True
        return answered

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def running_clients_fit(self) -> None:
        """Invariant 2: more than one running client only while their footprints fit."""
        for device, pool in POOLS.items():
            running = [s for s in self.shims.values() if s.device == device]
            running = [s for s in running if s.state == "running"]
            if len(running) > 1:
                assert sum(s.used for s in running) <= pool

    @invariant()
    def snapshot_agrees_and_accounting_is_monotonic(self) -> None:
        """Invariant 4 (and the snapshot matches what the clients were told)."""
        clients = {c["id"]: c for dev in self.policy.snapshot(self.now) for c in dev["clients"]}
        assert set(clients) == set(self.shims)
        for cid, c in clients.items():
            shim = self.shims[cid]
            expected = {"idle": {"idle", "evicting"}, "waiting": {"waiting"}}
            assert c["state"] in expected.get(shim.state, {shim.state})
            gpu, wait = c["gpu_seconds"], c["wait_seconds"]
            last_gpu, last_wait = self.seen.get(cid, (0.0, 0.0))
            assert 0 <= last_gpu <= gpu + 1e-9
            assert 0 <= last_wait <= wait + 1e-9
            self.seen[cid] = (gpu, wait)
            assert (c["queue_position"] is None) == (shim.state != "waiting")
            assert self.policy.has_client(cid)
            assert self.policy.client_device(cid) == shim.device
        for cid in self.gone:
            assert not self.policy.has_client(cid)
            assert cid not in clients

    @invariant()
    def deadline_is_in_the_future(self) -> None:
        deadline = self.policy.next_deadline()
        assert deadline is None or deadline > self.now


PolicyMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPolicyProperties = PolicyMachine.TestCase
