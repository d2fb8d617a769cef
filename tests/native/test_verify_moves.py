"""Checked copies (native/src/memory/verify.c), on the stand-in driver with a live scheduler:
the sampled check every copy into host staging gets, and GPUSHARE_VERIFY_MOVES, the diagnostic
that checks every eviction and restore in full.

The stand-in's GPUSHARE_FAKE_LOSE_D2H_HEAD=N makes the process's first large device-to-host copy
leave its first N bytes zero: the pre-copy a kernel got on an H100 (its staging's first 4.6-162 MB
zero, so that after deep idle it read its held tensor's start as zeros;
tests/gpu/test_gpu_deep_idle.py). GPUSHARE_FAKE_LOSE_H2D_HEAD=N does the same to the first large
host-to-device copy (a restore), which only the full check sees.
"""

from __future__ import annotations

import re

import pytest

MiB = 1 << 20
SIZE = 256 * MiB
LOST = 1 * MiB
# cudart_like's pattern is byte i = (31 i + seed) mod 256: one zero in every 256 bytes, which a
# lost (zeroed) head leaves as it was.
LOST_DIFFERING = LOST - LOST // 256
DIFF = re.compile(
    r"verify (?P<step>[^:]+): block of [\d.]+ MiB at 0x[0-9a-f]+ differs from its host copy: "
    r"(?P<count>\d+) bytes in \[(?P<first>\d+), (?P<last>\d+)\], (?P<zeros>\d+) of them zero"
)


def _cycle(harness, tmp_path, extra: dict[str, str]):
    """A writes its SIZE block, goes idle (idle2) and is pre-copied; B's arrival evicts it (an
    unmap), and A's check of its data after B's turn restores it, with nothing written to the
    block in between. The stand-in's fault is armed once A is idle: the pre-copy that follows is
    the first large device-to-host copy it hits (an earlier one, made stale by A's calls on a
    loaded machine, took it first once), the restore the first host-to-device one."""
    sched = harness.scheduler(pool="400MiB", quantum=1.0)
    armed = tmp_path / "armed"
    extra = {**extra, "GPUSHARE_FAKE_FAULTS_ARMED": str(armed)}
    # An idle detected 1 s after A's last call: the test arms the fault well before the pre-copy.
    common = {"context_bytes": 64 * MiB, "idle_seconds": 1.0, "log": "info"}
    a = harness.spawn("precopy_cycle", SIZE, 0.0, 0.3, 6.0, extra=extra, client_id="A", **common)
    quiet = a.wait_event("idle2_start", 30)["launches"]
    armed.touch()
    a.wait_event(
        "tick",
        30,
        where=lambda e: e["launches"] == quiet and e["status"]["precopied_bytes"] >= SIZE,
    )
    b = harness.spawn("hold", 1.0, SIZE, 20000, client_id="B", **common)
    b.finish(60).ok()
    ra = a.finish(60)
    restored = [int(n) for n in re.findall(r"restored client=A bytes=(\d+)", sched.log)]
    assert restored[-1:] == [SIZE], f"A's check did not restore it from the host: {restored}"
    return ra


COPIED_AGAIN = "a copy of 256.00 MiB to host staging came back wrong (checked against the device: "


def test_a_precopy_that_lost_its_start_is_copied_again(harness, tmp_path):
    ra = _cycle(harness, tmp_path, {"GPUSHARE_FAKE_LOSE_D2H_HEAD": str(LOST)})
    ra.ok()
    assert ra.event("cycle_end")["data_ok"] is True, ra.stderr
    said = [line for line in ra.shim_lines if "came back wrong" in line]
    # The first window sampled is the block's start: where the lost bytes are.
    assert said == ["gpushare: " + COPIED_AGAIN + "from byte 0): copied again, now right"], (
        ra.stderr
    )


def test_unchecked_a_precopy_that_lost_its_start_reaches_the_program(harness, tmp_path):
    """The stand-in's fault bites: with the check off, A reads the zeros after its restore (the
    test above would pass vacuously otherwise)."""
    extra = {"GPUSHARE_FAKE_LOSE_D2H_HEAD": str(LOST), "GPUSHARE_CHECK_COPIES": "0"}
    ra = _cycle(harness, tmp_path, extra)
    assert ra.event("cycle_end")["data_ok"] is False, ra.stderr
    assert not [line for line in ra.shim_lines if "came back wrong" in line], ra.stderr


