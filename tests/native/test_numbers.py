"""Numbers through the shim equal the numbers without it. A shim that passes one argument wrong (a
v2-shaped wrapper for a v1 caller, a per-thread variant for a default one) does not crash: it
computes garbage, so these tests compare results bit for bit."""

from __future__ import annotations

import pytest

N = 100_003  # not a multiple of the block size


@pytest.fixture(scope="module")
def reference(session_harness):
    """The unshimmed result, computed once."""
    run = session_harness.run("saxpy", N, shim=False).ok()
    e = run.event("saxpy")
    assert e["ok"] and e["mismatches"] == 0
    return e


@pytest.mark.parametrize(
    ("args", "direct"),
    [
        pytest.param([], False, id="getproc_v2"),
        pytest.param(["--ptds"], False, id="getproc_v2_per_thread"),
        pytest.param(["--ptds", "--null-stream"], False, id="per_thread_stream0"),
        pytest.param(["--getproc", "v1"], False, id="getproc_v1"),
        pytest.param(["--cuda-version", "13000"], False, id="cuda13"),
        pytest.param(["--cuda-version", "11080", "--getproc", "v1"], False, id="cuda11_v1"),
        pytest.param([], True, id="exported"),
    ],
)
def test_saxpy_through_the_shim_is_bit_identical(harness, reference, args, direct):
    run = harness.run(*args, "saxpy", N, direct=direct).ok()
    e = run.event("saxpy")
    assert e["ok"], e
    assert e["mismatches"] == 0
    assert e["hash"] == reference["hash"]
    assert e["sum"] == reference["sum"]
    # Through the shim: the data lived in explicit memory (two small buffers sub-allocated from
    # one physical chunk) and all three launch paths ran.
    assert run.calls("cuMemCreate") == 1 and run.calls("cuMemAllocManaged") == 0
    assert run.stats["kernels"]["saxpy"] == 3


@pytest.mark.parametrize("args", [[], ["--ptds"]], ids=["default", "per_thread"])
def test_every_copy_and_set_moves_the_right_bytes(harness, args):
    run = harness.run(*args, "copies", 1 << 18).ok()
    copies = run.all("copy")
    assert len(copies) == 16
    bad = [c for c in copies if not c["ok"]]
    assert not bad, bad
    assert run.event("copies")["ok"]
