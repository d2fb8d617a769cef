"""Kernel start (benchmark 5): a Jupyter kernel's start-to-ready time, gpushare vs plain.

jupyter_client's KernelManager starts an ipykernel from a kernelspec that either names the
gpushare provisioner (the kernel runs under the shim, registered with a running scheduler) or
not, or only preloads the shim through the kernelspec's env (no provisioner, no magic), or
preloads it and loads the %gpushare magic as the provisioner does (no provisioner): to see where
any cost sits; the time is from ``start_kernel()`` to the kernel's ``kernel_info`` reply
(``wait_for_ready``). Starts alternate (ABCD DCBA); medians and the paired difference (gpushare
minus plain) are reported.
Target: <= +50 ms.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from jupyter_gpushare.provisioner import MAGIC_EXTENSION

from .common import child_env, median_ci
from .common import scheduler as start_scheduler

TARGET_MS = 50.0


def _write_spec(
    kernels: Path,
    name: str,
    socket: str | None,
    env: dict[str, str] | None = None,
    extra_argv: tuple[str, ...] = (),
) -> None:
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}", *extra_argv]
    spec: dict[str, Any] = {
        "argv": argv,
        "display_name": name,
        "language": "python",
        "metadata": {},
    }
    if env:
        spec["env"] = env
    if socket is not None:
        spec["metadata"]["kernel_provisioner"] = {
            "provisioner_name": "gpushare-provisioner",
            "config": {"socket": socket},
        }
    (kernels / name).mkdir(parents=True, exist_ok=True)
    (kernels / name / "kernel.json").write_text(json.dumps(spec))


async def _start_once(ksm: Any, name: str, env: dict[str, str]) -> float:
    from jupyter_client.manager import AsyncKernelManager

    km = AsyncKernelManager(kernel_name=name, kernel_spec_manager=ksm)
    t0 = time.perf_counter()
    await km.start_kernel(env=env)
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=120)
        elapsed = time.perf_counter() - t0
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)
    return elapsed


#: plain; the shim preloaded by the kernelspec's env alone (no provisioner, no magic); the shim
#: and the %gpushare magic with its wait line, as the provisioner loads it, but no provisioner;
#: the gpushare provisioner (shim, scheduler round trips before the launch, magic). The
#: differences between neighbours say where any cost sits.
VARIANTS = ("plain", "shim-only", "shim-magic", "gpushare")


async def _run(kernels: Path, pairs: int) -> dict[str, list[float]]:
    from jupyter_client.kernelspec import KernelSpecManager

    ksm = KernelSpecManager(kernel_dirs=[str(kernels)])
    env = child_env()
    await _start_once(ksm, "plain", env)  # warm the file cache: the first start of all pays it
    out: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for i in range(pairs):
        order = list(VARIANTS) if i % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            out[name].append(await _start_once(ksm, name, env))
    return out


def run(workdir: Path, pairs: int = 20, no_nvml: bool = False, log: Any = print) -> dict[str, Any]:
    kernels = Path(tempfile.mkdtemp(prefix="gsb-kernels-"))
    with start_scheduler(workdir, no_nvml=no_nvml) as sched:
        from jupyter_gpushare.shim import library_path

        _write_spec(kernels, "plain", None)
        preload = {"LD_PRELOAD": library_path(), "GPUSHARE_SOCKET": str(sched.socket)}
        _write_spec(kernels, "shim-only", None, preload)
        magic = (f"--InteractiveShellApp.extra_extensions={MAGIC_EXTENSION}",)
        _write_spec(kernels, "shim-magic", None, preload, magic)
        _write_spec(kernels, "gpushare", str(sched.socket))
        times = asyncio.run(_run(kernels, pairs))
    plain, shim = times["plain"], times["gpushare"]
    diffs = [(s - p) * 1000 for p, s in zip(plain, shim, strict=True)]
    med, lo, hi = median_ci(diffs)
    # Where the cost sits: the preloaded shim alone against plain, paired the same way.
    so_diffs = [(s - p) * 1000 for p, s in zip(plain, times["shim-only"], strict=True)]
    so_med, so_lo, so_hi = median_ci(so_diffs)
    # The magic and its wait line (shim-magic minus shim-only), and the provisioner's own part
    # (gpushare minus shim-magic: its round trips to the scheduler before the launch).
    magic_med, magic_lo, magic_hi = median_ci(
        [(m - o) * 1000 for o, m in zip(times["shim-only"], times["shim-magic"], strict=True)]
    )
    prov_med, prov_lo, prov_hi = median_ci(
        [(g - m) * 1000 for m, g in zip(times["shim-magic"], shim, strict=True)]
    )
    log(
        f"kernel start: {statistics.median(plain) * 1e3:.0f} ms plain, "
        f"{statistics.median(shim) * 1e3:.0f} ms with the provisioner and shim: "
        f"{med:+.1f} ms (95% CI {lo:+.1f} .. {hi:+.1f}; target <= +{TARGET_MS:.0f}); "
        f"shim alone {so_med:+.1f} ms (95% CI {so_lo:+.1f} .. {so_hi:+.1f}), the magic "
        f"{magic_med:+.1f} ms more, the provisioner {prov_med:+.1f} ms more"
    )
    return {
        "pairs": pairs,
        "plain_s": plain,
        "gpushare_s": shim,
        "shim_only_s": times["shim-only"],
        "shim_only_median_ms": statistics.median(times["shim-only"]) * 1000,
        "plain_median_ms": statistics.median(plain) * 1000,
        "gpushare_median_ms": statistics.median(shim) * 1000,
        "added_ms_median": med,
        "added_ms_ci95": [lo, hi],
        "paired_diff_ms": diffs,
        "shim_only_added_ms_median": so_med,
        "shim_only_added_ms_ci95": [so_lo, so_hi],
        "shim_magic_s": times["shim-magic"],
        "magic_added_ms_median": magic_med,
        "magic_added_ms_ci95": [magic_lo, magic_hi],
        "provisioner_added_ms_median": prov_med,
        "provisioner_added_ms_ci95": [prov_lo, prov_hi],
        "target_ms": TARGET_MS,
        "met": med <= TARGET_MS,
        "met_ci": hi <= TARGET_MS,
    }
