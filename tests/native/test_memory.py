"""Memory under the shim: every allocation path is intercepted and counted, quotas hold on every
path with one clear line on stderr, and the process's memory view (cuMemGetInfo, NVML) is its
own."""

from __future__ import annotations

import re

import pytest

MiB = 1 << 20
GiB = 1 << 30
CONTEXT = 64 * MiB

PATHS = ["alloc", "pitch", "managed", "async", "pool", "create"]
# What the driver must see for each path, and whether the memory counts as managed (evictable).
# cudaMalloc's memory is explicit (GPUSHARE_MEMORY=vmm, the default): physical memory the shim
# creates and maps into a reserved range, so it can leave the device and come back at the same
# address.
DRIVER_CALL = {
    "alloc": ("cuMemCreate", True),
    "pitch": ("cuMemCreate", True),
    "managed": ("cuMemAllocManaged", True),
    "async": ("cuMemAllocAsync", False),
    "pool": ("cuMemAllocFromPoolAsync", False),
    "create": ("cuMemCreate", False),
}


def oom_lines(run) -> list[str]:
    return [line for line in run.shim_lines if "out of memory" in line]


@pytest.mark.parametrize("path", PATHS)
def test_every_allocation_path_is_intercepted_and_counted(harness, path):
    size = 64 * MiB
    run = harness.run("alloc", path, size, context_bytes=CONTEXT).ok()
    alloc = run.event("alloc")
    assert alloc["rc"] == 0
    st = alloc["status"]
    assert st["used_bytes"] == CONTEXT + size, st
    call, managed = DRIVER_CALL[path]
    if managed:
        assert st["managed_bytes"] == size, st
        assert st["pinned_bytes"] == CONTEXT, st
    else:
        assert st["managed_bytes"] == 0, st
        assert st["pinned_bytes"] == CONTEXT + size, st
    assert run.calls(call) == 1, run.stats["calls"]
    if path in ("alloc", "pitch"):
        # Turned into explicit memory: the driver never saw the device-memory call, and the
        # shim's physical memory was mapped into a reserved range with access granted.
        assert run.calls("cuMemAlloc_v2") == 0 and run.calls("cuMemAllocPitch_v2") == 0
        assert run.calls("cuMemAllocManaged") == 0
        for call in ("cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"):
            assert run.calls(call) == 1, (call, run.stats["calls"])
    assert run.event("data")["ok"], "data did not round-trip through the allocation"
    freed = run.event("free")
    assert freed["rc"] == 0
    assert freed["status"]["used_bytes"] == CONTEXT, freed
    stats = run.stats
    assert stats["live_device_bytes"] == 0 and stats["live_managed_bytes"] == 0
    # Every physical allocation, mapping and reserved range was given back.
    assert stats["live_handles"] == 0 and stats["live_maps"] == 0, stats
    assert stats["live_allocations"]["reserved"] == 0, stats
    assert not oom_lines(run)


@pytest.mark.parametrize("path", ["alloc", "pitch"])
def test_managed_mode_makes_cudamalloc_managed(harness, path):
    run = harness.run("alloc", path, 64 * MiB, context_bytes=CONTEXT, memory="managed").ok()
    st = run.event("alloc")["status"]
    assert st["managed_bytes"] == 64 * MiB and st["used_bytes"] == CONTEXT + 64 * MiB, st
    assert run.calls("cuMemAllocManaged") == 1 and run.calls("cuMemCreate") == 0
    assert run.event("data")["ok"]


def test_managed_off_leaves_device_memory(harness):
    run = harness.run("alloc", "alloc", 32 * MiB, context_bytes=CONTEXT, managed="0").ok()
    assert run.calls("cuMemAlloc_v2") == 1 and run.calls("cuMemAllocManaged") == 0
    st = run.event("alloc")["status"]
    assert st["used_bytes"] == CONTEXT + 32 * MiB
    assert st["managed_bytes"] == 0 and st["pinned_bytes"] == CONTEXT + 32 * MiB


