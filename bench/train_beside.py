"""A long training cell beside interactive users whose memory does not all fit (GPU; issue 21).

    python -m bench.train_beside OUT_DIR [--duration 60] [--driver-dir DIR]

One trainer (24 GiB, one long cell) and three users (8 GiB each) running 0.3 s cells every
2-4 s, pool 40 GiB, played by real worker processes under the scheduler (bench/replay.py's
harness: bench/worker.py, bench/procs.py): ordering "interactive" (gpushare), ordering "fair",
and the same kernels with no pool (80 GiB: everything fits). Writes OUT_DIR/train_beside.json
with, per case, the short cells' p50 and p95 latency over their solo time and the trainer's
throughput (its solo time over its latency), and the simulator's figures for the same users
(bench/nbmix.py's scenario). The trainer's cell is ``0.6 x duration`` of solo work, so it ends
inside the run unless it is slowed more than the grace allows. ~4 x duration on a GPU;
``--duration 60`` for a short run. ``--driver-dir``: the tests' stand-in driver (no GPU).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from .common import percentile, record, write_json
from .nbmix import training_beside, training_users
from .trace import TraceConfig, User

#: Short cells that arrive earlier are left out (every kernel allocates then: cold staging).
WARMUP = 10.0
TARGETS = {"short_p95_x": 2.5, "trainer_throughput": 0.75}


def users(duration: float, seed: int = 1) -> list[User]:
    """The scenario's users: the trainer's cell is 0.6 x duration of solo work, from 0.5 s."""
    return training_users(duration, seed, trainer_gpu=0.6 * duration, start=0.5)


def figures(run: dict[str, Any]) -> dict[str, Any]:
    """Short cells' latency over solo (p50, p95) and the trainer's throughput, from a run."""
    cells = [c for c in run.get("cells", []) if c.get("end") is not None and c.get("ok")]
    short = [
        (c["end"] - c["arrival"]) / c["solo"]
        for c in cells
        if c["user"] != "trainer" and c["arrival"] >= WARMUP
    ]
    train = [c for c in cells if c["user"] == "trainer"]
    thr = train[0]["solo"] / (train[0]["end"] - train[0]["arrival"]) if train else float("nan")
    return {
        "short_cells": len(short),
        "short_p50_x": percentile(short, 50),
        "short_p95_x": percentile(short, 95),
        "trainer_throughput": thr,
        "trainer_finished": bool(train),
    }


def main(argv: list[str] | None = None) -> int:
    from . import replay

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of interactive cells")
    ap.add_argument("--driver-dir", help="a directory holding a stand-in libcuda.so.1 (no GPU)")
    args = ap.parse_args(argv)
    if args.driver_dir:
        paths = [str(Path(args.driver_dir).resolve()), os.environ.get("LD_LIBRARY_PATH", "")]
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in paths if p)
        os.environ["GPUSHARE_BENCH_BACKEND"] = "standin"
        os.environ.setdefault("GPUSHARE_FAKE_DEVICE_TOTAL", "80GiB")
    tc = TraceConfig(users=4, horizon=args.duration)
    work = Path(tempfile.mkdtemp(prefix="gsb-train-"))
    grace = args.duration  # the trainer may run up to twice its solo time and still count
    cases: dict[str, Any] = {}
    for label, pool, modes in (
        ("pool 40 GiB", 40.0, ("gpushare", "gpushare-fair")),
        ("no pool", 80.0, ("gpushare",)),
    ):
        res = replay.run(
            work / label.replace(" ", "-"), tc, pool, modes, grace, print, sweeps=False,
            users=users(args.duration),
        )  # fmt: skip
        for m in modes:
            name = {"gpushare": "gpushare", "gpushare-fair": "fair"}[m]
            key = name if pool < 80 else "no pool"
            run = res["runs"].get(m, {})
            cases[key] = {"mode": m, "pool_gib": pool, **figures(run), "error": run.get("error")}
    met = {
        k: cases.get("gpushare", {}).get(k, float("nan")) <= v
        if k == "short_p95_x"
        else cases.get("gpushare", {}).get(k, float("nan")) >= v
        for k, v in TARGETS.items()
    }
    doc = record(
        "train_beside",
        duration_s=args.duration,
        cases=cases,
        targets=TARGETS,
        met=met,
        simulated=training_beside(args.duration, seeds=3),
        driver="stand-in" if args.driver_dir else "system",
    )
    write_json(args.out / "train_beside.json", doc)
    for k, c in cases.items():
        print(
            f"{k:<10} short p50 {c['short_p50_x']:.2f}x p95 {c['short_p95_x']:.2f}x "
            f"trainer {c['trainer_throughput']:.0%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
