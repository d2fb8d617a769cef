"""The simulator's real-time campaign (bench/capacity.py) and its report sections."""

from __future__ import annotations

import math

import pytest

from bench import capacity, report
from bench.simulator import SimConfig
from bench.trace import duty_cycle


def test_confidence_interval_is_students_t_on_the_seeds():
    ci = capacity.mean_ci([1.0, 2.0, 3.0])
    assert ci["mean"] == 2.0 and ci["n"] == 3
    assert ci["ci"] == pytest.approx(4.30 * 1.0 / math.sqrt(3))
    assert capacity.mean_ci([float("nan"), 5.0]) == {"mean": 5.0, "ci": 0, "n": 1}


@pytest.mark.parametrize("duty", capacity.DUTY_CYCLES)
def test_think_time_is_scaled_to_the_duty_cycle_and_cells_are_not(duty):
    tf = capacity.think_factor_for(duty)
    tc = capacity.real_time_trace(1, 1, 100.0, tf)
    assert duty_cycle(tc, 20_000) == pytest.approx(duty, rel=0.02)
    base = capacity.real_time_trace(1, 1, 100.0)
    assert (tc.gpu_median, tc.gpu_max) == (base.gpu_median, base.gpu_max)


def test_capacity_is_the_last_count_before_a_limit_first_fails(monkeypatch):
    monkeypatch.setattr(capacity, "USER_GRID", (1, 2, 4, 8, 16, 32))
    cfg = SimConfig()
    c = capacity.capacity("equal-share", 2, 1200.0, 200.0, cfg, capacity.think_factor_for(0.15))
    curve = {p["users"]: p for p in c["curve"]}
    for key, metric, limit in capacity.LIMITS:
        n = c["capacity"][key]
        assert all(curve[m][metric] <= limit for m in curve if m <= n), key
        after = [m for m in capacity.USER_GRID if m > n]
        if after and after[0] in curve:
            assert curve[after[0]][metric] > limit, key
    assert c["capacity"]["p95_2x"] >= c["capacity"]["p95_1.3x"]
    # The search stops once no limit holds: at 15% duty, 32 users are far past every one.
    assert max(curve) < 32


def test_campaign_record_and_its_report_sections(tmp_path, monkeypatch):
    monkeypatch.setattr(capacity, "USER_GRID", (1, 2, 4))
    monkeypatch.setattr(capacity, "DUTY_CYCLES", (0.04,))
    rec = capacity.campaign(seeds=3, capacity_seeds=2, horizon=900.0, warmup=100.0, log=print)
    modes = [r["mode"] for r in rec["table"] if not r.get("variant")]
    assert modes == [*capacity.TABLE_MODES, "dedicated"]
    ded = next(r for r in rec["table"] if r["mode"] == "dedicated")
    assert ded["slowdown_p95"]["mean"] == pytest.approx(1.0)
    srpt = next(r for r in rec["table"] if r["mode"] == "srpt")
    eq = next(r for r in rec["table"] if r["mode"] == "equal-share")
    assert srpt["added_p50"]["mean"] <= eq["added_p50"]["mean"] + 1e-9
    assert {c["mode"] for c in rec["capacity"]} == set(capacity.CAPACITY_MODES)
    by_mode = {r["mode"]: r for r in rec["table"] if not r.get("variant")}
    assert by_mode["gpushare"]["pauses_per_cell"] > 0  # the ordering paused someone ...
    assert by_mode["gpushare-fair"]["pauses_per_cell"] == 0  # ... which "fair" never does
    results = tmp_path / "results"
    results.mkdir()
    (results / "simulated.json").write_text(__import__("json").dumps(rec))
    doc = tmp_path / "performance.md"
    report.main([str(results), "--doc", str(doc), "--images", str(tmp_path / "img")])
    text = doc.read_text()
    assert "## 6. Interactive-first ordering" in text
    assert "| 4% | gpushare (interactive, the default) |" in text
    assert "| Ordering at real time (simulator) | p95 slowdown ≤ 1.9x" in text  # in the summary
    assert (tmp_path / "img" / "perf-ordering.png").stat().st_size > 1000
