"""Two CUDA contexts on one GPU (driver API through ctypes): a second context's kernel must be
waited for by a release, not only the first context's.

Context A makes the process a client (a short kernel); context B runs a kernel of KERNEL_SECONDS;
then gpushare_release() asks the shim to release the device: it may return only once B's kernel
has finished. Prints the time the release took."""

from __future__ import annotations

import ctypes
import json
import sys
import time

SPIN_PTX = b"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry spin(.param .u64 cycles)
{
    .reg .u64 %rd<5>;
    .reg .pred %p;
    ld.param.u64 %rd1, [cycles];
    mov.u64 %rd2, %clock64;
LOOP:
    mov.u64 %rd3, %clock64;
    sub.u64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p, %rd4, %rd1;
    @%p bra LOOP;
    ret;
}
"""


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise SystemExit(f"{what} failed: CUresult {rc}")


def main() -> None:
    kernel_seconds = float(sys.argv[1])
    cu = ctypes.CDLL("libcuda.so.1")
    check(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    khz = ctypes.c_int()
    check(cu.cuDeviceGetAttribute(ctypes.byref(khz), 13, dev), "clock rate")  # kHz

    def context() -> ctypes.c_void_p:
        ctx = ctypes.c_void_p()
        check(cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate_v2")
        return ctx

    def spin(seconds: float) -> None:
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        check(cu.cuModuleLoadData(ctypes.byref(mod), SPIN_PTX), "cuModuleLoadData")
        check(cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"spin"), "cuModuleGetFunction")
        cycles = ctypes.c_uint64(int(seconds * khz.value * 1000))
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(cycles), ctypes.c_void_p))
        check(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None), "cuLaunchKernel")

    context()  # A, current
    spin(0.01)
    check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    context()  # B, current now
    spin(kernel_seconds)
    release = ctypes.CDLL(None).gpushare_release
    t0 = time.monotonic()
    rc = release()
    took = time.monotonic() - t0
    check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    print(json.dumps({"release_rc": rc, "release_seconds": took, "kernel_seconds": kernel_seconds}))


if __name__ == "__main__":
    main()
