"""PyTorch's cudaMallocAsync backend and a CUDA graph under a quota: what the pool keeps after
frees and what graph memory holds must be in the shim's count, equal to what the driver says,
and an allocation or a graph replay past the quota must fail with the shim's line; once room is
made, the refused replay runs.

Run with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync, GPUSHARE_MEMORY_LIMIT=2GiB and
GPUSHARE_CONTEXT_BYTES=512MiB (tests/gpu/test_gpu_reserves.py). Prints one JSON line per phase
({"phase": ...}, the shim's and the driver's numbers) and, after "freed", waits HOLD seconds
(argv[1]) for the test to read the scheduler's view."""

from __future__ import annotations

import ctypes
import sys
import time
from typing import Any

import torch
from _common import emit

MIB = 1 << 20
cuda = ctypes.CDLL("libcuda.so.1")  # through the shim's dlsym: hooked names get its wrappers


def driver_numbers() -> dict[str, int]:
    """The pools' and the graph pool's numbers on this device, from the driver itself."""
    dev = torch.cuda.current_device()
    pool = ctypes.c_void_p()
    assert cuda.cuDeviceGetMemPool(ctypes.byref(pool), dev) == 0
    out = {}
    for name, attr in (("pool_reserved", 5), ("pool_used", 7)):
        v = ctypes.c_uint64()
        assert cuda.cuMemPoolGetAttribute(pool, attr, ctypes.byref(v)) == 0
        out[name] = v.value
    for name, attr in (("graph_reserved", 2), ("graph_used", 0)):
        v = ctypes.c_uint64()
        assert cuda.cuDeviceGetGraphMemAttribute(dev, attr, ctypes.byref(v)) == 0
        out[name] = v.value
    return out


def driver_alloc(nbytes: int) -> tuple[int, int]:
    """cuMemAlloc through the shim (a path the pool cannot serve): (rc, pointer)."""
    ptr = ctypes.c_uint64()
    rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
    return rc, ptr.value


def phase(name: str, **fields: Any) -> None:
    torch.cuda.synchronize()
    emit(phase=name, driver=driver_numbers(), **fields)


def main() -> None:
    hold = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
    backend = torch.cuda.get_allocator_backend()
    small = torch.ones(1024, device="cuda")
    phase("start", backend=backend)

    # Stream-ordered pool: 6 x 128 MiB allocated, written, freed. PyTorch sets the pool's release
    # threshold to the maximum, so the pool keeps all of it.
    blocks = [torch.full((128 * MIB,), i, dtype=torch.uint8, device="cuda") for i in range(6)]
    sums_ok = all(int(b[-1]) == i for i, b in enumerate(blocks))
    phase("allocated", sums_ok=sums_ok)
    del blocks
    phase("freed")
    if hold:
        time.sleep(hold)
    # 1 GiB more by cuMemAlloc: 0.5 (context) + 1 fits the 2 GiB quota only if the pool's
    # 0.75 GiB reserve is forgotten.
    rc, ptr = driver_alloc(1024 * MIB)
    if rc == 0:
        cuda.cuMemFree_v2(ctypes.c_uint64(ptr))
    phase("alloc_after_free", rc=rc)
    torch.cuda.empty_cache()  # cudaMallocAsync: trims the pool
    rc, ptr = driver_alloc(1024 * MIB)
    if rc == 0:
        cuda.cuMemFree_v2(ctypes.c_uint64(ptr))
    phase("trimmed", rc=rc)

    # CUDA graphs whose captured allocations outlive the capture (mem-alloc nodes).
    g1, g2, g3 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1):
        out1 = torch.empty(640 * MIB, dtype=torch.uint8, device="cuda")
        out1.fill_(1)
    with torch.cuda.graph(g2):
        out2 = torch.empty(1024 * MIB, dtype=torch.uint8, device="cuda")
        out2.fill_(2)
    with torch.cuda.graph(g3):
        out3 = torch.empty(1024 * MIB, dtype=torch.uint8, device="cuda")
        out3.fill_(3)
    phase("captured")
    g1.replay()
    g1.replay()  # relaunch: auto-free-on-launch reuses the first launch's memory
    ok1 = int(out1[:4096].sum()) == 4096
    phase("replayed", ok=ok1)
    # 512 + 640 + 1024 MiB: past the quota. The replay must fail before the driver backs it.
    error = ""
    try:
        g2.replay()
        torch.cuda.synchronize()
    except RuntimeError as e:
        error = str(e).splitlines()[0]
    phase("replay_over_quota", error=error)
    # g2 never ran: out2 has an address and no memory, and the driver refuses to free it
    # (cudaErrorInvalidValue, a terminate in PyTorch's deleter). Dropping it must just work.
    del out2, g2
    torch.cuda.synchronize()
    phase("dropped_refused")
    g1.replay()
    ok_after = int(out1[:4096].sum()) == 4096 and float((small * 2).sum()) == 2048.0
    phase("usable_after_refusal", ok=ok_after)
    # Make room as a user would: drop g1's output and give the graph pool's memory back; then a
    # replay of the same size as the refused one fits (512 + 1024 MiB and the pool's few MiB).
    del out1
    torch.cuda.synchronize()
    dev = torch.cuda.current_device()
    assert cuda.cuDeviceGraphMemTrim(dev) == 0
    phase("room_made")
    g3.replay()
    ok3 = int(out3[:4096].sum()) == 3 * 4096
    phase("replayed_after_room", ok=ok3)
    del out3, g1, g3
    torch.cuda.synchronize()
    assert cuda.cuDeviceGraphMemTrim(dev) == 0
    phase("graph_trimmed")


if __name__ == "__main__":
    main()
