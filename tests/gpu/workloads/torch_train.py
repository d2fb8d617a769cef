"""A fixed-seed training run whose every loss is printed as an exact hex float.

Run once without the shim and once under it: the losses must be equal bit for bit. A shim that
passes one argument wrong (the v1/v2 cuGetProcAddress mix-up of an earlier experiment) trains to
NaN or to slightly different numbers without crashing; this is the test that notices.
The allocator under test comes from PYTORCH_CUDA_ALLOC_CONF (default, expandable_segments:True,
backend:cudaMallocAsync).
"""

from __future__ import annotations

import hashlib
import os
import sys

import torch
from _common import emit


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)
    dev = torch.device("cuda")

    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 7 * 7, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    ).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(2048, 1, 28, 28, generator=gen)
    labels = torch.randint(0, 10, (2048,), generator=gen)
    images, labels = images.to(dev), labels.to(dev)

    losses = []
    for step in range(steps):
        idx = slice((step * 128) % 2048, (step * 128) % 2048 + 128)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(images[idx]), labels[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    emit(
        allocator=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"),
        losses=[float.hex(v) for v in losses],
        params_sha256=digest.hexdigest(),
        final_loss=losses[-1],
        mem_get_info=list(torch.cuda.mem_get_info()),
        torch_reserved=torch.cuda.memory_reserved(),  # what the allocator holds from the driver
    )


if __name__ == "__main__":
    main()
