"""Inside the process, torch, NVML (pynvml) and cuMemGetInfo must agree on the memory view."""

from __future__ import annotations

import pynvml
import torch
from _common import emit


def main() -> None:
    x = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")  # 256 MiB
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    emit(
        torch_free=free,
        torch_total=total,
        nvml_total=info.total,
        nvml_free=info.free,
        nvml_used=info.used,
        held=int(x.numel()),
    )


if __name__ == "__main__":
    main()
