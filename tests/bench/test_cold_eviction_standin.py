"""bench/cold_eviction.py end to end against the stand-in driver (no GPU): its record holds A's
eviction, the handoff, and B's own allocation alone, measured in the same run, so that the
handoff's part that is not the eviction can be told from it. Tiny sizes: plumbing and the
record's arithmetic, not bandwidth (no timing is asserted beyond its sign)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def test_the_record_has_the_eviction_the_handoff_and_b_alone(native_build, tmp_path) -> None:
    out = tmp_path / "cold_eviction.json"
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(native_build.fake_dir),
        "GPUSHARE_BENCH_BACKEND": "standin",
    }
    cmd = [
        sys.executable, "-m", "bench.cold_eviction", "--out", str(out), "--size", "256MiB",
        "--pool", "384MiB", "--delays", "0.2", "--repeats", "1", "--workdir", str(tmp_path / "w"),
        "--env", "GPUSHARE_CONTEXT_BYTES=32MiB",
    ]  # fmt: skip
    # A hang guard, not a timing bound: it takes a few seconds on a quiet machine.
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rec = json.loads(out.read_text())
    assert rec["benchmark"] == "cold_eviction" and rec["size"] == 256 * MiB
    (run,) = rec["runs"]
    assert run["delay_s"] == 0.2 and run["started_after_alloc_s"] >= 0.2
    # A's whole working set left for B (the pool holds one), as the shim reported it.
    assert run["evicted_bytes"] == 256 * MiB
    assert [m["client"] for m in run["moves"] if m["kind"] == "evict"] == ["A"]
    # B's allocation alone was measured after A and B left, with nothing to evict for it.
    assert run["own_alloc_s"] > 0
    (log,) = [p.read_text() for p in (tmp_path / "w").glob("scheduler-*.log")]
    solo = log.index("join client=solo ")
    assert solo > log.index("leave client=A ") and solo > log.index("leave client=B "), log
    assert "evicted client=" not in log[solo:], log
    assert "B's own allocation alone" in proc.stderr