@pytest.mark.parametrize("limit", ["300MiB", str(300 * MiB)], ids=["unit", "bytes"])
@pytest.mark.parametrize("path", PATHS)
def test_quota_holds_on_every_path_with_one_clear_line(harness, path, limit):
    chunk = 32 * MiB
    run = harness.run(
        "quota", chunk, path, 64, context_bytes=CONTEXT, memory_limit=limit, log="warn"
    ).ok()
    q = run.event("quota")
    # 300 MiB quota, 64 MiB context: seven 32 MiB allocations fit (288 MiB), the eighth does not.
    assert q["count"] == 7, q
    assert q["rc"] == 2, "the refusal must be CUDA_ERROR_OUT_OF_MEMORY"
    assert q["status"]["quota_bytes"] == 300 * MiB
    assert q["status"]["used_bytes"] == CONTEXT + 7 * chunk
    lines = oom_lines(run)
    assert len(lines) == 1, run.stderr
    line = lines[0]
    assert "quota" in line, line
    assert re.search(r"\b300(\.0+)?\s?Mi?B\b", line), f"the quota is not named: {line}"
    assert re.search(r"\b288(\.0+)?\s?Mi?B\b", line), f"the use is not named: {line}"
    # The refused allocation never reached the driver.
    call, _ = DRIVER_CALL[path]
    assert run.calls(call) == 7 + 1  # seven, then one more after everything was freed
    freed = run.event("quota_freed")
    assert freed["free_errors"] == 0 and freed["realloc_rc"] == 0
    assert freed["status"]["used_bytes"] == CONTEXT


def test_memory_view_is_the_quota(harness):
    quota, size = 1 * GiB, 256 * MiB
    run = harness.run("meminfo", size, context_bytes=CONTEXT, memory_limit=quota).ok()
    before, after = run.all("meminfo")
    assert before["rc"] == 0 and after["rc"] == 0
    assert before["total"] == quota and after["total"] == quota
    # cuDeviceTotalMem agrees with cuMemGetInfo (frameworks size pools from either).
    assert before["device_total_rc"] == 0 and before["device_total"] == quota, before
    assert before["free"] == quota - CONTEXT
    assert after["free"] == quota - CONTEXT - size
    for nvml in run.all("nvml"):
        assert nvml["available"], "the stand-in NVML was not found"
        meminfo = before if nvml["when"] == "before" else after
        for v in ("v1", "v2"):
            m = nvml[v]
            assert m["rc"] == 0
            assert m["total"] == quota, f"NVML {v} is not rewritten in-process: {m}"
            assert m["free"] == meminfo["free"], m
            assert m["used"] + m["free"] == m["total"], m


def test_memory_view_without_quota_is_the_device(harness):
    total = 8 * GiB
    run = harness.run(
        "meminfo",
        128 * MiB,
        context_bytes=CONTEXT,
        extra={"GPUSHARE_FAKE_DEVICE_TOTAL": str(total)},
    ).ok()
    before, after = run.all("meminfo")
    assert before["total"] == total == after["total"]
    assert before["device_total"] == total, before
    assert before["free"] == total - CONTEXT
    assert after["free"] == total - CONTEXT - 128 * MiB


def test_free_memory_is_never_negative(harness):
    # The context estimate alone is over the quota.
    run = harness.run("meminfo", context_bytes=512 * MiB, memory_limit=128 * MiB).ok()
    m = run.event("meminfo")
    assert m["total"] == 128 * MiB
    assert m["free"] == 0, m
    for nvml in run.all("nvml"):
        for v in ("v1", "v2"):
            assert nvml[v]["free"] == 0 and nvml[v]["total"] == 128 * MiB, nvml


