"""Deep idle's workload: hold GIB GiB of known data, go quiet until told, then use it.

    sleepy_tensor.py GIB

Prints {"event": "ready", "pid": ...} once the tensor is on the GPU, then waits for a line on
stdin (the test puts the process to sleep meanwhile); its first GPU call after that line is timed
(``first_call_s``: the wake, the restore and the call) and the data checked element by element.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from _common import emit


def main() -> int:
    gib = float(sys.argv[1])
    n = int(gib * (1 << 30)) // 4
    x = torch.arange(n, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    emit(event="ready", pid=os.getpid(), bytes=n * 4)
    sys.stdin.readline()
    t0 = time.perf_counter()
    first = int(x[-1].item())  # the first GPU call: wakes the process
    first_call_s = time.perf_counter() - t0
    expected = torch.arange(n, dtype=torch.int32, device="cuda")
    correct = first == n - 1 and bool(torch.equal(x, expected))
    torch.cuda.synchronize()
    emit(event="done", correct=correct, first_call_s=first_call_s)
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
