"""Every work-submission path goes through the gate, whatever door it was reached through, and the
driver sees exactly the variant (default or per-thread stream) that the program asked for."""

from __future__ import annotations

import pytest

EXPECTED_PATHS = {
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cuLaunchCooperativeKernel",
    "cuGraphLaunch",
    "cuMemcpy",
    "cuMemcpyAsync",
    "cuMemcpyHtoD",
    "cuMemcpyDtoH",
    "cuMemcpyDtoD",
    "cuMemcpyHtoDAsync",
    "cuMemcpyDtoHAsync",
    "cuMemcpyDtoDAsync",
    "cuMemcpyPeer",
    "cuMemcpyPeerAsync",
    "cuMemsetD8",
    "cuMemsetD16",
    "cuMemsetD32",
    "cuMemsetD8Async",
    "cuMemsetD16Async",
    "cuMemsetD32Async",
    "cuMemPrefetchAsync",
}

VARIANTS = [
    pytest.param([], False, id="getproc_v2"),
    pytest.param(["--ptds"], False, id="getproc_v2_per_thread"),
    pytest.param(["--ptds", "--null-stream"], False, id="getproc_v2_per_thread_stream0"),
    pytest.param(["--getproc", "v1"], False, id="getproc_v1"),
    pytest.param(["--getproc", "v1", "--ptds"], False, id="getproc_v1_per_thread"),
    pytest.param(["--cuda-version", "13000", "--ptds"], False, id="cuda13_per_thread"),
    pytest.param(["--cuda-version", "11080"], False, id="cuda11_prefetch_v1"),
    pytest.param([], True, id="exported"),
    pytest.param(["--ptds"], True, id="exported_per_thread"),
]


@pytest.mark.parametrize(("args", "direct"), VARIANTS)
def test_every_submission_path_is_gated_and_keeps_its_variant(harness, args, direct):
    run = harness.run(*args, "paths", direct=direct).ok()
    ptds = "--ptds" in args
    paths = {e["path"]: e for e in run.all("path")}
    assert set(paths) == EXPECTED_PATHS, run.describe()
    for name, e in paths.items():
        assert e["rc"] == 0, e
        assert e["gated_delta"] >= 1, f"{name} did not go through the gate: {e}"
        (default_sym, default_n), (pt_sym, pt_n) = e["fake"].items()
        if default_sym == pt_sym:
            assert default_n == 1, e
        elif ptds:
            assert (default_n, pt_n) == (0, 1), f"{name}: the per-thread variant was lost: {e}"
        else:
            assert (default_n, pt_n) == (1, 0), f"{name}: a per-thread variant appeared: {e}"
    assert run.event("paths")["ok"]


def test_gated_calls_are_not_counted_for_non_gated_work(harness):
    """Status and memory queries are not work: only the gated paths move the counter."""
    run = harness.run("status").ok()
    # status: one launch and one synchronisation after set-up; only the launch is gated.
    assert run.event("status")["status"]["gated_calls"] == 1
