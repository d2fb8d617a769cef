"""CuPy's CUDA IPC between two spawned processes (cupy.cuda.runtime.ipc*MemHandle).

The parent allocates an array straight from cudaMalloc (no memory pool, so the pointer is the
allocation's base), fills it and passes the handle's bytes to a child, which opens it, checks the
values, writes -1 into the first half and closes the handle; the parent checks the write. Prints
one JSON record.
"""

from __future__ import annotations

import multiprocessing as mp

import cupy
from _common import emit

N = 1 << 20


def child(handle: bytes, out) -> None:  # type: ignore[no-untyped-def]
    ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)
    mem = cupy.cuda.UnownedMemory(ptr, N * 4, None)
    a = cupy.ndarray((N,), dtype=cupy.float32, memptr=cupy.cuda.MemoryPointer(mem, 0))
    ok = bool((a == cupy.arange(N, dtype=cupy.float32)).all())
    a[: N // 2] = -1
    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.runtime.ipcCloseMemHandle(ptr)
    out.put(ok)


def main() -> None:
    cupy.cuda.set_allocator(None)
    a = cupy.arange(N, dtype=cupy.float32)
    cupy.cuda.runtime.deviceSynchronize()
    handle = cupy.cuda.runtime.ipcGetMemHandle(a.data.ptr)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=child, args=(handle, out))
    p.start()
    child_ok = out.get(timeout=90)
    p.join(60)
    host = cupy.asnumpy(a)
    written = bool((host[: N // 2] == -1).all()) and float(host[-1]) == N - 1
    emit(ok=child_ok and written and p.exitcode == 0, child_saw_values=child_ok, written=written)


if __name__ == "__main__":
    main()
