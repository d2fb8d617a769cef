"""GPUSHARE_VERIFY_MOVES, the diagnostic that checks every eviction and restore against the memory
it copied (native/src/memory/verify.c), on the stand-in driver with a live scheduler.

The stand-in's GPUSHARE_FAKE_LOSE_H2D_HEAD=N makes the process's first large host-to-device copy
leave its first N bytes zero: the restore a woken kernel got on an H100 (its held tensor's first
4.4 MiB read as zeros; tests/gpu/test_gpu_deep_idle.py). Unverified, the program reads the zeros;
verified, the shim says which step went wrong, where and with what, and mends the block.
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


def _cycle(harness, verify: bool):
    """A writes its SIZE block, goes idle and is pre-copied; B's arrival evicts it (an unmap),
    and A's check of its data after B's turn restores it: that restore is A's first large
    host-to-device copy, which loses LOST bytes, and nothing writes the block after it."""
    sched = harness.scheduler(pool="400MiB", quantum=1.0)
    extra = {"GPUSHARE_FAKE_LOSE_H2D_HEAD": str(LOST)}
    if verify:
        extra["GPUSHARE_VERIFY_MOVES"] = "1"
    common = {"context_bytes": 64 * MiB, "idle_seconds": 0.3, "log": "info"}
    a = harness.spawn("precopy_cycle", SIZE, 0.3, 0.3, 4.0, extra=extra, client_id="A", **common)
    quiet = a.wait_event("idle2_start", 30)["launches"]
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


def test_unverified_a_restore_that_lost_its_start_reaches_the_program(harness):
    """The stand-in's fault bites: without the check, A reads the zeros (the test below would
    pass vacuously otherwise)."""
    ra = _cycle(harness, verify=False)
    assert ra.event("cycle_end")["data_ok"] is False, ra.stderr
    assert not [line for line in ra.shim_lines if "verify" in line], ra.stderr


def test_verified_the_lost_start_is_said_exactly_and_mended(harness):
    ra = _cycle(harness, verify=True)
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


@pytest.mark.parametrize("value", ["2", "yes"])
def test_a_bad_value_is_said_and_ignored(harness, value):
    run = harness.run("status", 0, client_id="A", extra={"GPUSHARE_VERIFY_MOVES": value})
    assert f"ignoring GPUSHARE_VERIFY_MOVES={value}: expected 0 to 1" in run.stderr, run.stderr
