"""A burst of N cudaMallocs of 1 GiB (PyTorch tensors), summed exactly and freed: the times of
each part as one JSON line. Under the shim each block's host staging is made in the background;
it must not slow the burst (on an H100 it once took 25.4 s under the shim, 0.015 s without)."""

from __future__ import annotations

import sys
import time

import torch
from _common import emit

GIB = 1 << 30


def main() -> None:
    n = int(sys.argv[1])
    torch.ones(1, device="cuda").sum().item()  # the context and the shim's grant, untimed
    t0 = time.perf_counter()
    blocks = [torch.full((GIB // 4,), 7, dtype=torch.int32, device="cuda") for _ in range(n)]
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    total = sum(int(b.sum(dtype=torch.int64).item()) for b in blocks)
    t2 = time.perf_counter()
    del blocks
    torch.cuda.empty_cache()
    t3 = time.perf_counter()
    emit(
        n=n,
        alloc_s=t1 - t0,
        sum_s=t2 - t1,
        free_s=t3 - t2,
        correct=total == 7 * n * (GIB // 4),
    )


if __name__ == "__main__":
    main()
