"""A small model under torch.compile, trained STEPS steps with AdamW, then evaluated.

    compiled_train.py MODE STEPS      (MODE: default | reduce-overhead)

reduce-overhead runs the compiled graphs as CUDA graphs (cudagraph trees, their own memory pool);
each step begins with torch.compiler.cudagraph_mark_step_begin(), as its documentation asks of a
training loop. Under torch.use_deterministic_algorithms(True) Inductor benchmarks nothing whose
choice changes numbers; the test also gives the three runs one Inductor cache.
"""

from __future__ import annotations

import sys

import torch
from _programs import Pressure, deterministic, hex_floats, params_sha256, tensor_sha256


def main() -> None:
    mode, steps = sys.argv[1], int(sys.argv[2])
    deterministic(0)
    pressure = Pressure()
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 2048),
        torch.nn.GELU(),
        torch.nn.LayerNorm(2048),
        torch.nn.Linear(2048, 2048),
        torch.nn.GELU(),
        torch.nn.Linear(2048, 10),
    ).to("cuda")
    compiled = torch.compile(model, mode=None if mode == "default" else mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    # Separate tensors, not views of one: the compiled graph sees the same input layout each step.
    inputs = [x.to("cuda") for x in torch.randn(8, 1024, 512, generator=gen).unbind(0)]
    labels = [y.to("cuda") for y in torch.randint(0, 10, (8, 1024), generator=gen).unbind(0)]
    graphs = mode == "reduce-overhead"
    pressure.start()
    losses = []
    for step in range(steps):
        i = step % len(inputs)
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(compiled(inputs[i]), labels[i])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        logits = compiled(inputs[0]).clone()
    pressure.finish(
        losses=hex_floats(losses),
        params_sha256=params_sha256(model.parameters()),
        eval_sha256=tensor_sha256(logits),
        steps=steps,
    )


if __name__ == "__main__":
    main()
