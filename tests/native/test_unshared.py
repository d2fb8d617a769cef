"""Without a scheduler the shim runs the program unshared (one warning, nothing blocks), and with
GPUSHARE_DISABLE=1 it passes everything through untouched."""

from __future__ import annotations

MiB = 1 << 20


def test_no_scheduler_one_warning_and_the_program_completes(harness):
    run = harness.run("hold", 1.0, 16 * MiB, 10000, log="warn").ok()
    assert len(run.shim_lines) == 1, f"expected exactly one warning:\n{run.stderr}"
    assert str(harness.socket_path) in run.shim_lines[0] or "scheduler" in run.shim_lines[0]
    end = run.event("hold_end")
    assert end["data_ok"]
    assert end["launches"] >= 50, "the launches must not have waited for anything"
    assert end["status"]["state"] == "unshared"
    assert end["status"]["connected"] == 0
    assert end["status"]["waits"] == 0
    first = run.event("first_launch")
    assert first["waited"] < 0.5


def test_quiet_means_quiet(harness):
    run = harness.run("saxpy", 1000, log="quiet").ok()
    assert run.shim_lines == [], run.stderr


def test_disable_passes_everything_through(harness):
    run = harness.run("saxpy", 4096, disable="1", log="info").ok()
    assert run.event("saxpy")["ok"]
    # Device memory stays device memory: nothing was turned into managed memory.
    assert run.calls("cuMemAlloc_v2") == 2
    assert run.calls("cuMemAllocManaged") == 0
    assert run.shim_lines == [], run.stderr


def test_disable_enforces_no_quota(harness):
    run = harness.run("alloc", "alloc", 64 * MiB, disable="1", memory_limit="1MiB").ok()
    assert run.event("alloc")["rc"] == 0
    assert not [line for line in run.shim_lines if "out of memory" in line]
