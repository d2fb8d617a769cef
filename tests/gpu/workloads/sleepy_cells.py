"""A notebook kernel's life in one process: hold GIB GiB of known data, then run one cell per
line of stdin, going quiet in between (deep idle puts the process to sleep then).

    sleepy_cells.py GIB

Prints {"event": "ready", "pid": ...} once the data is on the GPU. A line
"ALLOC_GIB BLOCK_GIB FILL DRAIN_S" is a cell: its first GPU call is timed (``first_call_s``: a
wake, the restore and the call); it allocates ALLOC_GIB GiB of int32 equal to FILL in tensors of
BLOCK_GIB GiB, sums them exactly (int64), frees them and empties PyTorch's cache, checks the held
data element by element (``cell_s``: all of it). Then, for at most DRAIN_S seconds, it watches
the shim's host staging (prepared in the background for each new block) come back to no more than
the device memory the shim still manages for it (``staging_left``: the excess at the end). Prints
{"event": "done", ...}. End of input ends the process.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from _common import emit, shim_status

GIB = 1 << 30


def staging_excess() -> int:
    """Host staging the shim holds beyond the device memory it manages for the process (staging
    exists for those blocks only); 0 unshimmed."""
    status = shim_status()
    if status is None:
        return 0
    staging = status["staging_pinned_bytes"] + status["staging_pageable_bytes"]
    return max(0, staging - status["managed_bytes"])


def damage(held: torch.Tensor, n: int) -> dict[str, object]:
    """Where the held data is wrong and what is there instead (which memory it came from: zeros
    for memory never copied back, a cell's FILL for another block's memory)."""
    wrong = (held != torch.arange(n, dtype=torch.int32, device="cuda")).nonzero().flatten()
    first, last = int(wrong[0].item()), int(wrong[-1].item())
    values, counts = torch.unique(held[wrong], return_counts=True)
    top = sorted(zip(counts.tolist(), values.tolist(), strict=True), reverse=True)[:5]
    return {
        "wrong_elements": int(wrong.numel()),
        "first_wrong_byte": first * 4,
        "last_wrong_byte": last * 4 + 3,
        "most_common_wrong_values": [[v, c] for c, v in top],
    }


def main() -> int:
    n = int(float(sys.argv[1]) * GIB) // 4
    held = torch.arange(n, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    emit(event="ready", pid=os.getpid(), bytes=n * 4)
    while line := sys.stdin.readline():
        fields = line.split()
        alloc_gib, block_gib, fill, drain_s = (
            float(fields[0]),
            float(fields[1]),
            int(fields[2]),
            float(fields[3]),
        )
        t0 = time.perf_counter()
        last = int(held[-1].item())  # the first GPU call: wakes the process
        first_call_s = time.perf_counter() - t0
        per_block = int(block_gib * GIB) // 4
        blocks = [
            torch.full((per_block,), fill, dtype=torch.int32, device="cuda")
            for _ in range(round(alloc_gib / block_gib))
        ]
        zero = torch.zeros((), dtype=torch.int64, device="cuda")
        total = sum((block.sum() for block in blocks), zero)
        expected_sum = per_block * len(blocks) * fill
        big_sum_ok = int(total.item()) == expected_sum
        status = shim_status()
        counted = status["used_bytes"] if status else 0
        allocated = per_block * 4 * len(blocks)
        del blocks
        torch.cuda.empty_cache()
        intact = last == n - 1 and bool(
            torch.equal(held, torch.arange(n, dtype=torch.int32, device="cuda"))
        )
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        cell_s = time.perf_counter() - t0
        held_damage = {} if intact else damage(held, n)
        drained = time.perf_counter()
        while staging_excess() > 0 and time.perf_counter() - drained < drain_s:
            time.sleep(0.1)
        emit(
            event="done",
            correct=intact and big_sum_ok,
            held_intact=intact,
            held_first_value=last,
            held_damage=held_damage,
            big_sum_ok=big_sum_ok,
            allocated=allocated,
            used_during_cell=counted,
            first_call_s=first_call_s,
            cell_s=cell_s,
            staging_left=staging_excess(),
            staging_wait_s=time.perf_counter() - drained,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
