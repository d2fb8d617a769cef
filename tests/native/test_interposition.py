"""The shim's three doors (cuGetProcAddress v1 and v2, dlsym, exported symbols) against the stand-in
driver: every hooked variant is wrapped with exactly the wrapper of the variant the caller asked
for, per-thread variants stay per-thread, v1 and v2 of cuGetProcAddress are kept apart, and what
the shim does not hook comes back untouched."""

from __future__ import annotations

import pytest

SHIM = "libgpushare.so"
DRIVER = "libcuda.so.1"

DOORS = [
    pytest.param([], id="getproc_v2"),
    pytest.param(["--getproc", "v1"], id="getproc_v1"),
]
VERSIONS = [12080, 13000]


def expected_symbol(event: dict, ptds: bool) -> str:
    return event["ptsym"] if ptds else event["sym"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("ptds", [False, True], ids=["default", "per_thread"])
@pytest.mark.parametrize("door", DOORS)
def test_getproc_returns_the_wrapper_of_the_variant_asked_for(
    harness, hooked_exports, door, ptds, version
):
    args = [*door, "--cuda-version", version, *(["--ptds"] if ptds else []), "resolve"]
    run = harness.run(*args).ok()
    resolved = [e for e in run.all("resolved") if "sym" in e]
    assert len(resolved) > 40, run.describe()
    wrapped = 0
    for e in resolved:
        want = expected_symbol(e, ptds)
        assert e["rc"] == 0, f"{e['name']} did not resolve: {e}"
        where = e["where"]
        if want in hooked_exports:
            wrapped += 1
            assert where["lib"] == SHIM, f"{e['name']} ({want}) was not wrapped: {e}"
            assert where["exact"] and where["sym"] == want, (
                f"{e['name']}: asked for the {want} ABI, got {where}"
            )
        else:
            assert where["lib"] == DRIVER and where["sym"] == want, (
                f"{e['name']} is not hooked and must come back untouched: {e}"
            )
    assert wrapped >= 30


@pytest.mark.parametrize("env", [{"shim": False}, {"disable": "1"}], ids=["no_shim", "disabled"])
def test_without_the_shim_or_disabled_every_pointer_is_the_drivers(harness, env):
    run = harness.run("--ptds", "resolve", **env).ok()
    for e in run.all("resolved"):
        if e["rc"] == 0:
            assert e["where"]["lib"] == DRIVER, e
    if env.get("disable"):
        assert not [line for line in run.shim_lines if "warn" in line.lower()], run.stderr


def test_names_the_driver_does_not_know_stay_unknown(harness):
    run = harness.run("resolve").ok()
    unknown = [e for e in run.all("resolved") if e["name"] == "cuNoSuchFunction"]
    assert unknown and unknown[0]["rc"] == 500  # CUDA_ERROR_NOT_FOUND
    assert unknown[0]["symbol_status"] == 1  # CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
    assert unknown[0]["where"] is None


def test_old_abi_versions_are_not_mistaken_for_new_ones(harness):
    """Asked for "cuMemAlloc" at CUDA 3.1, the driver hands out the 32-bit v1 function; the shim
    must not answer with its cuMemAlloc_v2 wrapper (it never guesses suffixes)."""
    run = harness.run("--cuda-version", 3010, "resolve").ok()
    by_name = {e["name"]: e for e in run.all("resolved")}
    assert by_name["cuMemAlloc"]["rc"] == 0
    assert by_name["cuMemAlloc"]["where"] == {"lib": DRIVER, "sym": "cuMemAlloc", "exact": True}
    # cuLaunchKernel appeared in CUDA 4.0: not available at 3.1, through the shim too.
    assert by_name["cuLaunchKernel"]["rc"] == 500
    assert by_name["cuLaunchKernel"]["symbol_status"] == 2  # VERSION_NOT_SUFFICIENT


def test_prefetch_v1_and_v2_are_told_apart(harness, hooked_exports):
    old = {
        e["name"]: e for e in harness.run("--cuda-version", 11080, "resolve").ok().all("resolved")
    }
    new = {
        e["name"]: e for e in harness.run("--cuda-version", 12080, "resolve").ok().all("resolved")
    }
    assert old["cuMemPrefetchAsync"]["where"]["sym"] == "cuMemPrefetchAsync"
    assert new["cuMemPrefetchAsync"]["where"]["sym"] == "cuMemPrefetchAsync_v2"
    for e in (old["cuMemPrefetchAsync"], new["cuMemPrefetchAsync"]):
        assert e["where"]["lib"] == (SHIM if e["where"]["sym"] in hooked_exports else DRIVER)


def test_cugetprocaddress_v1_obtained_through_v2_works_as_v1(harness):
    """cudart asks cuGetProcAddress_v2 for "cuGetProcAddress": below CUDA 12.0 the answer has the
    4-argument ABI. Used as such (even with garbage where a 5th argument would be) it must work,
    and what it resolves must still be intercepted."""
    run = harness.run("procaddr").ok()
    pa = run.event("procaddr")
    assert pa["v1"]["rc"] == 0 and pa["v2"]["rc"] == 0
    assert pa["distinct"], "v1 and v2 of cuGetProcAddress must be different functions"
    assert pa["v1"]["where"] == {"lib": SHIM, "sym": "cuGetProcAddress", "exact": True}
    assert pa["v2"]["where"] == {"lib": SHIM, "sym": "cuGetProcAddress_v2", "exact": True}
    use = run.event("procaddr_use")
    assert use["ok"] and use["mismatches"] == 0
    assert use["cuMemAlloc"]["lib"] == SHIM
    poisoned = run.event("procaddr_poisoned")
    assert poisoned["rc"] == 0 and poisoned["where"]["lib"] == SHIM
    v2call = run.event("procaddr_v2_call")
    assert v2call["rc"] == 0 and v2call["status"] == 0 and v2call["where"]["lib"] == SHIM
    unknown = run.event("procaddr_unknown")
    assert unknown == {**unknown, "rc": 500, "status": 1, "null": True}
    # The allocations made through the v1 door were turned into explicit memory.
    assert run.calls("cuMemCreate") >= 1 and run.calls("cuMemAllocManaged") == 0
    assert run.calls("cuMemAlloc_v2") == 0


def test_dlsym_door_returns_the_wrappers(harness, hooked_exports):
    run = harness.run("dlsym").ok()
    seen = 0
    for e in run.all("dlsym"):
        name, where = e["name"], e["where"]
        assert where is not None, f"dlsym({name}) failed: {e}"
        if name in hooked_exports:
            assert where == {"lib": SHIM, "sym": name, "exact": True}, e
            seen += 1
        else:
            assert where["lib"] == DRIVER and where["sym"] == name, e
    assert seen >= 30


@pytest.mark.parametrize("ptds", [False, True], ids=["default", "per_thread"])
def test_exported_symbol_door(harness, ptds):
    """A program linked against libcuda calls the shim's exports."""
    args = ["--ptds"] if ptds else []
    run = harness.run(*args, "saxpy", 4096, direct=True).ok()
    assert run.event("start")["door"] == "exported"
    assert run.event("saxpy")["ok"]
    # Two 16 KiB buffers share one explicit chunk.
    assert run.calls("cuMemCreate") == 1 and run.calls("cuMemAlloc_v2") == 0
    suffix = "_ptsz" if ptds else ""
    assert run.calls(f"cuLaunchKernel{suffix}") == 1
    assert run.calls(f"cuLaunchKernelEx{suffix}") == 1
    assert run.calls(f"cuLaunchCooperativeKernel{suffix}") == 1
