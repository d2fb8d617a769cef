"""The property-based policy tests again, with keep_free on and shims that report complete
pre-copies: every invariant of tests/policy/test_policy_properties.py still holds (grants only
to waiters, running clients fit, every waiter granted within its bound), and every eviction for
room goes to a client whose cell ended and whose memory was reported fully copied since, on a
device where nobody waits."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st
from hypothesis.stateful import rule
from test_policy_properties import CONFIG, POOLS, PolicyMachine, some

from jupyter_gpushare.scheduler.core.events import Busy, Decision, Evict, Idle, Memory, Revoke
from jupyter_gpushare.scheduler.core.policy import Policy
from jupyter_gpushare.scheduler.core.room import REASON_ROOM, KeepFree

MB = 1 << 20


class KeepFreeMachine(PolicyMachine):
    def __init__(self) -> None:
        super().__init__()
        self.policy = Policy(dataclasses.replace(CONFIG, keep_free=KeepFree(600 * MB)))
        for uuid, pool in POOLS.items():
            self.policy.add_device(uuid, name=uuid, total_bytes=pool * 2, pool_bytes=pool)
        self.cell_ended: set[str] = set()  # Idle sent since its last Busy or Request
        self.copied: set[str] = set()  # a complete copy reported since, still valid
        self.room_evictions = 0

    def apply(self, d: Decision) -> None:
        if isinstance(d, Revoke | Evict) and d.reason == REASON_ROOM:
            self.room_evictions += 1
            shim = self.shims[d.client]
            assert d.client in self.cell_ended, f"{d} to a client whose cell runs"
            assert d.client in self.copied, f"{d} to a client without a complete copy"
            assert not shim.evicted, f"{d} to a client whose memory is on the host"
            waiting = [s for s in self.shims.values() if s.device == shim.device]
            assert all(s.state != "waiting" for s in waiting), f"{d} while a client waits"
            assert not isinstance(d, Revoke) or d.evict, f"{d} keeps the memory"
        super().apply(d)

    def send_request(self, cid: str) -> None:
        self.cell_ended.discard(cid)  # it asks for the GPU: a cell runs
        self.copied.discard(cid)
        super().send_request(cid)

    def release(self, cid: str, evict: bool, factor: float) -> None:
        if evict:
            self.copied.discard(cid)
        super().release(cid, evict, factor)

    def evicted(self, cid: str, factor: float) -> None:
        self.copied.discard(cid)
        super().evicted(cid, factor)

    @some()
    @rule(index=st.integers(0, 99), busy=st.booleans())
    def kernel_state(self, index: int, busy: bool) -> None:
        cid = self.pick(index)
        if cid is None:
            return
        if busy:
            self.cell_ended.discard(cid)
            self.copied.discard(cid)
        else:
            self.cell_ended.add(cid)
        self.send(Busy(self.now, cid) if busy else Idle(self.now, cid))

    @some()
    @rule(index=st.integers(0, 99), size=st.floats(0.0, 1.0))
    def memory(self, index: int, size: float) -> None:
        cid = self.pick(index)
        if cid is not None:
            self.copied.discard(cid)  # MEMORY without precopied: no valid copy
        super().memory(index, size)

    @some("idle", "running")
    @rule(index=st.integers(0, 99), cell_ends=st.booleans())
    def precopy_done(self, index: int, cell_ends: bool) -> None:
        """The shim reports its resident memory fully copied to the host (MEMORY), maybe right
        after its cell ended (IDLE): what a notebook that stops using the GPU does."""
        cid = self.pick(index, "idle", "running")
        if cid is None:
            return
        s = self.shims[cid]
        if s.evicted:
            return  # nothing resident to copy
        if cell_ends:
            self.cell_ended.add(cid)
            self.send(Idle(self.now, cid))
        self.copied.add(cid)
        self.send(Memory(self.now, cid, s.used, s.managed, s.pinned, 0, precopied=s.managed))


KeepFreeMachine.TestCase.settings = PolicyMachine.TestCase.settings
TestKeepFreeProperties = KeepFreeMachine.TestCase
