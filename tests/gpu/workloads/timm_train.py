"""A timm ResNet-18 built with pretrained=False (no download), trained STEPS steps with SGD and
momentum on random 64x64 images (BatchNorm in training mode: running statistics are checked too).

    timm_train.py STEPS
"""

from __future__ import annotations

import sys

import timm
import torch
from _programs import Pressure, deterministic, hex_floats, params_sha256


def main() -> None:
    steps = int(sys.argv[1])
    deterministic(0)
    pressure = Pressure()
    model = timm.create_model("resnet18", pretrained=False, num_classes=10).to("cuda")
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(8, 32, 3, 64, 64, generator=gen).to("cuda")
    labels = torch.randint(0, 10, (8, 32), generator=gen).to("cuda")
    pressure.start()
    losses = []
    for step in range(steps):
        i = step % images.shape[0]
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(images[i]), labels[i])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    pressure.finish(
        losses=hex_floats(losses),
        params_sha256=params_sha256(model.parameters()),
        buffers_sha256=params_sha256(b for b in model.buffers() if b.is_floating_point()),
        steps=steps,
    )


if __name__ == "__main__":
    main()
