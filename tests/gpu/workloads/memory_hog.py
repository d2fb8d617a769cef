"""Hold GIB GiB on the GPU and compute on it for SECONDS (then stay idle LINGER seconds, default
0, before the final check): used for taking turns, kills and pre-copies of idle kernels.

Every iteration adds 1.0 to every element of a float32 tensor that starts at 0, so after k
iterations every element must equal k exactly (k stays far below 2**24). Any lost, duplicated or
misplaced page during eviction and restore shows up as a wrong element.
"""

from __future__ import annotations

import sys
import time

import torch
from _common import emit


def main() -> None:
    gib, seconds, tag = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    linger = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    n = int(gib * (1 << 30)) // 4
    t0 = time.time()
    x = torch.zeros(n, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    first = time.time()
    print(f"{tag}: allocated {gib} GiB at {first - t0:.3f}s", file=sys.stderr, flush=True)
    k = 0
    while time.time() - first < seconds:
        for _ in range(5):
            x.add_(1.0)
            k += 1
        torch.cuda.synchronize()
    time.sleep(linger)  # idle: the scheduler may pre-copy and evict this kernel meanwhile
    lo, hi = float(x.min()), float(x.max())
    end = time.time()
    emit(
        tag=tag,
        gib=gib,
        iterations=k,
        min=lo,
        max=hi,
        correct=(lo == hi == float(k)),
        start=t0,
        first_compute=first,
        end=end,
    )


if __name__ == "__main__":
    main()
