"""The trace generator and the simulator: determinism, sanity, and the policy's contract."""

from __future__ import annotations

import dataclasses

import pytest

from bench.simulator import MODES, SimConfig, Simulation, capacity_sweep, simulate, summarize
from bench.trace import (
    TIME_SCALE,
    GiB,
    TraceConfig,
    duty_cycle,
    generate,
    scaled,
    solo_arrivals,
    to_json,
)
from jupyter_gpushare.scheduler.core import events as ev

SMALL = TraceConfig(users=4, seed=7, horizon=60.0, think_mean=6.0, gpu_median=0.4)


def test_same_seed_same_trace_other_seed_other_trace():
    assert to_json(SMALL, generate(SMALL)) == to_json(SMALL, generate(SMALL))
    other = dataclasses.replace(SMALL, seed=8)
    assert to_json(other, generate(other))["users"] != to_json(SMALL, generate(SMALL))["users"]


def test_trace_is_sane():
    cfg = TraceConfig()
    users = generate(cfg)
    assert len(users) == cfg.users == 8
    assert sorted(u.working_set for u in users) == sorted(
        int(g * GiB) for g in cfg.working_sets_gib
    )
    for u in users:
        assert sum(c["think"] for c in u.cells) > cfg.horizon  # covers the horizon
        assert all(c["think"] >= cfg.think_min for c in u.cells)
        assert all(cfg.gpu_min <= c["gpu"] <= cfg.gpu_max for c in u.cells)


@pytest.mark.parametrize("bad", [{"users": 0}, {"horizon": 0}, {"working_sets_gib": ()}])
def test_bad_trace_configuration_is_refused(bad):
    with pytest.raises(ValueError):
        TraceConfig(**bad)


class CheckedSimulation(Simulation):
    """Checks every decision against what the simulated shim could legitimately receive."""

    def _decide(self, d: ev.Decision) -> None:
        u = self.users[d.client]
        if isinstance(d, ev.Grant):
            assert not u.holding, f"{d}: granted twice"
            assert u.in_cell, f"{d}: granted to a user with no cell running"
        elif isinstance(d, ev.Revoke):
            assert u.holding, f"{d}: revoked a user that does not hold the device"
        super()._decide(d)


@pytest.mark.parametrize("mode", MODES)
def test_every_cell_is_accounted_for_and_the_policy_contract_holds(mode):
    cfg = SimConfig(pool_bytes=12 * GiB)
    users = generate(dataclasses.replace(SMALL, working_sets_gib=(3, 4, 5, 6)))
    cells = CheckedSimulation(users, mode, SMALL.horizon, cfg).run()
    # Every cell that arrived is in the result once: completed, failed or cut unfinished.
    keys = [(c["user"], c["cell"]) for c in cells]
    assert len(keys) == len(set(keys))
    for u in users:
        mine = sorted(c["cell"] for c in cells if c["user"] == u.name)
        assert mine == list(range(len(mine)))
    for c in cells:
        if c["end"] is not None:
            assert c["end"] >= c["arrival"] + (c["solo"] - 1e-9 if c["ok"] else 0)
    s = summarize(cells, SMALL.horizon)
    assert s["completed"] + s["failed"] + s["unfinished"] == s["cells"] == len(cells)
    if mode == "dedicated":
        assert s["slowdown_p95"] == pytest.approx(1.0)
    if mode != "colocate":
        assert s["failed"] == 0  # under the shim memory waits, it never fails


def test_colocation_fails_only_what_does_not_fit():
    users_ok = simulate(SMALL, "colocate", SimConfig(pool_bytes=60 * GiB))["summary"]
    assert users_ok["failed"] == 0
    tight = simulate(SMALL, "colocate", SimConfig(pool_bytes=8 * GiB))["summary"]
    assert tight["failed"] > 0


def test_a_single_user_is_never_slowed_by_sharing():
    one = dataclasses.replace(SMALL, users=1)
    for mode in ("gpushare", "fixed-quantum"):
        s = simulate(one, mode, SimConfig(handoff_s=0.0))["summary"]
        assert s["slowdown_p95"] == pytest.approx(1.0, abs=1e-6), mode


def test_the_lock_waits_for_its_timer_and_gpushare_does_not():
    cfg = SimConfig(pool_bytes=60 * GiB)  # no memory pressure: the policies alone differ
    g = simulate(SMALL, "gpushare", cfg)["summary"]
    f = simulate(SMALL, "fixed-quantum", cfg)["summary"]
    assert f["slowdown_p95"] > 10 * g["slowdown_p95"]  # cells wait seconds for the timer
    assert f["completed"] < g["completed"]  # ... so fewer cells get done in the same time


def test_simulation_is_deterministic_and_capacity_sweep_is_shaped():
    a = simulate(SMALL, "gpushare")["cells"]
    b = simulate(SMALL, "gpushare")["cells"]
    assert a == b
    rows = capacity_sweep(SMALL, [1, 4], ("gpushare", "dedicated"), SimConfig(), seeds=2)
    assert [(r["users"], r["mode"]) for r in rows] == [
        (1, "gpushare"),
        (1, "dedicated"),
        (4, "gpushare"),
        (4, "dedicated"),
    ]
    assert all(r["cells"] > 0 for r in rows)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown mode"):
        Simulation([], "round-robin", 10.0, SimConfig())


def test_default_trace_has_a_notebook_duty_cycle_and_enough_cells():
    """The stated assumptions: ~4% GPU per user (8 users ~30% of a GPU), and enough cells in
    one replay horizon for a stable p95 (>= 150 at solo speed)."""
    cfg = TraceConfig()
    assert 0.03 <= duty_cycle(cfg, 50_000) <= 0.05
    assert solo_arrivals(cfg) >= 150
    # Memory pressure, not absurd: the working sets exceed the replay's 40 GiB pool, by little.
    assert 40 < sum(cfg.working_sets_gib) <= 60


def test_scaling_keeps_the_duty_cycle_and_scales_every_time():
    cfg = TraceConfig()
    real = scaled(cfg, TIME_SCALE)
    assert real.think_mean == pytest.approx(cfg.think_mean * TIME_SCALE)
    assert real.gpu_median == pytest.approx(cfg.gpu_median * TIME_SCALE)
    assert real.horizon == pytest.approx(cfg.horizon * TIME_SCALE)
    assert duty_cycle(real, 50_000) == pytest.approx(duty_cycle(cfg, 50_000), rel=1e-6)
    a, b = generate(cfg), generate(real)
    assert [u.working_set for u in a] == [u.working_set for u in b]  # memory is not scaled
    assert scaled(cfg, 2.0, horizon=7.0).horizon == 7.0
