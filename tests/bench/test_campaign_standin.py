"""Every benchmark harness end to end against the stand-in driver (no GPU), and the reporter.

The real shim and a real scheduler run; the workers use ctypes on the stand-in libcuda.so.1
instead of PyTorch (GPUSHARE_BENCH_BACKEND=standin). Tiny sizes: this checks the harnesses'
plumbing and records, not performance (no timing is asserted).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report
from bench.trace import TIME_SCALE

ROOT = Path(__file__).resolve().parents[2]
# The replay's working sets (3 users: 5, 8 and 3 GiB) x this. The stand-in's device memory is host
# memory, and the shim stages a copy of each block in host memory too: at full size the users grow
# towards twice 16 GiB of the host (seen: 6 GiB each and climbing on a 23 GiB host), and a user
# the OOM killer ends is what the record's {'u01': ''} was (u01 the largest). Scaled: 320, 512
# and 192 MiB, with their contexts 2.5 GiB, in a 2 GiB pool (the least the replay allows: 1.5 GiB
# beside the largest working set).
MEMORY_SCALE = 1 / 16


@pytest.fixture(scope="module")
def campaign(native_build, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("campaign")
    cmd = [
        sys.executable, "-m", "bench.run_campaign", str(out),
        "--driver-dir", str(native_build.fake_dir),
        "--only", "launch,handoff,kernel_start,replay",
        "--launch-rounds", "6", "--launch-pairs", "2",
        "--handoffs", "6", "--handoff-sizes", "1", "--arrival-gib", "0.5", "--arrival-idle", "2",
        "--arrival-keep-free", "0.5GiB",
        "--kernel-pairs", "1",
        "--users", "3", "--horizon", "3", "--think", "0.8", "--gpu-median", "0.05",
        "--grace", "2", "--pool-gib", "2", "--memory-scale", str(MEMORY_SCALE),
    ]  # fmt: skip
    # A hang guard, not a timing bound: on a quiet 2-core machine this takes about a minute, under
    # a load of 8 it passed 240 s. In its own session so that a timeout also stops the scheduler
    # and the workers the campaign started (a timeout used to leave its scheduler running).
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the campaign did not finish in 900 s:\n{output}")
    assert proc.returncode == 0, output
    return out


def load(out: Path, name: str) -> dict:
    rec = json.loads((out / f"{name}.json").read_text())
    assert rec["benchmark"] == name
    assert rec["driver"] == "stand-in"
    for key in ("device", "driver", "cuda", "torch", "date", "command", "git_commit"):
        assert key in rec["meta"], key
    assert "bench.run_campaign" in rec["meta"]["command"]
    return rec


def test_launch_record(campaign):
    rec = load(campaign, "launch_overhead")
    for api in ("kernel", "kernelex"):
        r = rec["results"][api]
        # The in-process A/B: one paired difference per round, both sides really launched.
        assert len(r["paired_diff_ns"]) == 6
        assert len(r["plain_ns"]) == len(r["shim_ns"]) == 6
        assert all(x > 0 for x in r["plain_ns"] + r["shim_ns"])
        # Measured with the device held under the scheduler (the gate's fast path).
        assert r["device_granted"], r["shim_log"]
        lo, hi = r["added_ns_ci95"]
        assert lo <= r["added_ns_median"] <= hi
        # The older process pairs, when asked for.
        assert len(rec["process_pairs"][api]["paired_diff_ns"]) == 2


def test_handoff_and_memory_records(campaign):
    ho = load(campaign, "handoff")
    assert len(ho["no_memory"]["latency_s"]) == 6
    assert all(x > 0 for x in ho["no_memory"]["latency_s"])
    assert [r["bytes"] for r in ho["with_memory"]] == [1 << 30]
    mem = load(campaign, "memory")
    assert mem["pinned_memcpy"]["h2d"] is None  # the stand-in has no memcpy to compare with
    assert mem["met"] is False
    # A kernel arriving at two pre-copied idle kernels, keep_free 0: granted after an eviction
    # of one of them in its wait, which was an unmap (the pre-copy had moved the bytes already).
    arrival = mem["precopied_arrival"]
    assert arrival is not None, mem["errors"]
    assert arrival["keep_free"] == "0" and arrival["idle_kernels"] == 2
    assert arrival["grant_wait_ms"] > 0 and arrival["cell_ms"] > 0
    # the idle kernels' memory was pre-copied: making room is an unmap, no byte copied (the
    # shim's bytes_moved counts what an eviction copies)
    assert arrival["evictions"], json.dumps(arrival)
    assert all(m["bytes"] == 0 for m in arrival["evictions"]), json.dumps(arrival)
    assert arrival["room_evictions"] == [] and not arrival["room_kept"]
    # keep_free 0.5 GiB: the scheduler evicted one of them (the first whose copy was complete)
    # before the arrival asked, so nothing was evicted in its wait.
    kept = mem["precopied_arrival_kept"]
    assert kept is not None, mem["errors"]
    assert kept["keep_free"] == "0.5GiB" and kept["room_kept"], kept
    assert len(kept["room_evictions"]) == 1, kept  # one of them, by an unmap
    assert [m["bytes"] for m in kept["room_evictions"]] == [0], kept
    assert kept["evictions"] == [] and kept["free_before_bytes"] >= 1 << 29


def test_kernel_start_record(campaign):
    rec = load(campaign, "kernel_start")
    assert len(rec["plain_s"]) == len(rec["gpushare_s"]) == len(rec["shim_magic_s"]) == 1
    # Each part is what the report says it is: the magic over the shim alone, the provisioner
    # over the shim and magic (with one pair, each median is that pair's difference).
    shim, magic, full = rec["shim_only_s"][0], rec["shim_magic_s"][0], rec["gpushare_s"][0]
    assert rec["magic_added_ms_median"] == pytest.approx((magic - shim) * 1000), rec
    assert rec["provisioner_added_ms_median"] == pytest.approx((full - magic) * 1000), rec


def test_replay_record(campaign):
    rec = load(campaign, "replay")
    assert set(rec["runs"]) == {"gpushare", "colocate", "fixed-quantum", "dedicated"}
    assert set(rec["simulated"]) == {*rec["runs"], "equal-share", "las", "srpt"}
    # The simulated cells are the real ones: same trace, same count of cells arriving.
    assert (
        rec["agreement"]["gpushare"]["p95"]["real"]
        == rec["runs"]["gpushare"]["summary"]["slowdown_p95"]
    )
    for mode, run in rec["runs"].items():
        s = run["summary"]
        assert s["cells"] == len(run["cells"]) > 0, mode
        assert s["completed"] + s["failed"] + s["unfinished"] == s["cells"]
        assert not run.get("worker_errors"), run.get("worker_errors")
    assert rec["runs"]["gpushare"]["summary"]["failed"] == 0
    # The replay's time scale, and real time (think and GPU both TIME_SCALE x longer).
    thinks = sorted({r["think_mean"] for r in rec["capacity"]})
    assert thinks == pytest.approx([0.8, 0.8 * TIME_SCALE])
    # The simulator's context is the shim's count of one (pinned, GPUSHARE_CONTEXT_BYTES,
    # 512 MiB by default), not a client's whole use with its working set.
    assert rec["sim_config"]["context_bytes"] == 512 << 20
    # Co-located users get the room for the real context beyond the shim's count of one; the
    # ballast leaves the pool free plus that allowance for each user.
    cal, colocate = rec["calibration"], rec["runs"]["colocate"]
    allowance = max(0, cal["context_bytes_real"] - rec["sim_config"]["context_bytes"])
    assert colocate["context_allowance_bytes"] == allowance, (cal, colocate)
    room = rec["pool_bytes"] + len(rec["trace"]["users"]) * allowance
    assert colocate["ballast_bytes"] == cal["free_fresh"] - room, (cal, colocate, room)
    # The stand-in's host memory stays small: working sets scaled, and they still take turns.
    sizes = [u["working_set"] for u in rec["trace"]["users"]]
    assert sum(sizes) <= 1 << 30 and rec["pool_bytes"] < sum(sizes) + 3 * (512 << 20), sizes
    assert "context_bytes_real" in rec["calibration"]
    assert 0 < rec["trace"]["duty_cycle"] < 1


def test_campaign_log_and_scheduler_logs(campaign):
    names = sorted(p.name for p in campaign.iterdir())
    assert len(names) <= 8  # what the device machine gives back
    assert "campaign.log" in names and "scheduler-logs.txt" in names
    assert "all parts done" in (campaign / "campaign.log").read_text()


def test_report_from_results(campaign, tmp_path):
    doc = tmp_path / "docs" / "performance.md"
    doc.parent.mkdir()
    report.main([str(campaign), "--doc", str(doc), "--images", str(tmp_path / "docs" / "images")])
    text = doc.read_text()
    assert "Stand-in driver" in text
    assert text.count("*No result yet.*") == 2  # training and the real-time replay did not run
    for png in ("launch", "handoff", "memory", "replay", "capacity", "kernel-start"):
        assert (tmp_path / "docs" / "images" / f"perf-{png}.png").stat().st_size > 1000
        assert f"](images/perf-{png}.png)" in text
    assert "| Kernel start |" in text


def test_report_without_results_states_methods_only(tmp_path):
    doc = tmp_path / "performance.md"
    (tmp_path / "none").mkdir()  # an empty results directory (a missing one is refused)
    report.main([str(tmp_path / "none"), "--doc", str(doc), "--images", str(tmp_path / "img")])
    text = doc.read_text()
    assert text.count("*No result yet.*") == 7
    assert "*No result yet* (`python3 -m bench.capacity OUT_DIR`)" in text
    assert "No campaign results yet" in text
    assert not (tmp_path / "img").exists()


def test_training_refuses_the_stand_in_clearly(native_build, tmp_path):
    cmd = [sys.executable, "-m", "bench.run_campaign", str(tmp_path), "--only", "train",
           "--driver-dir", str(native_build.fake_dir)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "train needs PyTorch on a GPU" in proc.stdout


def test_report_of_a_replay_cut_short(campaign, tmp_path):
    """A replay stopped by the device's time limit leaves its finished modes (checkpoint)."""
    rec = json.loads((campaign / "replay.json").read_text())
    assert "partial" not in rec  # the finished run replaced the checkpoints
    partial = {k: v for k, v in rec.items() if k not in ("simulated", "capacity", "met")}
    partial["partial"] = True
    partial["runs"] = {
        "gpushare": rec["runs"]["gpushare"],
        "colocate": {"mode": "colocate", "error": "RuntimeError: ballast exited"},
    }
    results = tmp_path / "results"
    results.mkdir()
    (results / "replay.json").write_text(json.dumps(partial))
    doc = tmp_path / "performance.md"
    report.main([str(results), "--doc", str(doc), "--images", str(tmp_path / "img")])
    text = doc.read_text()
    assert "Partial result" in text
    assert "(a) gpushare" in text and "(c) fixed-quantum lock" not in text
    assert "Mode colocate did not run to the end: RuntimeError: ballast exited" in text