def test_unverified_a_restore_that_lost_its_start_reaches_the_program(harness, tmp_path):
    """The stand-in's fault bites: without the check, A reads the zeros (the test below would
    pass vacuously otherwise)."""
    ra = _cycle(harness, tmp_path, {"GPUSHARE_FAKE_LOSE_H2D_HEAD": str(LOST)})
    assert ra.event("cycle_end")["data_ok"] is False, ra.stderr
    assert not [line for line in ra.shim_lines if "verify" in line], ra.stderr


def test_verified_the_lost_start_is_said_exactly_and_mended(harness, tmp_path):
    ra = _cycle(
        harness, tmp_path, {"GPUSHARE_FAKE_LOSE_H2D_HEAD": str(LOST), "GPUSHARE_VERIFY_MOVES": "1"}
    )
    ra.ok()
    assert ra.event("cycle_end")["data_ok"] is True, ra.stderr
    said = [m.groupdict() for m in map(DIFF.search, ra.shim_lines) if m]
    # Right after the copy back and 20 ms later: both see the same lost head; nothing else.
    assert [d["step"] for d in said] == [
        "restore (device vs its copy, after the copy back)",
        "restore (device vs its copy, 20 ms later)",
    ], ra.stderr
    for d in said:
        assert int(d["count"]) == LOST_DIFFERING, d
        assert int(d["zeros"]) == LOST_DIFFERING, d
        assert int(d["first"]) <= 1 and LOST - 2 <= int(d["last"]) < LOST, d
    assert any("is right after copying back again" in line for line in ra.shim_lines), ra.stderr
    # The copy out and the host copy while evicted were right, and the check says nothing of them.
    assert not [line for line in ra.shim_lines if "verify eviction" in line], ra.stderr
    assert not [line for line in ra.shim_lines if "changed while" in line], ra.stderr


@pytest.mark.parametrize("name", ["GPUSHARE_VERIFY_MOVES", "GPUSHARE_CHECK_COPIES"])
@pytest.mark.parametrize("value", ["2", "yes"])
def test_a_bad_value_is_said_and_ignored(harness, name, value):
    run = harness.run("status", 0, client_id="A", extra={name: value})
    assert f"ignoring {name}={value}: expected 0 to 1" in run.stderr, run.stderr


def test_an_eviction_that_lost_its_start_is_copied_again(harness, tmp_path):
    """As the pre-copy above, for an eviction's own copy: no pre-copy (the scheduler's
    precopy_idle off), so B's arrival copies A's block out, the first large device-to-host copy
    once the fault is armed, and it loses its start. The eviction checks its copy before the
    unmap as a pre-copy does; unchecked, A read zeros after its restore (the mutation check's
    "unmap-before-copy-check" passed every test before this one)."""
    sched = harness.scheduler(
        pool="400MiB", quantum=1.0, args=("--GPUShareScheduler.precopy_idle=False",)
    )
    armed = tmp_path / "armed"
    extra = {"GPUSHARE_FAKE_LOSE_D2H_HEAD": str(LOST), "GPUSHARE_FAKE_FAULTS_ARMED": str(armed)}
    common = {"context_bytes": 64 * MiB, "idle_seconds": 1.0, "log": "info"}
    a = harness.spawn("precopy_cycle", SIZE, 0.0, 0.3, 6.0, extra=extra, client_id="A", **common)
    quiet = a.wait_event("idle2_start", 30)["launches"]
    # Its staging made (registered), so that the eviction copies into it, not through bounces.
    a.wait_event(
        "tick",
        30,
        where=lambda e: e["launches"] == quiet and e["status"]["staging_pinned_bytes"] >= SIZE,
    )
    armed.touch()
    b = harness.spawn("hold", 1.0, SIZE, 20000, client_id="B", **common)
    b.finish(60).ok()
    ra = a.finish(60).ok()
    assert re.search(r"evicted client=A bytes=268435456 ", sched.log), sched.log
    assert ra.event("cycle_end")["data_ok"] is True, ra.stderr
    said = [line for line in ra.shim_lines if "came back wrong" in line]
    assert said == ["gpushare: " + COPIED_AGAIN + "from byte 0): copied again, now right"], (
        ra.stderr
    )
