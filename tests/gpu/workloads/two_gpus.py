"""One process computing on two GPUs at once (PyTorch), for issue 12 item 3 / issue 16.

usage: two_gpus.py SECONDS MIB [MIB1]

One thread per GPU (cuda:0 and cuda:1): MIB MiB of float32 on that GPU (MIB1 on cuda:1 when
given), and a scratch tensor as large, then `x += 1` in steps of
~20 ms until SECONDS have passed. After every step it prints {"event": "step", "dev": n,
"t": time.monotonic()}; at the end {"event": "done", "dev": n, "steps": k, "correct": bool} (the
tensor holds exactly the number of steps). The test reads the step times to see which GPU ran
when.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import torch

LOCK = threading.Lock()


def say(**fields: object) -> None:
    with LOCK:
        print(json.dumps(fields), flush=True)


def work(dev: int, seconds: float, mib: int, results: dict[int, bool]) -> None:
    torch.cuda.set_device(dev)
    x = torch.zeros(mib * (1 << 20) // 4, device=f"cuda:{dev}")
    y = torch.empty_like(x)
    steps = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.02:  # ~20 ms of work per step, whatever the GPU
            torch.add(x, 0, out=y)
        x += 1
        torch.cuda.synchronize(dev)
        steps += 1
        say(event="step", dev=dev, t=time.monotonic())
    correct = bool((x == steps).all().item())
    results[dev] = correct
    say(event="done", dev=dev, steps=steps, correct=correct)


def main() -> None:
    seconds, mib = float(sys.argv[1]), int(sys.argv[2])
    mibs = {0: mib, 1: int(sys.argv[3]) if len(sys.argv) > 3 else mib}
    assert torch.cuda.device_count() >= 2, "needs two visible GPUs"
    results: dict[int, bool] = {}
    torch.zeros(1, device="cuda:0")  # GPU 0's context first: the process registers there first
    threads = [threading.Thread(target=work, args=(d, seconds, mibs[d], results)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sys.exit(0 if results == {0: True, 1: True} else 1)


if __name__ == "__main__":
    main()
