"""The real Helm (v4's Go library from the helm-sdkpy wheel) for the tests and for generating
deploy/kubernetes from the chart (tests/deploy/render_manifests.py): one path, so the plain
manifests are what the tested chart renders."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: helm-sdkpy's wheel carries Helm v4 as libhelm_sdkpy.so; its Python wrapper wants Python 3.12,
#: so the wheel is downloaded (not installed) and the library called directly.
HELM_SDKPY = "0.1.32"


def helm_library() -> Path:
    """libhelm_sdkpy.so from .cache/ (downloaded with pip once: the wheel is py3-none-any)."""
    if os.environ.get("GPUSHARE_HELM_LIB"):
        return Path(os.environ["GPUSHARE_HELM_LIB"])
    cache = ROOT / ".cache" / "helm-sdkpy" / HELM_SDKPY
    lib = cache / "libhelm_sdkpy.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    dl = cache / "download"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "-d", str(dl), f"helm-sdkpy=={HELM_SDKPY}"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"cannot download helm-sdkpy: {out.stdout}{out.stderr}"
    [wheel] = dl.glob("helm_sdkpy-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        member = "helm_sdkpy/_lib/linux-amd64/libhelm_sdkpy.so"
        tmp = lib.with_suffix(".part")
        with zf.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        tmp.rename(lib)
    shutil.rmtree(dl)
    return lib


def run_helm(chart: Path, jobs: dict[str, Any]) -> dict[str, Any]:
    """Lint and install ``chart`` as ``jobs`` says (tests/deploy/helm_render.py), in a process
    of its own."""
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("helm_render.py")), str(helm_library())],
        input=json.dumps({"chart": str(chart), **jobs}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout))
