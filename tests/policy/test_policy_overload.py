"""No thrashing (issue 35, item 5; core/overload.py): under overload at most ``overload_long_cap``
long cells hold memory; another takes a long holder's place after ``overload_window``."""

from __future__ import annotations

from jupyter_gpushare.scheduler.core.events import Busy, Grant, Join, Request, Revoke, Tick
from jupyter_gpushare.scheduler.core.ordering import OrderingConfig
from jupyter_gpushare.scheduler.core.policy import Policy, PolicyConfig
from jupyter_gpushare.scheduler.core.policy_fixed import REASON_QUANTUM

GB = 10**9
DEV = "GPU-0"


def _policy(cap: int) -> Policy:
    p = Policy(PolicyConfig(ordering=OrderingConfig(), overload_long_cap=cap, overload_window=120))
    p.add_device(DEV, total_bytes=105 * GB, pool_bytes=100 * GB)
    for c in ("a", "b", "c", "s"):
        p.handle(Join(0.0, c, DEV, f"user-{c}"))
    return p


def _cell(p: Policy, cid: str, now: float, gb: float, service: float = 10.0) -> list:
    """A cell of ``gb`` GB that has run ``service`` GPU-seconds already (a long one: level 2)."""
    p.handle(Busy(now, cid))
    p._clients[cid].cell.service = service
    used = int(gb * GB)
    return p.handle(Request(now, cid, used=used, managed=used - GB // 2, pinned=GB // 2))


def _three_long_cells(cap: int) -> tuple[Policy, list]:
    p = _policy(cap)
    assert _cell(p, "a", 0.0, 40) == [Grant("a")]
    _cell(p, "c", 1.0, 70)  # does not fit beside a: waits for a's turn
    return p, _cell(p, "b", 2.0, 40)  # fits the free room; 150 GB want a 100 GB pool


def test_without_the_cap_a_second_long_cell_runs_beside_the_first():
    _, out = _three_long_cells(cap=0)
    assert Grant("b") in out


def test_under_overload_one_long_cell_holds_memory_and_the_next_takes_its_place_later():
    p, out = _three_long_cells(cap=1)
    assert out == []  # b fits the free room, but the cap holds it back: nothing moves
    assert 120.0 in list(p._deadlines(p._devices[DEV]))  # a's window ends then: a tick comes
    assert p.handle(Tick(60.0)) == []
    revokes = [d for d in p.handle(Tick(120.0)) if isinstance(d, Revoke)]
    (revoke,) = revokes
    assert revoke.client == "a" and revoke.evict
    assert revoke.reason == REASON_QUANTUM
    # the starvation window is the overload window while overloaded (the status says so)
    (dev,) = p.snapshot(120.0)
    assert p._order.window == 120.0 and dev


def test_short_cells_are_not_capped():
    p, _ = _three_long_cells(cap=1)
    assert Grant("s") in _cell(p, "s", 3.0, 10, service=0.0)
