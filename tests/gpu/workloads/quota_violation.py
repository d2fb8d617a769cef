"""Allocate more than the quota: PyTorch must raise OutOfMemoryError, the process must survive."""

from __future__ import annotations

import sys

import torch
from _common import emit


def main() -> None:
    gib = float(sys.argv[1])
    small = torch.ones(1024, device="cuda")
    error = ""
    try:
        torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        error = str(e).splitlines()[0]
    # The process is still usable after the refusal.
    total = float((small * 2).sum())
    emit(oom=bool(error), error=error, after=total, mem_get_info=list(torch.cuda.mem_get_info()))


if __name__ == "__main__":
    main()
