"""EVICTED says whether the eviction succeeded (flag), and the translator passes it on: a failed
eviction must never count as memory gone from the GPU (issue 12, fault 2)."""

from __future__ import annotations

from jupyter_gpushare.protocol import Message, MsgType
from jupyter_gpushare.scheduler.core.events import Evicted
from jupyter_gpushare.scheduler.shell.translate import shim_event


def evicted(**fields: int) -> Evicted:
    event = shim_event(Message(MsgType.EVICTED, fields), "c", 1.0, {})
    assert isinstance(event, Evicted)
    return event


def test_an_evicted_message_says_whether_the_eviction_succeeded() -> None:
    assert evicted(bytes_moved=5 << 20, micros=10, flag=1).ok
    assert not evicted(bytes_moved=0, micros=10, flag=0).ok
    assert evicted(bytes_moved=5 << 20, micros=10).ok  # a shim from before the flag
