"""Launch-path overhead of the shim (benchmark 1a): empty-kernel launches, with and without.

The headline is an in-process A/B (bench/launch_ab.c): one process, no LD_PRELOAD, dlopen()s the
real driver and the shim and alternates batches launched through the driver's own
cuLaunchKernel / cuLaunchKernelEx and through the shim's wrappers, in the same context and
stream, the device held under a real scheduler (the shim's gate on its fast path). Each round
(both sides, ABBA order over rounds) gives one paired difference; the result is the median of
the per-round differences with a distribution-free 95% confidence interval. Separate processes
differed from one another by hundreds of nanoseconds (which core, cache sets, layout), which is
what hid a few tens of nanoseconds; inside one process that difference is gone.

Optionally (``--pairs N`` > 0) the older method too: whole processes alternating without / with
LD_PRELOAD (bench/launch_overhead.c), pinned to one core, without address randomisation.

    python -m bench.launch_overhead [--rounds 200] [--pairs 0] [--out FILE]

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


def _in_process(
    program: Path,
    shim: Path,
    api: str,
    rounds: int,
    sub: int,
    env: dict[str, str],
    driver: str,
    core: int | None,
) -> dict[str, Any]:
    def pin() -> None:
        if core is not None:
            os.sched_setaffinity(0, {core})

    cmd = [str(program), "--shim", str(shim), "--driver", driver, "--api", api]
    cmd += ["--rounds", str(rounds), "--sub", str(sub)]
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=env, check=False, timeout=400, preexec_fn=pin
    )
    if out.returncode != 0:
        raise RuntimeError(f"launch_ab --api {api} failed ({out.returncode}): {out.stderr}")
    res = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    res["shim_log"] = out.stderr.strip().splitlines()[-20:]
    return res


def summarise(real: list[float], under: list[float]) -> dict[str, Any]:
    """Paired per-round differences (shim - real, ns per launch): median, 95% CI, verdict."""
    diffs = [u - p for p, u in zip(real, under, strict=True)]
    med, lo, hi = median_ci(diffs)
    return {
        "plain_ns": real,
        "shim_ns": under,
        "paired_diff_ns": diffs,
        "plain_median_ns": statistics.median(real),
        "shim_median_ns": statistics.median(under),
        "added_ns_median": med,
        "added_ns_ci95": [lo, hi],
        "target_ns": TARGET_NS,
        "met": hi <= TARGET_NS,
        "met_median": med <= TARGET_NS,
    }


def run(
    workdir: Path,
    pairs: int = 0,
    launches: int = 50000,
    driver_dir: str | None = None,
    log: Any = print,
    rounds: int = 200,
    sub: int = 40,
) -> dict[str, Any]:
    """In-process A/B over ``rounds`` rounds of ``sub`` x 256 launches a side; with ``pairs`` >
    0 also the process-pair method (``launches`` per process)."""
    workdir.mkdir(parents=True, exist_ok=True)
    build_dir = Path(tempfile.mkdtemp(prefix="gsb-launch-"))
    ab = build.build_program([ROOT / "bench" / "launch_ab.c"], build_dir / "launch_ab")
    shim = build.build_shim(build_dir / "libgpushare.so")
    base = child_env()
    driver = "libcuda.so.1"
    if driver_dir:
        base["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in [driver_dir, base.get("LD_LIBRARY_PATH", "")] if p
        )
        driver = str(Path(driver_dir).resolve() / "libcuda.so.1")
    core = _core()
    results: dict[str, Any] = {}
    process_pairs: dict[str, Any] = {}
    with start_scheduler(workdir, log_level="WARN", no_nvml=bool(driver_dir)) as sched:
        # The shim, dlopen()ed, loads the very driver object the program loaded.
        # GPUSHARE_LOG=debug: the shim says that it registered and was granted the device (the
        # record keeps it as proof of the measured path); the gate's fast path logs nothing.
        ab_env = {
            **base,
            "GPUSHARE_SOCKET": str(sched.socket),
            "GPUSHARE_REAL_LIBCUDA": driver,
            "GPUSHARE_LOG": "debug",
        }
        for api in ("kernel", "kernelex"):
            name = "cuLaunchKernel" if api == "kernel" else "cuLaunchKernelEx"
            res = _in_process(ab, shim, api, rounds, sub, ab_env, driver, core)
            r = summarise([float(x) for x in res["real_ns"]], [float(x) for x in res["shim_ns"]])
            r["launches_per_side_round"] = res["launches_per_side_round"]
            r["shim_log"] = res["shim_log"]
            r["device_granted"] = any("granted the device" in x for x in res["shim_log"])
            if not r["device_granted"]:
                log(f"{name}: WARNING: the shim did not report a grant: {res['shim_log']}")
            results[api] = r
            lo, hi = r["added_ns_ci95"]
            log(
                f"{name} (in-process A/B, {rounds} rounds): {r['plain_median_ns']:.1f} ns "
                f"driver, {r['shim_median_ns']:.1f} ns shim wrapper: "
                f"{r['added_ns_median']:+.1f} ns (95% CI {lo:.1f} .. {hi:.1f}; target <= "
                f"{TARGET_NS:.0f})"
            )
        if pairs > 0:
            program = build.build_program(
                [ROOT / "bench" / "launch_overhead.c"], build_dir / "launch_overhead"
            )
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
                p = summarise(plain, under)
                process_pairs[api] = p
                lo, hi = p["added_ns_ci95"]
                log(
                    f"{api} (process pairs, {pairs}): {p['added_ns_median']:+.1f} ns "
                    f"(95% CI {lo:.1f} .. {hi:.1f})"
                )
    return {
        "driver": "stand-in" if driver_dir else "system",
        "method": "in-process A/B (dlopen driver + shim, alternating rounds)",
        "rounds": rounds,
        "cpu_core": core,
        "results": results,
        "process_pairs": {"pairs": pairs, "launches_per_process": launches, **process_pairs},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--pairs", type=int, default=0, help="process pairs too (older method)")
    ap.add_argument("--launches", type=int, default=50000)
    ap.add_argument(
        "--driver-dir", help="directory of a libcuda.so.1 to use instead of the system's"
    )
    ap.add_argument("--out", type=Path, help="write the result record here as JSON")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gsb-"))
    rec = record(
        "launch_overhead",
        **run(work, args.pairs, args.launches, args.driver_dir, rounds=args.rounds),
    )
    if args.out:
        write_json(args.out, rec)


if __name__ == "__main__":
    main()
