"""A notebook kernel's life in one process, for deep idle: hold GIB GiB of known data, then run
one cell per line of stdin, going quiet in between (the test puts the process to sleep then).

    sleepy_cells.py GIB

Prints {"event": "ready", "pid": ...} once the data is on the GPU. A line "ALLOC_GIB FILL" is a
cell: its first GPU call is timed (``first_call_s``: the wake, the restore and the call), then it
allocates ALLOC_GIB GiB of int32 equal to FILL, sums them exactly (int64), frees them and empties
PyTorch's cache, checks the held data element by element and prints {"event": "done", ...}
(``cell_s``: the whole cell). End of input ends the process.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from _common import emit, shim_status

GIB = 1 << 30


def main() -> int:
    n = int(float(sys.argv[1]) * GIB) // 4
    held = torch.arange(n, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    emit(event="ready", pid=os.getpid(), bytes=n * 4)
    while line := sys.stdin.readline():
        alloc_gib, fill = float(line.split()[0]), int(line.split()[1])
        t0 = time.perf_counter()
        last = int(held[-1].item())  # the first GPU call: wakes the process
        first_call_s = time.perf_counter() - t0
        m = int(alloc_gib * GIB) // 4
        big = torch.full((m,), fill, dtype=torch.int32, device="cuda")
        big_sum = int(big.sum().item())
        status = shim_status()
        counted = status["used_bytes"] if status else 0
        del big
        torch.cuda.empty_cache()
        intact = last == n - 1 and bool(
            torch.equal(held, torch.arange(n, dtype=torch.int32, device="cuda"))
        )
        torch.cuda.synchronize()
        cell_s = time.perf_counter() - t0
        emit(
            event="done",
            correct=intact and big_sum == m * fill,
            held_intact=intact,
            big_sum_ok=big_sum == m * fill,
            used_during_cell=counted,
            first_call_s=first_call_s,
            cell_s=cell_s,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
