"""The nbmix replay's dry path: ``run_campaign --only nbmix-replay`` end to end on the stand-in
driver (no GPU), a tiny version of the GPU command (8 users, 20 s of the shortened trace,
working sets x0.004: 4-98 MiB against a pool whose room beside the contexts they fill about
2.5 times). The real shim and scheduler run; the workers use ctypes on the stand-in. It checks
the plumbing and the record (warm start, checkpoints, the simulator on the same cells), not
performance: no timing is asserted but a hang guard.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bench import report

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 600  # on a quiet 2-core machine a run takes about 30 s


def command(out: Path, driver_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "bench.run_campaign", str(out), "--driver-dir", str(driver_dir),
        "--only", "nbmix-replay", "--users", "8", "--nbmix-horizon", "20", "--nbmix-grace", "5",
        "--nbmix-memory-scale", "0.004", "--progress-s", "4",
    ]  # fmt: skip


def start(cmd: list[str]) -> subprocess.Popen[str]:
    # its own session: stopping it stops its scheduler and workers too
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def guard(proc: subprocess.Popen[str]) -> threading.Timer:
    timer = threading.Timer(HANG_GUARD_S, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    return timer


@pytest.fixture(scope="module")
def played(native_build, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("nbmix-replay")
    proc = start(command(out, native_build.fake_dir))
    timer = guard(proc)
    try:
        output, _ = proc.communicate()
    finally:
        timer.cancel()
    assert proc.returncode == 0, output
    return out


def test_the_record_of_a_warm_replay_beside_its_simulation(played):
    rec = json.loads((played / "nbmix_replay.json").read_text())
    assert rec["benchmark"] == "nbmix_replay" and rec["driver"] == "stand-in"
    assert "partial" not in rec and rec["warm_start"] is True
    assert rec["trace"]["config"]["shape"] == "nbmix-replay"
    form = rec["form"]
    assert form["memory_scale"] == 0.004 and 2.0 <= form["pressure"] <= 3.0
    assert rec["pool_bytes"] == form["pool_bytes"]
    run = rec["runs"]["gpushare"]
    assert not run.get("worker_errors"), run.get("worker_errors")
    assert run["warm_start"]["unsettled"] == []
    s = run["summary"]
    assert s["cells"] == len(run["cells"]) > 0 and s["failed"] == 0
    # the pool was warm and full when the clock started, really and in the simulator: some
    # users' memory had left it, the last one loaded was all on the GPU
    pool = rec["warm_pool"]["gpushare"]
    assert pool["evicted_real"] and pool["evicted_simulated"], pool
    last = max(pool["real"])
    assert last not in pool["evicted_real"] and last not in pool["evicted_simulated"], pool
    assert pool["real"][last]["resident"] >= users_bytes(rec, last)
    assert isinstance(pool["same"], bool)
    # both clocks start at the warm pool: each user's first cell arrives one think time later
    users = {u["name"]: u for u in rec["trace"]["users"]}
    for cells in (run["cells"], rec["simulated_cells"]["gpushare"]):
        firsts = [c for c in cells if c["cell"] == 0]
        assert firsts
        for c in firsts:
            assert c["arrival"] == pytest.approx(users[c["user"]]["cells"][0]["think"], abs=0.05)
    a = rec["agreement"]["gpushare"]
    assert a["p95"]["real"] == s["slowdown_p95"] and isinstance(a["within"], bool)
    assert rec["met"] is False  # 20 s of arrivals are far from the 200 cells asked
    assert rec["prediction"]["cells"] > 0


def users_bytes(rec: dict, name: str) -> int:
    return next(u["working_set"] for u in rec["trace"]["users"] if u["name"] == name)


def test_the_summary_and_the_progress_lines(played):
    text = (played / "nbmix_replay.txt").read_text()
    assert "warm start: True" in text and "agreement: simulated vs real" in text
    assert "warm pool: evicted really" in text
    assert re.search(r"real: \d+ cells", text) and "met: no" in text
    log = (played / "campaign.log").read_text()
    assert "warm start: 8 users loaded one at a time" in log
    assert re.search(r"replay gpushare: \d+ s, \d+ cells done", log)
    assert "nbmix-replay: predicted (simulator, committed costs)" in log


def test_a_run_cut_short_leaves_its_cells(native_build, tmp_path):
    """Stopped (as the device's time limit stops it) once a progress line counted a cell, the
    run leaves a partial record with the cells so far and the prediction."""
    proc = start(command(tmp_path, native_build.fake_dir))
    timer = guard(proc)
    seen = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            m = re.search(r"replay gpushare: \d+ s, (\d+) cells done", line)
            if m and int(m.group(1)) > 0:
                os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait()
    finally:
        timer.cancel()
    assert proc.returncode == -signal.SIGKILL, "".join(seen)
    rec = json.loads((tmp_path / "nbmix_replay.json").read_text())
    assert rec["partial"] is True and rec["driver"] == "stand-in"
    run = rec["runs"]["gpushare"]
    assert run["in_progress"] and run["cells"], run
    assert rec["prediction"]["cells"] > 0 and rec["form"]["memory_scale"] == 0.004
    assert "in progress" in (tmp_path / "nbmix_replay.txt").read_text()


def test_the_report_shows_the_replay_and_its_summary_row(played, tmp_path):
    doc = tmp_path / "performance.md"
    report.main([str(played), "--doc", str(doc), "--images", str(tmp_path / "img")])
    text = doc.read_text()
    section = text[text.index("### 8a. The notebook-shaped trace on the GPU") :]
    assert "| real (GPU) |" in section and "| simulated, this run's costs |" in section
    assert "Warm pool at the start" in section and "Stand-in driver" in section
    assert "| nbmix, 8 users, real-time GPU replay | within 15% of the simulator" in text
    empty = tmp_path / "empty.md"
    (tmp_path / "none").mkdir()  # a results directory with no results (a missing one is refused)
    report.main([str(tmp_path / "none"), "--doc", str(empty), "--images", str(tmp_path / "i")])
    assert "### 8a." in empty.read_text() and "*Not measured yet.*" in empty.read_text()
