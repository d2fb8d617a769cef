"""Whole-network CUDA graph capture as PyTorch's documentation shows it ("CUDA Graphs", whole
network capture): warm up on a side stream, capture forward, backward and optimizer step with
torch.cuda.graph, then replay STEPS times with new data copied into the static inputs.

    graph_train.py STEPS

Dropout inside the graph draws from the captured Philox state, advanced on every replay.
"""

from __future__ import annotations

import sys

import torch
from _programs import Pressure, deterministic, hex_floats, params_sha256


def main() -> None:
    steps = int(sys.argv[1])
    deterministic(0)
    pressure = Pressure()
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096),
        torch.nn.Dropout(p=0.2),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 1024),
        torch.nn.Dropout(p=0.1),
    ).to("cuda")
    loss_fn = torch.nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randn(16, 1024, 1024, generator=gen).to("cuda")
    targets = torch.randn(16, 1024, 1024, generator=gen).to("cuda")
    static_input = torch.zeros(1024, 1024, device="cuda")
    static_target = torch.zeros(1024, 1024, device="cuda")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(static_input), static_target).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = loss_fn(model(static_input), static_target)
        static_loss.backward()
        opt.step()

    pressure.start()
    losses = []
    for step in range(steps):
        static_input.copy_(inputs[step % inputs.shape[0]])
        static_target.copy_(targets[step % targets.shape[0]])
        graph.replay()
        losses.append(static_loss.item())
    pressure.finish(
        losses=hex_floats(losses), params_sha256=params_sha256(model.parameters()), steps=steps
    )


if __name__ == "__main__":
    main()
