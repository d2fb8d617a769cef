"""Shared by the workloads of test_gpu_programs.py: programs the project did not write (Hugging
Face transformers, timm, Lightning, torch.compile, CUDA graphs), run as their users run them.

Each workload seeds everything, trains or evaluates a fixed number of steps and prints one JSON
line: ``results`` (losses as exact hex floats, parameter checksums: what must be equal bit for bit
with and without the shim) and ``pressure`` (what the shim went through meanwhile; not compared).

Under memory pressure (the test's two processes on a pool where only one fits) two environment
variables shape the run, and change none of its numbers:
  PROGRAM_BALLAST_GIB  GiB of known bytes held on the GPU throughout and checked at the end, so
                       that two processes cannot both be resident and every turn moves memory;
  PROGRAM_BARRIER      "DIR:COUNT": once set up, wait until COUNT processes are set up, so that
                       their training steps overlap (imports take different times).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from _common import emit, shim_status

GIB = 1 << 30
BALLAST_BYTE = 0x5A
BARRIER_TIMEOUT_S = 180.0


def deterministic(seed: int = 0) -> None:
    """What PyTorch's reproducibility notes ask for (the test sets CUBLAS_WORKSPACE_CONFIG)."""
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


def params_sha256(params: Iterable[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().cpu().numpy().tobytes()).hexdigest()


def hex_floats(values: Iterable[float]) -> list[str]:
    return [float.hex(float(v)) for v in values]


class Pressure:
    """The ballast and the barrier of the module docstring; ``start()`` before the first step,
    ``finish(**results)`` prints the record."""

    def __init__(self) -> None:
        gib = float(os.environ.get("PROGRAM_BALLAST_GIB", "0"))
        self.ballast = (
            torch.full((int(gib * GIB),), BALLAST_BYTE, dtype=torch.uint8, device="cuda")
            if gib > 0
            else None
        )
        torch.cuda.synchronize()
        self.waits_at_start = 0
        self.started = 0.0

    def start(self) -> None:
        barrier = os.environ.get("PROGRAM_BARRIER", "")
        if barrier:
            folder, count = barrier.rsplit(":", 1)
            here = Path(folder)
            (here / str(os.getpid())).touch()
            deadline = time.monotonic() + BARRIER_TIMEOUT_S
            while len(list(here.iterdir())) < int(count):
                if time.monotonic() > deadline:
                    raise SystemExit(f"barrier: fewer than {count} processes in {folder}")
                time.sleep(0.02)
        status = shim_status()
        self.waits_at_start = status["waits"] if status else 0
        self.started = time.monotonic()

    def finish(self, **results: Any) -> None:
        torch.cuda.synchronize()
        train_seconds = time.monotonic() - self.started
        if self.ballast is not None:
            # By 64 MiB chunks: a comparison of the whole would take as much again, past the pool.
            results["ballast_intact"] = all(
                bool(torch.all(chunk == BALLAST_BYTE).item())
                for chunk in self.ballast.split(64 << 20)
            )
        status = shim_status()
        emit(
            results=results,
            pressure={
                "train_seconds": round(train_seconds, 3),
                "waits_during_training": (status["waits"] - self.waits_at_start) if status else 0,
            },
        )
