"""The shortened nbmix trace of the GPU replay (issue 21 item 7), its memory forms, and the
simulator's warm start: the form's cells, duty and pressure, so that a drift fails here."""

from __future__ import annotations

import hashlib
import json
import random
import statistics
from dataclasses import asdict

import pytest

from bench import replay_nbmix
from bench.simulator import SimConfig, Simulation, summarize
from bench.trace import (
    NBMIX,
    NBMIX_REPLAY,
    REPLAY_CELL_CAP,
    GiB,
    TraceConfig,
    duty_cycle,
    generate,
    nbmix_cell,
    nbmix_think,
    solo_arrivals,
)
from jupyter_gpushare.scheduler.core import events as ev

HORIZON = replay_nbmix.HORIZON
#: The card's free memory beside one context: an H100 80GB HBM3 and an H200 (campaign logs).
H100_FREE = int(78.7 * GiB)
H200_FREE = int(139.0 * GiB)
OPERANDS = 3 * 8192 * 8192 * 2  # what a PyTorch replay worker holds beside its working set


def form_trace(seed: int = 1, scale: float = 0.5) -> TraceConfig:
    return replay_nbmix.trace_config(8, seed, HORIZON, scale)


def test_the_form_keeps_the_interactive_cells_and_the_mix_and_shortens_the_rest():
    assert NBMIX_REPLAY.interactive == NBMIX.interactive  # the cells the targets are about
    assert (NBMIX_REPLAY.interactive_p, NBMIX_REPLAY.medium_p, NBMIX_REPLAY.break_p) == (
        NBMIX.interactive_p,
        NBMIX.medium_p,
        NBMIX.break_p,
    )
    assert NBMIX_REPLAY.working_sets_gib == NBMIX.working_sets_gib
    rng = random.Random(3)
    cells = [nbmix_cell(rng, NBMIX_REPLAY) for _ in range(40_000)]
    thinks = [nbmix_think(rng, NBMIX_REPLAY) for _ in range(40_000)]
    # no cell dominates the window: at most 1/30 of it; training cells (3%) are all at the cap
    assert max(cells) <= REPLAY_CELL_CAP <= HORIZON / 30
    assert 0.02 <= sum(c == REPLAY_CELL_CAP for c in cells) / len(cells) <= 0.04
    assert 3.4 <= statistics.median(thinks) <= 4.6  # nbmix's 110 s median, 28x shorter
    # duty per user ~7.5% (nbmix: 4%): 8 users keep the GPU about 65% busy
    cfg = form_trace()
    assert 0.065 <= duty_cycle(cfg, 100_000) <= 0.085
    assert 0.035 <= duty_cycle(TraceConfig(shape="nbmix"), 100_000) <= 0.045


def test_8_users_send_at_least_200_cells_in_the_window():
    counts = [solo_arrivals(form_trace(seed)) for seed in range(1, 9)]
    assert counts[0] >= 240  # the default seed, with room for a slower real run
    assert min(counts) >= 210 and statistics.mean(counts) >= 230, counts
    # ... and so does the simulator, which slows them (warm start, H100 form, committed costs)
    tc = form_trace()
    cfg = SimConfig(pool_bytes=replay_nbmix.pool_for(0.5, 8), extra_bytes=OPERANDS)
    s = summarize(Simulation(generate(tc), "gpushare", HORIZON, cfg, warm=True).run(), HORIZON)
    assert s["cells"] >= 230 and s["unfinished"] == 0, s


def test_memory_scale_and_todays_traces_unchanged():
    half, full = generate(form_trace(scale=0.5)), generate(form_trace(scale=1.0))
    assert [u.working_set * 2 for u in half] == [u.working_set for u in full]
    assert [u.cells for u in half] == [u.cells for u in full]  # memory alone is scaled
    # today's traces are those of before the form existed (digests of their JSON)
    digests = {}
    for shape in ("uniform", "nbmix"):
        tc = TraceConfig(users=8, seed=1, horizon=3600, shape=shape)
        text = json.dumps([asdict(u) for u in generate(tc)], sort_keys=True)
        digests[shape] = hashlib.sha256(text.encode()).hexdigest()[:16]
    assert digests == {"uniform": "108c7607d5a329a2", "nbmix": "f604202d13e0edaf"}
    with pytest.raises(ValueError):
        TraceConfig(shape="nbmix-replay", memory_scale=0)


