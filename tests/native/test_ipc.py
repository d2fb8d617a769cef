"""CUDA IPC of explicit memory between two shimmed processes on the stand-in driver, whose
cuMemCreate memory is a memfd: the exporter's handle is the shim's own, the importer gets the
physical memory as a file descriptor over the exporter's socket and maps it, so both processes see
the same bytes. The exported block is pinned (reported as pinned, never evicted) until the
importer closes it; handles that are not the shim's go to the driver."""

from __future__ import annotations

import re

MiB = 1 << 20
CONTEXT = 64 * MiB
SHARED = 8 * MiB


def test_memory_is_shared_both_ways_and_pinned_until_the_importer_closes(harness):
    exporter = harness.spawn("ipc_export", SHARED, 30, context_bytes=CONTEXT, log="info")
    handle = exporter.wait_event("ipc_handle", 30)
    assert handle["rc"] == 0, exporter.describe()
    importer = harness.run(
        "ipc_import", handle["handle"], SHARED, 1.0, context_bytes=CONTEXT, log="info"
    ).ok()
    assert importer.event("ipc_open")["rc"] == 0
    assert importer.event("ipc_opened")["first"] == 0x11, (
        "the importer must see the exporter's data"
    )
    assert importer.stats["imported_handles"] == 1, importer.stats
    assert importer.event("ipc_closed")["rc"] == 0
    ran = exporter.finish(60).ok()
    seen, released, freed = (
        ran.event(e)["status"] for e in ("ipc_seen", "ipc_released", "ipc_freed")
    )
    assert ran.event("ipc_seen")["last"] == 0x22, "the exporter must see the importer's write"
    # While imported the block is pinned, not evictable; the importer's close gives it back.
    assert seen["pinned_bytes"] - released["pinned_bytes"] == SHARED, (seen, released)
    assert released["managed_bytes"] - seen["managed_bytes"] == SHARED, (seen, released)
    assert seen["used_bytes"] == released["used_bytes"]
    assert released["used_bytes"] - freed["used_bytes"] == SHARED, (released, freed)
    assert freed["pinned_bytes"] == handle["status"]["pinned_bytes"] - SHARED


def test_a_handle_that_is_not_the_shims_goes_to_the_driver(harness):
    run = harness.run("ipc_import", "00" * 64, SHARED, 0, context_bytes=CONTEXT, log="info")
    assert run.event("ipc_open")["rc"] == 1  # the stand-in driver's own answer
    assert run.calls("cuIpcOpenMemHandle_v2") == 1


def test_a_handle_whose_exporter_is_gone_is_a_clear_error(harness):
    exporter = harness.spawn("ipc_export", SHARED, 0.2, context_bytes=CONTEXT, log="info")
    handle = exporter.wait_event("ipc_handle", 30)["handle"]
    exporter.finish(60)
    run = harness.run("ipc_import", handle, SHARED, 0, context_bytes=CONTEXT, log="warn")
    assert run.event("ipc_open")["rc"] == 801  # CUDA_ERROR_NOT_SUPPORTED, not "invalid argument"
    said = [line for line in run.shim_lines if "cuIpcOpenMemHandle" in line]
    assert said and "GPUSHARE_MEMORY=device" in said[0], run.describe()


def test_memory_imported_by_a_peer_is_not_evicted_under_it(harness):
    big = 640 * MiB  # the exporter's own memory, not shared: evictable
    sched = harness.scheduler(pool="1GiB", quantum=1.0)
    common = {"context_bytes": CONTEXT, "idle_seconds": 0.3, "log": "info"}
    exporter = harness.spawn("ipc_export", SHARED, 60, big, **common, client_id="E")
    handle = exporter.wait_event("ipc_handle", 30)["handle"]
    importer = harness.spawn("ipc_import", handle, SHARED, 6.0, **common, client_id="I")
    importer.wait_event("ipc_opened", 30)
    exporter.wait_event("ipc_seen", 30)
    # C needs the room E holds: E (idle now) is evicted, all but the block I has mapped.
    c = harness.spawn("hold", 0.5, big, 20000, **common, client_id="C")
    line = sched.wait_log("evicted client=E", 30)
    assert c.finish(60).ok().event("hold_end")["data_ok"]
    ri = importer.finish(60).ok()
    assert ri.event("ipc_opened")["first"] == 0x11
    re_ = exporter.finish(60).ok()
    assert re_.event("ipc_seen")["last"] == 0x22
    evicted = [int(n) for n in re.findall(r"evicted client=E bytes=(\d+)", sched.log)]
    assert evicted and evicted[0] == big, (evicted, line)
