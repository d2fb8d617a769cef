"""Quitting in the middle of a kernel: on every signal whose default action ends the process
(SIGTERM, SIGHUP, SIGQUIT, an unhandled SIGINT, SIGXCPU, a crash's SIGABRT or SIGSEGV, ...), the
shim synchronises the process's outstanding GPU work and says GOODBYE to the scheduler before the
signal ends the process. Under MPS a client that dies with work in
flight can leave the server and its other clients undefined; this is the shim's part of avoiding
that (docs/mps.md).

The stand-in driver writes a trace line for every cuCtxSynchronize (which thread, from when to
when, until when the device was busy as it began); the "hold" scenario keeps 2.5 s sleep kernels
running back to back. Times are CLOCK_MONOTONIC on both sides.
"""

from __future__ import annotations

import json
import resource
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

KERNEL_US = 2_500_000


@pytest.fixture(autouse=True)
def no_core_dumps() -> Iterator[None]:
    """SIGQUIT's default action dumps core: not into the working tree (children inherit this)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))


def syncs(trace: Path) -> list[dict[str, Any]]:
    if not trace.exists():
        return []
    lines = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    return [e for e in lines if e.get("op") == "ctx_sync"]


@pytest.mark.parametrize(
    "sig",
    [
        signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGINT, signal.SIGXCPU,
        signal.SIGABRT, signal.SIGSEGV,
    ],
    ids=lambda s: s.name,
)  # fmt: skip
def test_a_fatal_signal_mid_kernel_synchronises_then_ends_the_process(
    harness: Any, tmp_path: Path, sig: signal.Signals
) -> None:
    sched = harness.scheduler(pool="1GiB", quantum=30.0)
    trace = tmp_path / "trace.jsonl"
    p = harness.spawn(
        "hold", 60.0, 1 << 20, KERNEL_US,
        extra={"GPUSHARE_FAKE_TRACE": str(trace)},
        client_id="Q", idle_seconds=0, context_bytes=1 << 20,
    )  # fmt: skip
    first = p.wait_event("first_launch", 30)
    # Into the first kernel, with most of it still to run.
    time.sleep(max(0.0, first["t_mono"] + 0.5 - time.monotonic()))
    sent = time.monotonic()
    p.signal(sig)
    r = p.finish(30)
    ended = time.monotonic()
    assert r.returncode == -sig, r.describe()  # ended by the signal itself, as without the shim

    quit_syncs = [s for s in syncs(trace) if s["thread"] == "gpushare" and s["t_begin"] >= sent]
    seen = trace.read_text() if trace.exists() else "(no synchronisation at all)"
    assert quit_syncs, f"the shim did not synchronise after {sig.name}:\n{seen}\n{r.describe()}"
    s = quit_syncs[-1]
    # There was a kernel in flight when the shim synchronised, and it waited for its end.
    assert s["busy_until"] > s["t_begin"] + 0.5, s
    assert s["t_end"] >= s["busy_until"] - 0.01, s
    # The process ended only after its work had.
    assert ended >= s["busy_until"] - 0.01
    assert ended - sent < 10, "the quit took far longer than the kernel"
    sched.wait_log("goodbye client=Q")
    sched.wait_log("leave client=Q (goodbye)")


def test_without_the_shim_the_process_dies_mid_kernel(harness: Any, tmp_path: Path) -> None:
    """The control: what the signal does with no shim (the test above would notice nothing)."""
    trace = tmp_path / "trace.jsonl"
    p = harness.spawn(
        "hold", 60.0, 1 << 20, KERNEL_US, shim=False, extra={"GPUSHARE_FAKE_TRACE": str(trace)}
    )
    first = p.wait_event("first_launch", 30)
    time.sleep(max(0.0, first["t_mono"] + 0.5 - time.monotonic()))
    sent = time.monotonic()
    p.signal(signal.SIGTERM)
    r = p.finish(30)
    gone = time.monotonic()  # at most this late
    assert r.returncode == -signal.SIGTERM
    # It died before the kernel in flight when the signal came had ended (kernels run back to
    # back from the first launch), however late a loaded machine sent it.
    kernel_s = KERNEL_US / 1e6
    in_flight_ends = first["t_mono"] + kernel_s * (1 + (sent - first["t_mono"]) // kernel_s)
    assert gone < in_flight_ends, "died only after its kernel: nothing to compare against"
    assert not [s for s in syncs(trace) if s["t_begin"] >= sent]


def test_a_programs_own_handler_is_kept(harness: Any, tmp_path: Path) -> None:
    """SIGINT handled by the program (--sigint-handler) is not taken over: the program decides
    (this one counts the interrupt and keeps going), and its exit synchronises through atexit."""
    harness.scheduler(pool="1GiB", quantum=30.0)
    p = harness.spawn(
        "--sigint-handler", "hold", 2.0, 1 << 20, 200_000,
        client_id="H", idle_seconds=0, context_bytes=1 << 20,
    )  # fmt: skip
    p.wait_event("first_launch", 30)
    p.signal(signal.SIGINT)
    r = p.finish(30)
    assert r.returncode == 0, r.describe()
    assert r.event("hold_end")["data_ok"]


PYTHON_KERNEL = textwrap.dedent(
    """
    import ctypes as ct, json, sys, time
    cu = ct.CDLL("libcuda.so.1")
    cu.cuModuleGetFunction.argtypes = [ct.POINTER(ct.c_void_p), ct.c_void_p, ct.c_char_p]
    cu.cuLaunchKernel.argtypes = [ct.c_void_p] + [ct.c_uint] * 7 + [ct.c_void_p] * 3
    cu.cuCtxSetCurrent.argtypes = [ct.c_void_p]
    assert cu.cuInit(0) == 0
    dev, ctx, mod, fn = ct.c_int(), ct.c_void_p(), ct.c_void_p(), ct.c_void_p()
    assert cu.cuDeviceGet(ct.byref(dev), 0) == 0
    assert cu.cuDevicePrimaryCtxRetain(ct.byref(ctx), dev) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    assert cu.cuModuleLoadData(ct.byref(mod), b"image") == 0
    assert cu.cuModuleGetFunction(ct.byref(fn), mod, b"sleep") == 0
    arg = ct.c_ulonglong(int(sys.argv[1]))
    params = (ct.c_void_p * 1)(ct.cast(ct.byref(arg), ct.c_void_p))
    assert cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None) == 0
    print(json.dumps({"event": "launched", "t_mono": time.monotonic()}), flush=True)
    time.sleep(60)  # a notebook kernel between cells, its last cell's work still on the GPU
    """
)


def test_a_python_kernel_is_synchronised_on_sigterm(harness: Any, tmp_path: Path) -> None:
    """What Jupyter does after its shutdown timeout: SIGTERM to a Python kernel (Python leaves
    SIGTERM at its default) whose last cell's kernel still runs."""
    sched = harness.scheduler(pool="1GiB", quantum=30.0)
    trace = tmp_path / "trace.jsonl"
    script = tmp_path / "kernel.py"
    script.write_text(PYTHON_KERNEL)
    env = harness.env(
        extra={"GPUSHARE_FAKE_TRACE": str(trace)}, client_id="PY", idle_seconds=0,
        context_bytes=1 << 20,
    )  # fmt: skip
    p = harness.spawn_command([sys.executable, str(script), str(KERNEL_US)], env)
    launched = p.wait_event("launched", 30)
    time.sleep(max(0.0, launched["t_mono"] + 0.5 - time.monotonic()))
    sent = time.monotonic()
    p.signal(signal.SIGTERM)
    r = p.finish(30)
    assert r.returncode == -signal.SIGTERM, r.describe()
    quit_syncs = [s for s in syncs(trace) if s["thread"] == "gpushare" and s["t_begin"] >= sent]
    assert quit_syncs and quit_syncs[-1]["t_end"] >= quit_syncs[-1]["busy_until"] - 0.01
    assert quit_syncs[-1]["busy_until"] > sent + 0.5
    sched.wait_log("goodbye client=PY")