@pytest.mark.parametrize(
    ("free", "scale", "pool_gib"), [(H100_FREE, 0.5, 22.0), (H200_FREE, 1.0, 40.0)]
)
def test_the_card_picks_the_form_and_the_users_fit_it_at_nbmix_pressure(free, scale, pool_gib):
    form = replay_nbmix.choose_form(free, 8, 1, HORIZON)
    assert form["memory_scale"] == scale
    assert form["pool_bytes"] == pytest.approx(pool_gib * GiB, rel=0.01)
    # never oversubscribed: every user's memory with its allowance fits the card's free memory
    assert form["demand_bytes"] + replay_nbmix.HEADROOM <= free
    assert form["pool_bytes"] < free
    # the users hold about twice the pool's room for data, as nbmix's 8 users hold a 40 GiB pool
    assert 1.8 <= form["pressure"] <= 2.8
    nbmix_users = generate(TraceConfig(users=8, seed=1, horizon=HORIZON, shape="nbmix"))
    nbmix_pressure = sum(u.working_set for u in nbmix_users) / (40 * GiB - 8 * (GiB // 2))
    assert form["pressure"] == pytest.approx(nbmix_pressure, rel=0.01)


def test_a_card_too_small_is_refused_and_a_given_form_is_kept():
    with pytest.raises(SystemExit, match="no form fits"):
        replay_nbmix.choose_form(40 * GiB, 8, 1, HORIZON)
    tiny = replay_nbmix.choose_form(H100_FREE, 8, 1, HORIZON, memory_scale=0.004)
    assert tiny["memory_scale"] == 0.004 and tiny["pressure"] == pytest.approx(2.53, abs=0.05)
    assert replay_nbmix.choose_form(H100_FREE, 8, 1, HORIZON, 0.5, 30.0)["pool_bytes"] == 30 * GiB


def test_the_simulators_warm_start_loads_each_user_once_in_order_and_settles():
    tc = form_trace()
    cfg = SimConfig(pool_bytes=replay_nbmix.pool_for(0.5, 8), extra_bytes=OPERANDS)
    sim = Simulation(generate(tc), "gpushare", HORIZON, cfg, warm=True)
    sim.log = []
    cells = sim.run()
    before = [(e, d) for e, d in sim.log if e.now < sim.t0]
    busy = [e.client for e, _ in before if isinstance(e, ev.Busy)]
    assert busy == sorted(sim.users)  # one loading cell each, in the trace's order
    assert sim.t0 > 0 and min(c["arrival"] for c in cells) > 0  # the trace's clock
    # the clock starts with a full pool, pre-copied: what an idle pool holds in steady state
    room = cfg.pool_bytes - 8 * cfg.context_bytes
    resident = sum(p["resident"] for p in sim.warm_pool.values())
    assert room - 2 * OPERANDS <= resident <= room
    assert any(p["evicted"] for p in sim.warm_pool.values())
    # the first cell of a user whose memory left restores it; from a cold start none does
    gone = max(sim.warm_pool, key=lambda n: sim.warm_pool[n]["evicted"])
    first = next(c for c in cells if c["user"] == gone and c["cell"] == 0)
    restore = sim.warm_pool[gone]["evicted"] / cfg.restore_bw
    assert first["end"] - first["arrival"] >= first["solo"] + restore
    assert restored_by_first_cell(sim, gone)
    cold = Simulation(generate(tc), "gpushare", HORIZON, cfg)
    cold.log = []
    cold.run()
    assert not restored_by_first_cell(cold, gone)


def restored_by_first_cell(sim: Simulation, user: str) -> bool:
    """Whether ``user``'s memory was restored between the clock's start and its first idle."""
    for e, _ in sim.log or []:
        if e.now < sim.t0 or getattr(e, "client", None) != user:
            continue
        if isinstance(e, ev.Restored):
            return True
        if isinstance(e, ev.Idle):
            return False
    raise AssertionError(f"{user} ran no cell")


def test_the_host_must_hold_the_evicted_memory_too():
    """Evicted memory lives in host staging: a form whose users do not fit the host's available
    memory (a device machine has 128 GiB) is not played."""
    roomy = replay_nbmix.choose_form(H200_FREE, 8, 1, HORIZON, host=124 * GiB)
    assert roomy["memory_scale"] == 1.0 and roomy["host_need_bytes"] <= 124 * GiB
    tight = replay_nbmix.choose_form(H200_FREE, 8, 1, HORIZON, host=100 * GiB)
    assert tight["memory_scale"] == 0.5 and tight["host_need_bytes"] <= 100 * GiB
    with pytest.raises(SystemExit, match="host"):
        replay_nbmix.choose_form(H200_FREE, 8, 1, HORIZON, host=40 * GiB)
