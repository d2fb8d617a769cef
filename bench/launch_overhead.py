"""Launch-path overhead of the shim, side by side in one run.

Builds bench/launch_overhead.c, then alternates runs without and with the shim (holding the
device, granted by a real scheduler) so drift hits both equally, and reports the added
nanoseconds per launch for cuLaunchKernel and cuLaunchKernelEx. Target: <= 50 ns.

    python bench/launch_overhead.py [--rounds 5] [--launches 200000] [--out results.json]

On a machine without a GPU, pass --driver-dir DIR holding a libcuda.so.1 (the tests' stand-in):
the number is then the shim's own cost over an almost free launch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "native"))
import build  # noqa: E402  (native/build.py: the one compiler command line)


def run(program: Path, api: str, launches: int, env: dict[str, str]) -> float:
    out = subprocess.run(
        [str(program), "--launches", str(launches), "--api", api],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=600,
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1])["ns_median"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--launches", type=int, default=200000)
    ap.add_argument(
        "--driver-dir", help="directory of a libcuda.so.1 to use instead of the system's"
    )
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gpushare-bench-"))
    program = build.build_program([ROOT / "bench" / "launch_overhead.c"], work / "launch_overhead")
    shim = build.build_shim(work / "libgpushare.so")
    sock = work / "scheduler.sock"
    base = dict(os.environ)
    if args.driver_dir:
        base["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in [args.driver_dir, base.get("LD_LIBRARY_PATH", "")] if p
        )
    scheduler = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter_gpushare",
            "scheduler",
            "--socket",
            str(sock),
            "--log-level",
            "WARN",
            *(["--no-nvml"] if args.driver_dir else []),
        ],
        env={
            **base,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")])),
        },
    )
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            if time.monotonic() > deadline or scheduler.poll() is not None:
                raise SystemExit("the scheduler did not start")
            time.sleep(0.05)
        shimmed = {**base, "LD_PRELOAD": str(shim), "GPUSHARE_SOCKET": str(sock)}
        results: dict[str, dict] = {}
        for api in ("kernel", "kernelex"):
            plain, under = [], []
            for _ in range(args.rounds):
                plain.append(run(program, api, args.launches, base))
                under.append(run(program, api, args.launches, shimmed))
            added = [u - p for p, u in zip(plain, under, strict=True)]
            results[api] = {
                "plain_ns": plain,
                "shim_ns": under,
                "added_ns_median": statistics.median(added),
                "target_ns": 50,
                "met": statistics.median(added) <= 50,
            }
            print(
                f"cuLaunch{'Kernel' if api == 'kernel' else 'KernelEx'}: "
                f"{statistics.median(plain):.1f} ns plain, {statistics.median(under):.1f} ns "
                f"under the shim, +{statistics.median(added):.1f} ns (target <= 50)"
            )
    finally:
        scheduler.terminate()
        scheduler.wait(timeout=10)
    record = {
        "benchmark": "launch_overhead",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "driver": "stand-in" if args.driver_dir else "system",
        "results": results,
    }
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
