"""Launch-path overhead of the shim (benchmark 1a): empty-kernel launches, with and without.

Builds bench/launch_overhead.c (an empty PTX kernel launched through cuLaunchKernel or
cuLaunchKernelEx, timed in batches, the device held) and runs it as many short processes,
alternating without / with the shim (ABBA...), every process pinned to the same CPU core and
started without address-space randomisation. Each pair gives one difference of per-launch
medians; the result is the median of the paired differences with a distribution-free 95%
confidence interval. Alternation and pairing cancel slow drift (clocks, thermals); the fixed
core and address layout take away process-to-process differences (which core, which cache
sets) that hid a few tens of nanoseconds behind a few hundred in earlier runs.

    python -m bench.launch_overhead [--pairs 30] [--launches 50000] [--out FILE]

Without a GPU, ``--driver-dir DIR`` names a directory holding a libcuda.so.1 (the tests'
stand-in): the number is then the shim's own cost over an almost free launch.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .common import ROOT, child_env, median_ci, record, write_json
from .common import scheduler as start_scheduler

sys.path.insert(0, str(ROOT / "native"))
import build

TARGET_NS = 50.0
ADDR_NO_RANDOMIZE = 0x0040000  # <sys/personality.h>
# Resolved here, not between fork and exec (a dlopen there can deadlock a threaded parent).
_personality: Any = None
with contextlib.suppress(OSError, AttributeError):
    _personality = ctypes.CDLL(None).personality


def _core() -> int | None:
    """A CPU this process may use, away from CPU 0 (interrupts) when there is a choice."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return None
    return cpus[len(cpus) // 2] if cpus else None


def _one(
    program: Path, api: str, launches: int, env: dict[str, str], core: int | None
) -> dict[str, Any]:
    def pin() -> None:
        if core is not None:
            os.sched_setaffinity(0, {core})
        # The same address layout in every process (no ASLR, as `setarch -R`): layout-dependent
        # cache and branch-predictor effects then stop varying from process to process.
        if _personality is not None:
            _personality(ADDR_NO_RANDOMIZE)

    out = subprocess.run(
        [str(program), "--launches", str(launches), "--api", api],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=300,
        preexec_fn=pin,
    )
    if out.returncode != 0:
        raise RuntimeError(f"launch_overhead --api {api} failed ({out.returncode}): {out.stderr}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def run(
    workdir: Path,
    pairs: int = 30,
    launches: int = 50000,
    driver_dir: str | None = None,
    log: Any = print,
) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    build_dir = Path(tempfile.mkdtemp(prefix="gsb-launch-"))
    program = build.build_program(
        [ROOT / "bench" / "launch_overhead.c"], build_dir / "launch_overhead"
    )
    shim = build.build_shim(build_dir / "libgpushare.so")
    base = child_env()
    if driver_dir:
        base["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in [driver_dir, base.get("LD_LIBRARY_PATH", "")] if p
        )
    core = _core()
    results: dict[str, Any] = {}
    with start_scheduler(workdir, log_level="WARN", no_nvml=bool(driver_dir)) as sched:
        shimmed = {**base, "LD_PRELOAD": str(shim), "GPUSHARE_SOCKET": str(sched.socket)}
        for api in ("kernel", "kernelex"):
            plain: list[float] = []
            under: list[float] = []
            _one(program, api, launches, base, core)  # warm caches, driver JIT cache
            for i in range(pairs):
                # ABBA order within every two pairs: a drift inside a pair cancels over two.
                order = [(base, plain), (shimmed, under)]
                if i % 2:
                    order.reverse()
                for env, dest in order:
                    dest.append(float(_one(program, api, launches, env, core)["ns_median"]))
            diffs = [u - p for p, u in zip(plain, under, strict=True)]
            med, lo, hi = median_ci(diffs)
            results[api] = {
                "plain_ns": plain,
                "shim_ns": under,
                "paired_diff_ns": diffs,
                "plain_median_ns": statistics.median(plain),
                "shim_median_ns": statistics.median(under),
                "added_ns_median": med,
                "added_ns_ci95": [lo, hi],
                "target_ns": TARGET_NS,
                "met": hi <= TARGET_NS,
                "met_median": med <= TARGET_NS,
            }
            name = "cuLaunchKernel" if api == "kernel" else "cuLaunchKernelEx"
            log(
                f"{name}: {statistics.median(plain):.1f} ns plain, "
                f"{statistics.median(under):.1f} ns under the shim: +{med:.1f} ns "
                f"(95% CI {lo:.1f} .. {hi:.1f}; target <= {TARGET_NS:.0f})"
            )
    return {
        "driver": "stand-in" if driver_dir else "system",
        "pairs": pairs,
        "launches_per_process": launches,
        "cpu_core": core,
        "results": results,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--launches", type=int, default=50000)
    ap.add_argument(
        "--driver-dir", help="directory of a libcuda.so.1 to use instead of the system's"
    )
    ap.add_argument("--out", type=Path, help="write the result record here as JSON")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gsb-"))
    rec = record("launch_overhead", **run(work, args.pairs, args.launches, args.driver_dir))
    if args.out:
        write_json(args.out, rec)


if __name__ == "__main__":
    main()
