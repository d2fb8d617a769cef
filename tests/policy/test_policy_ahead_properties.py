"""The policy's properties (test_policy_properties.py) with restore ahead on (core/ahead.py).

Every invariant of the base machine still holds, and restore ahead adds its own: a RestoreAhead
goes only to a client that does not hold the device, has memory on the host and no move in
flight; it is never decided in a pass that moves memory out, and the pool holds everything the
policy counts on the GPU once it is decided (a restore ahead never makes room for itself).
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from test_policy_properties import CONFIG, PolicyMachine

from jupyter_gpushare.scheduler.core.events import (
    Coming,
    Decision,
    Event,
    Evict,
    Grant,
    RestoreAhead,
    Restored,
    Revoke,
)

AHEAD = replace(CONFIG, restore_ahead=True)


class AheadMachine(PolicyMachine):
    config = AHEAD

    def __init__(self) -> None:
        super().__init__()
        self.ahead: set[str] = set()
        self.aheads = 0

    def send(self, event: Event) -> None:
        decisions = self.policy.handle(event)
        if any(isinstance(d, RestoreAhead) for d in decisions):
            self.aheads += 1
            assert not any(isinstance(d, Revoke | Evict) for d in decisions), decisions
            for d in decisions:
                if isinstance(d, RestoreAhead):
                    dev = self.policy._devices[self.shims[d.client].device]
                    assert dev.resident_bytes <= dev.pool_bytes, "a restore ahead past the pool"
        for decision in decisions:
            self.apply(decision)

    def apply(self, d: Decision) -> None:
        if isinstance(d, RestoreAhead):
            shim = self.shims[d.client]
            assert shim.state in ("idle", "waiting"), f"{d} to a client in state {shim.state}"
            assert shim.evicted and not shim.evict_pending and d.client not in self.ahead, d
            assert 0 < d.bytes <= shim.managed
            self.ahead.add(d.client)
            return
        if isinstance(d, Evict):
            assert d.client not in self.ahead, f"{d} while its restore ahead is in flight"
        if isinstance(d, Grant) and d.client in self.ahead:
            # The shim answers the restore ahead before it takes the grant (one thread, in
            # order), and the grant restores whatever is left: that answer says nothing new.
            self.ahead.discard(d.client)
            self.send(Restored(self.now, d.client, 0, 1, ahead=True, evicted_bytes=0))
        super().apply(d)

    @precondition(lambda self: bool(self.shims))
    @rule(index=st.integers(0, 99))
    def coming(self, index: int) -> None:
        cid = self.pick(index)
        if cid is not None:
            self.send(Coming(self.now, cid))

    @precondition(lambda self: bool(self.ahead))
    @rule(index=st.integers(0, 99), short=st.booleans())
    def answer_ahead(self, index: int, short: bool) -> None:
        ids = sorted(c for c in self.ahead if c in self.shims)
        self.ahead &= set(ids)
        if ids:
            self.restored_ahead(ids[index % len(ids)], short)

    def restored_ahead(self, cid: str, short: bool) -> None:
        """The shim's answer: everything back, or (``short``: the device had no room) nothing."""
        self.ahead.discard(cid)
        s = self.shims[cid]
        left = s.managed if short and s.evicted else 0
        if not left:
            s.evicted = False
        moved = 0 if left else s.managed
        self.send(Restored(self.now, cid, moved, 1000, ahead=True, evicted_bytes=left))

    def leave(self, index: int) -> None:
        super().leave(index)
        self.ahead &= set(self.shims)

    def answer_everything(self) -> bool:
        answered = super().answer_everything()
        for cid in sorted(self.ahead & set(self.shims)):
            self.restored_ahead(cid, False)
            answered = True
        return answered


AheadMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAheadProperties = AheadMachine.TestCase
