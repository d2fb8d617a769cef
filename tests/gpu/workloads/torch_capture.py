"""Capture CUDA graphs over and over for SECONDS, holding GIB GiB, and count what failed.

Each round captures a short chain of kernels with torch.cuda.graph (global capture mode, as
torch.compile's reduce-overhead mode does), replays it and checks the result exactly; between
rounds it adds 1.0 to a GIB-sized tensor (ordinary work, so that the process wants the GPU and
the scheduler's revokes and evictions fall in the middle of captures)."""

from __future__ import annotations

import sys
import time

import torch
from _common import emit


def main() -> None:
    seconds, gib = float(sys.argv[1]), float(sys.argv[2])
    big = torch.zeros(int(gib * (1 << 30)) // 4, dtype=torch.float32, device="cuda")
    static_in = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
    expected = static_in * 2.0 + 3.0
    rounds = errors = wrong = 0
    messages: list[str] = []
    k = 0
    end = time.time() + seconds
    while time.time() < end:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = static_in * 2.0
                for _ in range(8):
                    out = out + 0.375
            graph.replay()
            torch.cuda.synchronize()
            wrong += int(not torch.equal(out, expected))
            rounds += 1
        except RuntimeError as exc:  # "operation failed due to a previous error during capture"
            errors += 1
            if len(messages) < 3:
                messages.append(str(exc)[:300])
        big.add_(1.0)
        k += 1
    torch.cuda.synchronize()
    emit(
        rounds=rounds,
        errors=errors,
        wrong=wrong,
        messages=messages,
        big_ok=bool(torch.all(big == float(k)).item()),
    )


if __name__ == "__main__":
    main()
