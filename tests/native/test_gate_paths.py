"""Issue 12, faults 1 and 6: nothing slips past the gate.

Every launch path and stream memory operation passes the gate in the variant the program asked
for, and a release waits for the calls that passed the gate before it closed (a thread that read
"open" and was descheduled must not launch after the synchronisation)."""

from __future__ import annotations

from tests.native.probe import run_probe, spawn_probe, trace

NEW_PATHS = {
    "cuLaunch",
    "cuLaunchGrid",
    "cuLaunchGridAsync",
    "cuLaunchCooperativeKernelMultiDevice",
    *(
        f"{base}{suffix}"
        for base in (
            "cuStreamBatchMemOp",
            "cuStreamWriteValue32",
            "cuStreamWriteValue64",
            "cuStreamWaitValue32",
            "cuStreamWaitValue64",
        )
        for suffix in ("", "_ptsz", "_v2", "_v2_ptsz")
    ),
}


def test_every_launch_path_and_stream_operation_is_gated(harness, shim_probe):
    run = run_probe(harness, shim_probe, "launchpaths").ok()
    paths = {e["name"]: e for e in run.all("path")}
    assert set(paths) == NEW_PATHS, run.describe()
    for name, e in paths.items():
        assert e["rc"] == 0, e
        assert e["gated_delta"] == 1, f"{name} did not go through the gate: {e}"
        # The exact symbol reached the driver: a _ptsz call stayed per-thread, a _v2 stayed _v2.
        assert e["driver_delta"] == 1, f"{name} reached the driver as another variant: {e}"


def test_a_release_waits_for_calls_inside_the_driver(harness, shim_probe, tmp_path):
    """The stand-in keeps each launch 150 ms inside the driver before its work is queued. Two
    processes take turns (short quanta): every synchronisation the shim's thread makes for a
    release must find no launch of its process still inside the driver."""
    # Small memory and several launches: turns are taken even when a loaded machine copies
    # slowly (600 MiB each took 6.4 s to evict, and one process ended before the other's turn).
    harness.scheduler(pool="256MiB", quantum=0.3)
    traces = [tmp_path / "a.trace", tmp_path / "b.trace"]
    procs = [
        spawn_probe(
            harness,
            shim_probe,
            "launches",
            8,
            20000,
            150 << 20,  # two do not fit in the pool: they take turns
            context_bytes="16MiB",
            extra={"GPUSHARE_FAKE_TRACE": str(t), "GPUSHARE_FAKE_LAUNCH_DELAY_US": "150000"},
            idle_seconds=0,
        )
        for t in traces
    ]
    runs = [p.finish(60).ok() for p in procs]
    releases = [line for r in runs for line in r.shim_lines if "revoked (" in line]
    assert len(releases) >= 2, "no turns were taken: the test proves nothing\n" + "\n".join(
        r.describe() for r in runs
    )
    syncs = [s for t in traces for s in trace(t) if s.get("op") == "ctx_sync"]
    shim_syncs = [s for s in syncs if s.get("thread") == "gpushare"]
    assert shim_syncs, syncs
    assert all(s["calls_in_driver"] == 0 for s in shim_syncs), shim_syncs
