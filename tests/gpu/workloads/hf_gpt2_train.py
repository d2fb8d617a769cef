"""A Hugging Face transformers GPT-2, built from a config (no download), trained STEPS steps with
AdamW on random token ids, dropout on.

    hf_gpt2_train.py STEPS

Attention runs through PyTorch's math backend of scaled_dot_product_attention: the fused
backends' backward passes are not bit-reproducible run to run, which would say nothing of the shim.
"""

from __future__ import annotations

import sys

import torch
from _programs import Pressure, deterministic, hex_floats, params_sha256
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import GPT2Config, GPT2LMHeadModel


def main() -> None:
    steps = int(sys.argv[1])
    deterministic(0)
    pressure = Pressure()
    config = GPT2Config(
        vocab_size=1000, n_positions=128, n_embd=128, n_layer=2, n_head=4, n_inner=512
    )
    model = GPT2LMHeadModel(config).to("cuda")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (32, 16, 128), generator=gen).to("cuda")
    pressure.start()
    losses = []
    with sdpa_kernel(SDPBackend.MATH):
        for step in range(steps):
            batch = tokens[step % tokens.shape[0]]
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
    pressure.finish(
        losses=hex_floats(losses), params_sha256=params_sha256(model.parameters()), steps=steps
    )


if __name__ == "__main__":
    main()
