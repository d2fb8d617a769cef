"""torch.multiprocessing sharing a CUDA tensor with a spawned child (CUDA IPC).

The parent fills a tensor, sends it through a queue (torch calls cuIpcGetMemHandle), the child
checks what it sees and adds 1 in place, then holds the tensor until told to exit; the parent
checks its own tensor changed and reads the shim's pinned bytes while the child holds the import
and after the child is gone (memory a peer maps is pinned, not evictable). Prints one JSON
record: ok, the sums, the pinned bytes, or the error the parent got.
"""

from __future__ import annotations

import time
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp
from _common import emit, shim_status


def child(q, done, leave) -> None:  # type: ignore[no-untyped-def]
    t = q.get()
    seen = float(t.sum())
    t.add_(1.0)
    torch.cuda.synchronize()
    done.put(seen)
    leave.get(timeout=120)  # keep the import open while the parent looks


def pinned() -> int | None:
    status = shim_status()
    return status["pinned_bytes"] if status else None


def main() -> None:
    ctx = mp.get_context("spawn")
    q, done, leave = ctx.Queue(), ctx.Queue(), ctx.Queue()
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    expected = float(x.sum())
    p = ctx.Process(target=child, args=(q, done, leave))
    p.start()
    t0 = time.monotonic()
    try:
        # Pickle here first: a Queue pickles in its feeder thread, where torch's error (from
        # cuIpcGetMemHandle) would be printed and the child would wait for ever.
        ForkingPickler.dumps(x)
        q.put(x)
        seen = done.get(timeout=90)
    except Exception as exc:  # the error torch raised in the parent (or the child never answered)
        p.kill()
        emit(ok=False, error=f"{type(exc).__name__}: {exc}")
        return
    shared_s = time.monotonic() - t0
    after = float(x.sum())
    pinned_imported = pinned()
    leave.put(1)
    p.join(60)
    time.sleep(1.0)  # the exporter notices the importer's end on its socket
    emit(
        ok=seen == expected and after == expected + x.numel() and p.exitcode == 0,
        seen=seen,
        after=after,
        shared_seconds=shared_s,
        pinned_while_imported=pinned_imported,
        pinned_after_importer_left=pinned(),
    )


if __name__ == "__main__":
    main()
