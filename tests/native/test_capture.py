"""Issue 12, fault 2: a release never breaks a stream capture in progress.

On an H100, cuCtxSynchronize or cuStreamQuery from another thread while a stream captures in
global mode answer 900 and the capture's end 901; the stand-in driver does the same. Two processes
that capture graphs in a loop take turns on a pool that holds one of them, with short quanta and
eviction: no capture may fail, and the shim must never make a call that would fail one."""

from __future__ import annotations

import re

from tests.native.probe import spawn_probe


def test_revokes_in_the_middle_of_captures_fail_none(harness, shim_probe):
    harness.scheduler(pool="1GiB", quantum=0.3)
    procs = [
        spawn_probe(
            harness, shim_probe, "capture", 5, 60, 600 << 20, context_bytes="16MiB", idle_seconds=0
        )
        for _ in range(2)
    ]
    runs = [p.finish(90).ok() for p in procs]
    revokes = [line for r in runs for line in r.shim_lines if "revoked (" in line]
    waited = [line for r in runs for line in r.shim_lines if "waits for a stream capture" in line]
    assert len(revokes) >= 4, "too few turns to prove anything:\n" + runs[0].describe()
    assert waited, "no revoke fell into a capture: the test proves nothing"
    # A capture's own launches pass the closed gate (they do not run on the GPU): the deferred
    # release goes on as soon as the 60 ms capture ends, never after the 10 s bound.
    went_on = [
        float(m.group(1))
        for r in runs
        for line in r.shim_lines
        if (m := re.search(r"went on after the capture ended \(([\d.]+) ms\)", line))
    ]
    assert went_on and max(went_on) < 1000, went_on
    for run in runs:
        caps = run.event("captures")
        assert caps["ok"] > 0 and caps["failed"] == 0 and caps["launch_failed"] == 0, caps
        stats = run.stats["captures"]
        assert stats["invalidated"] == 0 and stats["unsafe_calls"] == 0, stats
        # Every eviction the scheduler asked for succeeded (none reported evicted=0).
        assert not [line for line in run.shim_lines if "eviction failed" in line], run.describe()
