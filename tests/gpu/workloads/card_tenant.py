"""A notebook-sized tenant of the card, driven line by line (tests/gpu/test_gpu_card.py).

    card_tenant.py GIB

Starts CUDA with a small tensor and prints {"event": "started"}; then reads commands on stdin:

- ``alloc``: allocates GIB GiB in 1 GiB tensors, each filled with its own arange (the cell that
  may have to wait for room), and prints ``allocated`` with ``seconds`` (from the command to the
  data written, synchronised);
- ``busy S``: adds 1 to every tensor (and takes it off again) for S seconds, prints ``busy_done``;
- ``check``: compares every tensor with what it must hold, 1 GiB at a time (no second copy of the
  whole), prints ``checked`` with ``correct`` and ``first_call_s`` (the first GPU call: a restore
  it waits for);
- ``exit``.

Each line it prints is one JSON object (the shim's status added by _common.emit).
"""

from __future__ import annotations

import os
import sys
import time

import torch
from _common import emit

CHUNK = (1 << 30) // 4  # int32 elements in 1 GiB


def expected(i: int) -> torch.Tensor:
    return torch.arange(i * CHUNK, (i + 1) * CHUNK, dtype=torch.int64, device="cuda").to(
        torch.int32
    )


def main() -> int:
    gib = int(sys.argv[1])
    torch.ones(1, device="cuda").sum().item()  # the context, before any timed command
    emit(event="started", pid=os.getpid())
    chunks: list[torch.Tensor] = []
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "alloc":
            t0 = time.perf_counter()
            for i in range(gib):
                t = torch.empty(CHUNK, dtype=torch.int32, device="cuda")
                t.copy_(expected(i))
                chunks.append(t)
            torch.cuda.synchronize()
            emit(event="allocated", seconds=time.perf_counter() - t0, bytes=gib << 30)
        elif words[0] == "busy":
            seconds, t0, k = float(words[1]), time.perf_counter(), 0
            while time.perf_counter() - t0 < seconds:
                for t in chunks:
                    t.add_(1)
                for t in chunks:
                    t.sub_(1)
                torch.cuda.synchronize()
                k += 1
            emit(event="busy_done", rounds=k)
        elif words[0] == "check":
            t0 = time.perf_counter()
            first = int(chunks[-1][-1].item()) if chunks else 0  # waits for any restore
            first_call_s = time.perf_counter() - t0
            correct = all(bool(torch.equal(t, expected(i))) for i, t in enumerate(chunks))
            emit(event="checked", correct=correct, first_call_s=first_call_s, last=first)
        elif words[0] == "exit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
