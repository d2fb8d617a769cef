"""Issue 12, fault 7: the idle detector never calls a busy process idle.

A holder whose last kernel still runs is not idle, whichever stream the kernel went to: its
per-thread default stream (which the shim's thread cannot name), or one of more streams than the
detector's table has slots. The measure: when the scheduler revokes the holder as idle, the
release finds no work left to wait for."""

from __future__ import annotations

import re

import pytest

from tests.native.probe import spawn_probe

KERNEL_US = 600_000


def idle_release_ms(lines: list[str]) -> list[float]:
    return [
        float(m.group(1))
        for line in lines
        if (m := re.search(r"revoked \(idle\): released after ([\d.]+) ms", line))
    ]


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("ptds", KERNEL_US, 2.0), id="per_thread_default_stream"),
        pytest.param(("streams", 100, KERNEL_US, 2.0), id="more_streams_than_slots_collide"),
    ],
)
def test_a_busy_holder_is_not_revoked_as_idle(harness, shim_probe, args):
    harness.scheduler(pool="1GiB", quantum=30)
    # 600 MiB contexts: the pool holds one process at a time.
    holder = spawn_probe(harness, shim_probe, *args, idle_seconds=0.15, context_bytes="600MiB")
    launched = holder.wait_event("launched")
    waiter = spawn_probe(harness, shim_probe, "once", idle_seconds=0.15, context_bytes="600MiB")
    ran = waiter.wait_event("ran", timeout=30)
    run = holder.finish(60).ok()
    waiter.finish(30).ok()
    released = idle_release_ms(run.shim_lines)
    assert released, "the holder was never revoked as idle:\n" + run.describe()
    # Revoked only once its kernel had finished: nothing left for the release to wait for.
    assert max(released) < 100, run.describe()
    assert ran["t_mono"] >= launched["busy_until"] - 0.005
