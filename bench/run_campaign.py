"""Run the GPU benchmark campaign (or a part of it) and write one JSON record per benchmark.

    python -m bench.run_campaign OUT_DIR [--only launch,train,handoff,kernel_start,replay]

Writes OUT_DIR/<benchmark>.json (launch_overhead, train_overhead, handoff, memory, kernel_start,
replay) and OUT_DIR/campaign.log (everything printed). Each record carries the device, driver,
CUDA, torch version, date, git commit and the exact command. ``python -m bench.report OUT_DIR``
turns them into docs/performance.md and its plots. Parts and their time on an H100:

    launch        ~1 min     empty kernels, in-process A/B, driver vs shim (launch_overhead.py)
    train         ~1.5 min   a small ResNet, plain vs shim, alternating (train_overhead.py)
    handoff       ~2.5 min   handoff latency; memory movement vs pinned memcpy (handoff.py)
    kernel_start  ~1.5 min   Jupyter kernel start-to-ready, provisioner vs plain, 20 rotations
    replay        ~7.5 min   8 notebook users: gpushare, co-location, fixed-quantum (replay.py)
    replay-real   ~9 min     8 users at real time (--real-horizon 420 s), gpushare only, and
                             the simulator on the same cells (replay.py; docs/performance.md);
                             --real-shape nbmix replays the notebook-shaped trace instead
    nbmix         no GPU     the simulator on the nbmix trace, before/after (nbmix.py; ~10 CPU
                             minutes at --nbmix-seeds 20)
    nbmix-replay  ~7.5 min   the shortened nbmix trace, 8 users, ~260 cells in 360 s, from a warm
                             pool, gpushare only, and the simulator on the same cells with this
                             run's costs (replay_nbmix.py); writes nbmix_replay.json (checkpointed
                             every 30 s) and nbmix_replay.txt

``--driver-dir DIR`` runs every part but ``train`` against the tests' stand-in driver (a
directory holding its libcuda.so.1), the workers on ctypes instead of PyTorch: for checking the
harnesses without a GPU. Such records say ``"driver": "stand-in"`` and the report labels them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from .common import record, write_json

PARTS = (
    "launch", "train", "handoff", "kernel_start", "replay", "replay-real", "nbmix", "nbmix-replay"
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="directory for the result files")
    ap.add_argument(
        "--only", default=",".join(PARTS), help=f"comma-separated parts of: {', '.join(PARTS)}"
    )
    ap.add_argument("--driver-dir", help="a directory holding a stand-in libcuda.so.1 (no GPU)")
    ap.add_argument(
        "--launch-rounds", type=int, default=200, help="in-process A/B rounds per launch API"
    )
    ap.add_argument(
        "--launch-pairs", type=int, default=0, help="also the older process pairs (0: no)"
    )
    ap.add_argument("--train-pairs", type=int, default=8)
    ap.add_argument("--handoffs", type=int, default=200, help="handoffs without memory to move")
    ap.add_argument(
        "--handoff-sizes", default="1,2,4,8,16", help="GiB per process, comma-separated"
    )
    ap.add_argument(
        "--arrival-gib",
        type=float,
        default=0,
        help="also: a kernel arriving at idle, pre-copied kernels of this many GiB (0: no)",
    )
    ap.add_argument("--arrival-idle", type=int, default=3, help="idle kernels for --arrival-gib")
    ap.add_argument(
        "--arrival-keep-free",
        default="auto",
        help="keep_free of the second --arrival-gib run (room kept before the arrival; the "
        "first runs with 0: room made in its wait). 0: only the first",
    )
    ap.add_argument("--kernel-pairs", type=int, default=20)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--horizon", type=float, default=100.0, help="replay length (seconds)")
    ap.add_argument(
        "--think", type=float, default=4.0, help="mean think time (seconds; time-scaled trace)"
    )
    ap.add_argument("--gpu-median", type=float, default=0.12, help="median GPU s per cell")
    ap.add_argument("--grace", type=float, default=20.0, help="seconds before cutting cells")
    ap.add_argument("--pool-gib", type=float, default=40.0)
    ap.add_argument(
        "--memory-scale",
        type=float,
        default=1.0,
        help="replay: working sets x this (the stand-in's device memory is host memory)",
    )
    ap.add_argument("--real-shape", default="uniform", help="replay-real's trace: uniform, nbmix")
    ap.add_argument("--nbmix-seeds", type=int, default=20, help="seeds per nbmix point")
    ap.add_argument("--replay-modes", default="gpushare,colocate,fixed-quantum")
    ap.add_argument(
        "--real-horizon", type=float, default=420.0, help="replay-real: seconds of arrivals"
    )
    ap.add_argument("--real-modes", default="gpushare", help="replay-real: modes, in order")
    ap.add_argument("--real-grace", type=float, default=30.0, help="replay-real: grace seconds")
    ap.add_argument(
        "--nbmix-horizon", type=float, default=360.0, help="nbmix-replay: seconds of arrivals"
    )
    ap.add_argument("--nbmix-grace", type=float, default=20.0, help="nbmix-replay: grace s")
    ap.add_argument(
        "--nbmix-memory-scale",
        type=float,
        default=0.0,
        help="nbmix-replay: working sets x this (0: by the card, see bench/replay_nbmix.py)",
    )
    ap.add_argument(
        "--nbmix-pool-gib", type=float, default=0.0, help="nbmix-replay: pool (0: by the form)"
    )
    ap.add_argument(
        "--progress-s", type=float, default=30.0, help="nbmix-replay: s between checkpoints"
    )
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)}; known: {', '.join(PARTS)}")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    command = [Path(sys.executable).name, "-m", "bench.run_campaign", *(argv or sys.argv[1:])]
    args.command = command
    logfile = (out / "campaign.log").open("a")

    def log(text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {text}"
        print(line, flush=True)
        logfile.write(line + "\n")
        logfile.flush()

    log(f"campaign: {shlex.join(command)}")
    if args.driver_dir:
        # Every child (workers, kernels, the launch program) finds the stand-in driver first.
        paths = [str(Path(args.driver_dir).resolve()), os.environ.get("LD_LIBRARY_PATH", "")]
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in paths if p)
        os.environ["GPUSHARE_BENCH_BACKEND"] = "standin"
        os.environ.setdefault("GPUSHARE_FAKE_DEVICE_TOTAL", "80GiB")
    work = Path(tempfile.mkdtemp(prefix="gsb-work-"))
    failed = []
    for part in parts:
        t0 = time.monotonic()
        try:
            records = _run_part(part, args, work, log)
        except Exception:  # one broken part must not cost the others' results
            log(f"{part}: FAILED\n{traceback.format_exc()}")
            failed.append(part)
            continue
        for name, fields in records.items():
            fields["duration_s"] = round(time.monotonic() - t0, 1)
            fields["driver"] = "stand-in" if args.driver_dir else "system"
            write_json(out / f"{name}.json", record(name, command, **fields))
        log(f"{part}: done in {time.monotonic() - t0:.0f} s")
    # The scheduler logs of every part, for whoever needs to look closer (kept small).
    logs = sorted(work.glob("**/*.log"))
    with (out / "scheduler-logs.txt").open("w") as fh:
        for p in logs:
            text = p.read_text(errors="replace")
            fh.write(f"==== {p.name} ({len(text)} bytes; last 200 kB)\n{text[-200_000:]}\n")
    log("campaign: " + (f"FAILED parts: {', '.join(failed)}" if failed else "all parts done"))
    return 1 if failed else 0


def _run_part(part: str, args: Any, work: Path, log: Any) -> dict[str, dict[str, Any]]:
    if part == "launch":
        from . import launch_overhead

        return {
            "launch_overhead": launch_overhead.run(
                work / part,
                args.launch_pairs,
                driver_dir=args.driver_dir,
                log=log,
                rounds=args.launch_rounds,
            )
        }
    if part == "kernel_start":
        from . import kernel_start

        res = kernel_start.run(
            work / part, args.kernel_pairs, no_nvml=bool(args.driver_dir), log=log
        )
        return {"kernel_start": res}
    if part == "train":
        if args.driver_dir:
            raise RuntimeError("train needs PyTorch on a GPU (not the stand-in driver)")
        from . import train_overhead

        return {"train_overhead": train_overhead.run(work / part, args.train_pairs, log=log)}
    if part == "handoff":
        from . import handoff

        sizes = tuple(float(x) for x in args.handoff_sizes.split(",") if x)
        memcpy = 0 if args.driver_dir else 4 << 30  # the stand-in has no memcpy to compare
        ho, mem = handoff.run(
            work / part,
            args.handoffs,
            sizes,
            memcpy_bytes=memcpy,
            log=log,
            arrival_gib=args.arrival_gib,
            arrival_idle=args.arrival_idle,
            arrival_keep_free=args.arrival_keep_free,
        )
        return {"handoff": ho, "memory": mem}
    if part == "replay":
        from . import replay
        from .trace import TraceConfig

        tc = TraceConfig(
            users=args.users,
            seed=args.seed,
            horizon=args.horizon,
            think_mean=args.think,
            gpu_median=args.gpu_median,
            memory_scale=args.memory_scale,
        )
        modes = tuple(m for m in args.replay_modes.split(",") if m)

        def checkpoint(partial: dict[str, Any]) -> None:
            write_json(args.out / "replay.json", record("replay", args.command, **partial))

        res = replay.run(work / part, tc, args.pool_gib, modes, args.grace, log, checkpoint)
        return {"replay": res}
    if part == "replay-real":
        from . import replay
        from .trace import TIME_SCALE, TraceConfig, scaled

        # The default trace at real time: think and GPU times TIME_SCALE x, same duty cycle.
        tc = scaled(TraceConfig(users=args.users, seed=args.seed), TIME_SCALE, args.real_horizon)
        if args.real_shape == "nbmix":  # at real time already
            tc = TraceConfig(
                users=args.users, seed=args.seed, horizon=args.real_horizon, shape="nbmix"
            )
        modes = tuple(m for m in args.real_modes.split(",") if m)

        def checkpoint_real(partial: dict[str, Any]) -> None:
            rec = record("replay_real", args.command, **partial)
            write_json(args.out / "replay_real.json", rec)

        res = replay.run(
            work / part, tc, args.pool_gib, modes, args.real_grace, log, checkpoint_real,
            sweeps=False,
        )  # fmt: skip
        return {"replay_real": res}
    if part == "nbmix-replay":
        from . import replay_nbmix

        def checkpoint_nbmix(partial: dict[str, Any]) -> None:
            driver = "stand-in" if args.driver_dir else "system"
            rec = record("nbmix_replay", args.command, **partial, driver=driver)
            write_json(args.out / "nbmix_replay.json", rec)
            (args.out / "nbmix_replay.txt").write_text(replay_nbmix.summary_text(partial))

        res = replay_nbmix.run(
            work / part, args.users, args.seed, args.nbmix_horizon, args.nbmix_grace,
            args.nbmix_memory_scale, args.nbmix_pool_gib, log, checkpoint_nbmix, args.progress_s,
        )  # fmt: skip
        (args.out / "nbmix_replay.txt").write_text(replay_nbmix.summary_text(res))
        return {"nbmix_replay": res}
    if part == "nbmix":
        from . import nbmix

        nbmix.main([str(args.out), "--seeds", str(args.nbmix_seeds)])  # writes nbmix.json
        return {}
    raise AssertionError(part)


if __name__ == "__main__":
    sys.exit(main())
