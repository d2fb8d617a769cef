"""The memory engine's pre-copy without the shim: does a device-to-host copy into freshly
registered host memory arrive whole? (A diagnosis of the deep-idle regression: a pre-copy into
staging registered just before it lost the start of what it wrote, 0.1-3.5 ms of the copy's
progress, on an H100; docs/gpu-verification.md.)

    register_then_copy.py GIB WAY

Holds GIB GiB of int32 0, 1, 2, ... on the GPU; maps as much anonymous host memory (huge pages
advised), populates it (MADV_POPULATE_WRITE), registers it with the driver (portable, as the
shim's staging is) and copies the device data into it on a stream, then checks it at once and
again 1 s later. WAY: ``now`` copies right after registering (what the shim does), ``pause``
50 ms after, ``sync`` after a device synchronisation. Prints one JSON line.
"""

from __future__ import annotations

import json
import mmap
import sys
import time

import torch

MADV_POPULATE_WRITE = 23


def damage(host: torch.Tensor, want: torch.Tensor) -> dict[str, int]:
    wrong = (host != want).nonzero().flatten()
    if not wrong.numel():
        return {}
    zeros = int((host[wrong] == 0).sum())
    return {
        "wrong_elements": int(wrong.numel()),
        "first_wrong_byte": int(wrong[0]) * 4,
        "last_wrong_byte": int(wrong[-1]) * 4 + 3,
        "zeros": zeros,
    }


def main() -> int:
    gib, way = float(sys.argv[1]), sys.argv[2]
    size = int(gib * (1 << 30))
    n = size // 4
    device = torch.arange(n, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    want = torch.arange(n, dtype=torch.int32)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    t0 = time.perf_counter()
    buf.madvise(MADV_POPULATE_WRITE)
    host = torch.frombuffer(buf, dtype=torch.int32)
    populated_s = time.perf_counter() - t0
    rc = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), size, 1)  # portable
    registered_s = time.perf_counter() - t0 - populated_s
    if way == "pause":
        time.sleep(0.05)
    elif way == "sync":
        torch.cuda.synchronize()
    stream = torch.cuda.Stream(priority=0)
    t1 = time.perf_counter()
    with torch.cuda.stream(stream):
        host.copy_(device, non_blocking=True)
    stream.synchronize()
    copy_s = time.perf_counter() - t1
    at_once = damage(host, want)
    time.sleep(1.0)
    later = damage(host, want)
    print(
        json.dumps(
            {
                "way": way,
                "register_rc": int(rc),
                "pinned": bool(host.is_pinned()),
                "populated_s": round(populated_s, 3),
                "registered_s": round(registered_s, 3),
                "copy_gbps": round(size / copy_s / 1e9, 1),
                "damage": at_once,
                "damage_1s_later": later,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