@pytest.mark.parametrize("path", ["alloc", "async", "pool", "create"])
def test_a_refusal_by_the_driver_is_not_counted(harness, path):
    """No quota; the (stand-in) device itself runs out. The shim must not count the refused
    allocation, nor blame a quota for it."""
    run = harness.run(
        "quota",
        64 * MiB,
        path,
        64,
        context_bytes=0,
        managed="0",
        extra={"GPUSHARE_FAKE_DEVICE_TOTAL": str(256 * MiB)},
    ).ok()
    q = run.event("quota")
    assert q["count"] == 4 and q["rc"] == 2, q
    assert q["status"]["used_bytes"] == 256 * MiB, q["status"]
    assert not oom_lines(run), run.stderr
    freed = run.event("quota_freed")
    assert freed["realloc_rc"] == 0 and freed["status"]["used_bytes"] == 0


@pytest.mark.parametrize(
    "path", ["create_released", "create_retained", "array", "array3d", "mipmap"]
)
def test_quota_holds_on_every_way_around_it(harness, path):
    """Issue 12, item 5: a VMM handle released while still mapped (NCCL's free path), one
    retained with cuMemRetainAllocationHandle, and CUDA arrays all count until really gone."""
    chunk = 32 * MiB
    run = harness.run(
        "quota", chunk, path, 64, context_bytes=CONTEXT, memory_limit="300MiB", log="warn"
    ).ok()
    q = run.event("quota")
    # Every one of the seven is still counted although the program dropped its handle.
    assert q["count"] == 7 and q["rc"] == 2, q
    assert q["status"]["used_bytes"] == CONTEXT + 7 * chunk, q["status"]
    assert len(oom_lines(run)) == 1, run.stderr
    freed = run.event("quota_freed")
    assert freed["free_errors"] == 0 and freed["realloc_rc"] == 0, freed
    # Counted until the last unmap / destroy, and not a byte longer.
    assert freed["status"]["used_bytes"] == CONTEXT, freed["status"]
    assert run.stats["live_device_bytes"] == 0, run.stats


def test_destroying_a_context_stops_counting_its_memory(harness):
    """Issue 12, item 4: cuCtxDestroy frees what was allocated in the context; the shim's table
    must forget it too, or the quota stays spent and later allocations are refused."""
    size = 96 * MiB
    run = harness.run(
        "ctx_teardown", size, context_bytes=CONTEXT, memory_limit="512MiB", log="warn"
    ).ok()
    allocated = run.event("allocated")["status"]
    assert allocated["used_bytes"] == CONTEXT + 3 * size, allocated
    destroyed = run.event("destroyed")["status"]
    assert destroyed["used_bytes"] == CONTEXT, destroyed
    again = run.event("again")
    assert again["rc"] == 0 and again["status"]["used_bytes"] == CONTEXT, again
    assert not oom_lines(run), run.stderr


def test_ipc_of_explicit_memory_works_and_a_driver_that_cannot_is_a_clear_error(harness):
    """torch.multiprocessing shares CUDA tensors with cuIpcGetMemHandle. Explicit memory gets the
    shim's own handle (tests/native/test_ipc.py shares it); where the driver refuses exportable
    memory, the refusal says so and names what works, not the driver's bare "invalid argument"."""
    run = harness.run("ipc", "alloc", context_bytes=CONTEXT, log="warn").ok()
    assert run.event("ipc")["rc"] == 0
    assert not [line for line in run.shim_lines if "cuIpcGetMemHandle" in line]
    refused = harness.run(
        "ipc", "alloc", context_bytes=CONTEXT, log="warn", extra={"GPUSHARE_FAKE_NO_SHAREABLE": "1"}
    ).ok()
    assert refused.event("ipc")["rc"] == 801  # CUDA_ERROR_NOT_SUPPORTED
    said = [line for line in refused.shim_lines if "cuIpcGetMemHandle" in line]
    assert len(said) == 1 and "GPUSHARE_MEMORY=device" in said[0], refused.stderr
    # With the setting it names, the driver's own handle is given.
    ok = harness.run(
        "ipc",
        "alloc",
        context_bytes=CONTEXT,
        log="warn",
        memory="device",
        extra={"GPUSHARE_FAKE_NO_SHAREABLE": "1"},
    ).ok()
    assert ok.event("ipc")["rc"] == 0
    assert not [line for line in ok.shim_lines if "cuIpcGetMemHandle" in line]
