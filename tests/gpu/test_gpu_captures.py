"""Issue 12 on a real GPU: revokes never break a CUDA graph capture, and a release drains every
context of a process.

Seen on an H100 before the fix: two processes capturing graphs in a loop (0.5 GiB each, a
1.6 GiB pool, 1 s quanta) both died within 7 s with "operation failed due to a previous error
during capture", after two releases reported evicted=0 and the scheduler granted the other
anyway."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from conftest import Result, require, run_workload, running_scheduler, shimmed_env, start_workload

GIB = 1 << 30
# Each process counts 0.5 GiB of data and the 600 MiB context estimate (1.1 GiB), and reported up
# to 1.22 GiB with the allocator's extras (H100, 2026-11-24). Both resident (2.2-2.44 GiB) do not
# fit a 2.0 GiB pool, so they take turns; one resident and one evicted (at most 1.92 GiB) do. At
# 1.6 GiB the two contexts alone made the resident peak 1.68 GiB, over any pool that small; at
# 2.2 GiB the two fitted by their first reports and co-ran (1 revoke in 30 s).
POOL = "2.0GiB"


def test_captures_survive_forced_revokes_and_the_pool_is_never_exceeded(tmp_path: Path) -> None:
    require("torch")
    # 0.5 GiB of data and the context estimate each: two never fit the pool together.
    env = {"GPUSHARE_CONTEXT_BYTES": "600MiB", "GPUSHARE_IDLE_SECONDS": "0"}
    # Without NVML readings: this test holds the policy's grants to the pool (and captures to
    # their revokes). With them, an evicted torch process's context as NVML sees it (0.69-1.2 GiB
    # against the 600 MiB estimate) raised the counted residency 15-64 MiB over the pool after a
    # grant (H100 and H200, 2026-11-27); that cross-check is test_gpu_nvml_claims.py's.
    no_nvml = ("--SchedulerConfig.utilization_interval=0",)
    with running_scheduler(tmp_path, pool=POOL, quantum=0.5, args=no_nvml) as sched:
        procs = [
            start_workload("torch_capture.py", "30", "0.5", env=shimmed_env(sched.socket, env))
            for _ in range(2)
        ]
        peak, pool, at_peak = 0, 0, None
        while any(p.poll() is None for p in procs):
            try:
                st = sched.status()
            except subprocess.CalledProcessError:
                break
            for d in st["devices"]:
                pool = d["pool_bytes"]
                if d["resident_bytes"] > peak:
                    peak, at_peak = d["resident_bytes"], d
            time.sleep(0.05)
        results = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            results.append((Result(0, out, err).record, err))
        log = sched.log_text()
    for rec, err in results:
        assert rec["errors"] == 0, rec["messages"]
        assert rec["wrong"] == 0 and rec["big_ok"], rec
        assert rec["rounds"] > 50, rec
        assert "eviction failed" not in err, err
    revokes = log.count("revoke client=")
    assert revokes >= 10, f"only {revokes} revokes: the test proves little\n{log}"
    # On failure: who the policy counted on the GPU at the peak (the scheduler's log is kept by
    # tests/gpu/campaign.sh for a file that failed).
    keys = ("id", "state", "used_bytes", "pinned_bytes", "evicted_bytes", "precopied_bytes")
    who = [{k: c.get(k) for k in keys} for c in (at_peak or {}).get("clients", [])]
    assert 0 < peak <= pool, f"peak {peak} > pool {pool}; at the peak: {json.dumps(who)}"
    print(
        f"rounds {[r['rounds'] for r, _ in results]}, 0 capture errors, {revokes} revokes, "
        f"resident peak {peak / GIB:.2f} GiB of a {pool / GIB:.2f} GiB pool"
    )


def test_a_release_drains_both_contexts_on_one_gpu(scheduler) -> None:
    r = run_workload("two_contexts.py", "1.0", env=shimmed_env(scheduler.socket))
    assert r.returncode == 0, r.stderr
    rec = r.record
    assert rec["release_rc"] == 0, rec
    # The release waited for context B's 1 s kernel (the first version synchronised only the
    # first context it saw and returned at once).
    assert rec["release_seconds"] >= 0.9 * rec["kernel_seconds"], rec
    print(f"release took {rec['release_seconds']:.3f}s for a {rec['kernel_seconds']}s kernel")
