"""The benchmark commands as docs/performance.md and bench/README document them end in words,
never a traceback: a results directory that is not there, and Ctrl-C of a long simulation, which
shows its progress on stderr as it goes and leaves no half-written result behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_report_of_a_missing_directory_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    out = subprocess.run(
        [sys.executable, "-m", "bench.report", str(missing)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr, out.stderr
    assert f"no such results directory: {missing}" in out.stderr, out.stderr


def test_nbmix_shows_progress_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    out_dir = tmp_path / "OUT"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.nbmix", str(out_dir), "--users", "8,16", "--seeds", "20"],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # said before the first point: the run is under way
        from bench.nbmix import VARIANTS  # a point per users count and variant

        assert first.startswith(f"nbmix: {2 * len(VARIANTS)} points of 20 seed(s)"), first
        time.sleep(1.0)  # inside the simulation
        os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 130, (stdout, stderr)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "nbmix: stopped by Ctrl-C; no result written", stderr
    assert not (out_dir / "nbmix.json").exists()
