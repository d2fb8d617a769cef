"""torch.multiprocessing sharing a CUDA tensor with a spawned child (CUDA IPC).

The parent fills a tensor, sends it through a queue (torch calls cuIpcGetMemHandle), the child
adds 1 in place and reports the sum it saw; the parent checks its own tensor changed. Prints one
JSON record: ok, the sums, or the error the parent got.
"""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp
from _common import emit


def child(q, done) -> None:  # type: ignore[no-untyped-def]
    t = q.get()
    seen = float(t.sum())
    t.add_(1.0)
    torch.cuda.synchronize()
    done.put(seen)


def main() -> None:
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Queue()
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    expected = float(x.sum())
    p = ctx.Process(target=child, args=(q, done))
    p.start()
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
    p.join(60)
    after = float(x.sum())
    emit(ok=seen == expected and after == expected + x.numel(), seen=seen, after=after)


if __name__ == "__main__":
    main()
