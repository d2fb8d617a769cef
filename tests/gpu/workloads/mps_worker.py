"""Workloads of the MPS test (tests/gpu/test_mps.py). Each prints JSON lines on stdout.

    mps_worker.py steady SECONDS [N [STOPFILE]]
                                       the bystander: N x N matrix products, every one checked,
                                       until SECONDS passed or STOPFILE exists
    mps_worker.py spin SECONDS [GIB]   the victim: one kernel that runs SECONDS on every SM
    mps_worker.py alloc GIB [GIB ...]  try to allocate and fill each size in turn

steady: X and Y hold small integers (-4..4), so every element of X @ Y is an integer far below
2**24 and float32 computes it exactly in any summation order (TF32 is off). The first product is
checked against float64 on the host at 256 places, then every later product must equal it bit for
bit: a product corrupted by a neighbour's crash, or an error, cannot go unseen. Lines:
{"event": "ready"}, {"event": "progress", "iters", "t"} every 0.25 s, and at the end
{"event": "done", "iters", "mismatches", "error", "rate", "max_gap_s", "windows"}.

spin: allocates GIB GiB and fills it, then launches one kernel that loops on %globaltimer for
SECONDS in 4 blocks per SM, prints {"event": "launched"} and waits for it ({"event": "finished"}).
CuPy compiles the kernel; without NVRTC it falls back to a queue of PyTorch products (printed as
"mode").
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any


def emit(**fields: Any) -> None:
    fields.setdefault("pid", os.getpid())
    fields.setdefault("t", time.time())
    print(json.dumps(fields), flush=True)


def steady(seconds: float, n: int, stopfile: str | None = None) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator().manual_seed(1234)
    x = torch.randint(-4, 5, (n, n), generator=g).to(torch.float32)
    y = torch.randint(-4, 5, (n, n), generator=g).to(torch.float32)
    iters = mismatches = 0
    error = None
    windows: list[tuple[float, int]] = []
    max_gap = 0.0
    t_start = time.time()
    try:
        xd, yd = x.cuda(), y.cuda()
        ref = xd @ yd
        torch.cuda.synchronize()
        host = ref.cpu()
        rows = torch.randint(0, n, (256,), generator=g)
        cols = torch.randint(0, n, (256,), generator=g)
        expect = (x.double()[rows] * y.double()[:, cols].T).sum(dim=1)
        if not torch.equal(host[rows, cols].double(), expect):
            raise AssertionError("the first product differs from float64 on the host")
        emit(event="ready")
        t0 = last = last_report = time.time()
        while time.time() - t0 < seconds and not (stopfile and os.path.exists(stopfile)):
            out = xd @ yd
            same = bool(torch.equal(out, ref))  # synchronises
            iters += 1
            if not same:
                mismatches += 1
            now = time.time()
            max_gap = max(max_gap, now - last)
            last = now
            if now - last_report >= 0.25:
                last_report = now
                windows.append((round(now, 3), iters))
                emit(event="progress", iters=iters, mismatches=mismatches)
    except Exception as exc:  # recorded, not raised: the test reads what happened
        error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    elapsed = time.time() - t_start
    emit(
        event="done",
        iters=iters,
        mismatches=mismatches,
        error=error,
        seconds=round(elapsed, 3),
        rate=round(iters / elapsed, 2) if elapsed else 0,
        max_gap_s=round(max_gap, 3),
        windows=windows,
        n=n,
    )


SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns, float *buf, int n) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    t = t0;
    float acc = (float)threadIdx.x;
    while (t - t0 < ns) {
        acc = acc * 1.0000001f + 1.0f;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    }
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) buf[i] = acc;
}
"""


def spin(seconds: float, gib: float) -> None:
    try:
        import cupy as cp

        kernel = cp.RawKernel(SPIN, "spin")
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        hold = cp.ones(int(gib * (1 << 30)) // 4, dtype=cp.float32)
        buf = cp.zeros(sms * 4 * 256, dtype=cp.float32)
        kernel.compile()
        cp.cuda.Device().synchronize()
        kernel((sms * 4,), (256,), (cp.uint64(int(seconds * 1e9)), buf, cp.int32(buf.size)))
        emit(event="launched", mode="cupy-spin", sms=sms, hold_gib=gib)
        cp.cuda.Device().synchronize()
        emit(event="finished", ok=bool(float(hold[-1]) == 1.0))
        return
    except ImportError:
        pass
    except Exception as exc:  # no NVRTC, say: fall back to a queue of products
        print(f"cupy spin kernel unavailable: {exc}", file=sys.stderr, flush=True)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    hold = torch.ones(int(gib * (1 << 30)) // 4, device="cuda")
    a = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    t0 = time.time()
    a @ a
    torch.cuda.synchronize()
    per = max(time.time() - t0, 1e-3)
    for _ in range(int(seconds / per) + 1):
        a @ a
    emit(event="launched", mode="torch-queue", per_product_s=round(per, 4), hold_gib=gib)
    torch.cuda.synchronize()
    emit(event="finished", ok=bool(float(hold[-1]) == 1.0))


def alloc(sizes: list[float]) -> None:
    import torch

    results = []
    for gib in sizes:
        try:
            t = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
            t.fill_(7)
            torch.cuda.synchronize()
            ok = bool(int(t[-1]) == 7)
            del t
            torch.cuda.empty_cache()
            results.append({"gib": gib, "ok": ok, "error": None})
        except Exception as exc:
            results.append({"gib": gib, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]})
    status = None
    try:
        from jupyter_gpushare.shim import read_status

        status = read_status()
    except ImportError:
        pass
    emit(event="done", results=results, shim=status)


def main() -> None:
    role = sys.argv[1]
    if role == "steady":
        n = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
        steady(float(sys.argv[2]), n, sys.argv[4] if len(sys.argv) > 4 else None)
    elif role == "spin":
        spin(float(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 1.0)
    elif role == "alloc":
        alloc([float(v) for v in sys.argv[2:]])
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main()
