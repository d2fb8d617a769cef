"""Pause or co-run by cost (issue 35, item 4; core/ordering.py pause_pays): when a short cell fits
beside a long one, the long one is paused only where that costs less than their running side by
side, with the contention and the pause's cost the configuration gives."""

from __future__ import annotations

import pytest
from test_ordering import GB, joined, start_cell

from jupyter_gpushare.scheduler.core import costs
from jupyter_gpushare.scheduler.core.events import Grant, Released, Request, Revoke, Tick
from jupyter_gpushare.scheduler.core.ordering import (
    PAUSE_COST_S,
    OrderingConfig,
    break_even,
    pause_pays,
)
from jupyter_gpushare.scheduler.core.policy import REASON_ORDER

#: The GPU's contention and pause cost (bench/nbmix.py MEASURED_CONTENTION, MEASURED_PAUSE_S).
GPU = OrderingConfig(corun_slowdown=2.5, corun_long_rate=1.0, pause_cost_s=0.35)


def test_the_break_even_of_a_pause():
    ts = OrderingConfig()  # time-slicing: a pause pays for any cell longer than its own cost
    assert pytest.approx(costs.DRAIN_S + 2 * costs.HANDOFF_S) == PAUSE_COST_S
    assert not pause_pays(ts, 0.9 * PAUSE_COST_S) and pause_pays(ts, 1.1 * PAUSE_COST_S)
    # the GPU's: co-running costs the short cell 1.5 x its time, a pause the trainer its time
    # and 0.35 s: the break-even is 0.7 s
    assert not pause_pays(GPU, 0.69) and pause_pays(GPU, 0.71)
    assert break_even(GPU) == pytest.approx(0.7) and break_even(ts) == pytest.approx(PAUSE_COST_S)
    with pytest.raises(ValueError):
        OrderingConfig(corun_slowdown=0.5)
    with pytest.raises(ValueError):
        OrderingConfig(corun_long_rate=1.5)


def _short_cell_beside_a_long_one(cfg: OrderingConfig, typical_s: float) -> list:
    p = joined("long", "short", ordering=cfg)
    assert start_cell(p, "long", 0.0) == [Grant("long")]
    p._clients["short"].turn_s = typical_s  # its cells took this long (the policy's EWMA)
    p.handle(Tick(30.0))
    return start_cell(p, "short", 30.0)


def test_time_slicing_pauses_the_long_cell_for_a_short_one():
    assert _short_cell_beside_a_long_one(OrderingConfig(), 0.2) == [
        Grant("short"),
        Revoke("long", evict=False, reason=REASON_ORDER),
    ]


def test_under_the_gpus_contention_a_short_cell_co_runs_and_a_longer_one_pauses():
    assert _short_cell_beside_a_long_one(GPU, 0.2) == [Grant("short")]  # side by side
    assert _short_cell_beside_a_long_one(GPU, 0.9) == [
        Grant("short"),
        Revoke("long", evict=False, reason=REASON_ORDER),
    ]


def test_a_paused_long_cell_resumes_once_what_runs_beside_it_is_short_enough():
    """The long cell waits paused behind a cell expected to run 0.9 s; once that one has 0.7 s
    or less to go (the break-even), co-running pays and the long cell goes through beside it."""
    p = joined("long", "mid", ordering=GPU)
    start_cell(p, "long", 0.0)
    p._clients["mid"].turn_s = 0.9
    p.handle(Tick(30.0))
    assert Revoke("long", evict=False, reason=REASON_ORDER) in start_cell(p, "mid", 30.0)
    p.handle(Released(30.01, "long"))
    assert p.handle(Request(30.01, "long", used=10 * GB, managed=9 * GB, pinned=GB // 2)) == []
    assert p.handle(Tick(30.1)) == []  # 0.8 s to go: still paused
    # the policy asks for a tick at the break-even (0.7 s to go)
    assert p.next_deadline() == pytest.approx(30.2)
    assert p.handle(Tick(30.2)) == [Grant("long")]  # side by side
