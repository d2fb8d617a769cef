"""Lightning's Trainer fitting a small LightningModule for STEPS steps on one GPU, as its users
write it (deterministic=True, no logger, no checkpoints, no progress bar).

    lightning_fit.py STEPS

Uses lightning.pytorch, or pytorch_lightning where only that one is installed.
"""

from __future__ import annotations

import sys

import torch
from _programs import Pressure, deterministic, hex_floats, params_sha256

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl


class Regressor(pl.LightningModule):
    def __init__(self, on_start: Pressure) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(256, 1024),
            torch.nn.GELU(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(1024, 1024),
            torch.nn.GELU(),
            torch.nn.Linear(1024, 16),
        )
        self.losses: list[float] = []
        self.pressure = on_start

    def on_train_start(self) -> None:
        self.pressure.start()

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    steps = int(sys.argv[1])
    pl.seed_everything(0, workers=True)
    deterministic(0)
    pressure = Pressure()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 256, generator=gen)
    y = torch.randn(4096, 16, generator=gen)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y),
        batch_size=256,
        shuffle=True,
        num_workers=0,
        generator=torch.Generator().manual_seed(2),
    )
    module = Regressor(pressure)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=steps,
        deterministic=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    assert trainer.global_step == steps, trainer.global_step
    pressure.finish(
        losses=hex_floats(module.losses),
        params_sha256=params_sha256(module.parameters()),
        steps=trainer.global_step,
    )


if __name__ == "__main__":
    main()
