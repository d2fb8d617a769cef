"""Hatch build hook: compile libgpushare.so into the package, so `pip install .` ships the shim.

It runs before the jupyter-builder hook (pyproject.toml lists it first) so that a build that needs
Node.js and has none stops with one line that says so, not a traceback from the JavaScript build.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import sysconfig
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

HERE = Path(__file__).resolve().parent


def _native_build() -> Any:
    spec = importlib.util.spec_from_file_location(
        "gpushare_native_build", HERE / "native" / "build.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PREBUILT = HERE / "jupyter_gpushare" / "labextension" / "package.json"
NO_NODE = (
    "jupyter-gpushare: building from a git clone builds the JupyterLab sidebar, which needs "
    "Node.js >= 18 (https://nodejs.org, or e.g. `apt install nodejs npm`): install it, or "
    "install from a release's sdist or wheel, which carry the sidebar prebuilt"
)


def say(text: str) -> None:
    """One line of progress on the terminal: pip hides a build's output behind its spinner
    unless it fails (or ``pip install -v``), and the sidebar's build takes minutes."""
    line = f"jupyter-gpushare: {text}\n"
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(line)
            return
    except OSError:  # no terminal (CI, a container): the build's own output, which -v shows
        pass
    os.write(2, line.encode())


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if not PREBUILT.exists() and shutil.which("node") is None:
            raise SystemExit(NO_NODE)
        if not PREBUILT.exists():
            say(
                "building the JupyterLab sidebar with jlpm: about 2 minutes; its packages come "
                "from the npm registry (behind a proxy: docs/install.md)"
            )
        if self.target_name != "wheel":
            return
        output = HERE / "jupyter_gpushare" / "lib" / "libgpushare.so"
        native = _native_build()
        say("compiling the shim, libgpushare.so")
        native.build_shim(output, portable=True)
        # The newest glibc symbol version the shim needs (zig cc links for PORTABLE_GLIBC, the
        # system compiler for this machine's glibc), and never below manylinux_2_28.
        glibc = max(native.glibc_needed(output), native.PORTABLE_GLIBC)
        # The wheel now holds a native library, but no Python extension: any Python 3 on this
        # platform can load it, so tag it py3-none-<platform> rather than cpXY-cpXY-<platform>.
        build_data["pure_python"] = False
        build_data["tag"] = f"py3-none-{platform_tag(glibc)}"
        build_data["artifacts"].append("jupyter_gpushare/lib/libgpushare.so")


def platform_tag(glibc: tuple[int, int]) -> str:
    """manylinux_<major>_<minor>_<arch> for a shim that needs ``glibc`` (PEP 600).

    The shim links only libc (and libdl/libpthread, part of it since glibc 2.34); it never links
    CUDA, which it finds with dlopen at run time, so the glibc it needs is the whole platform
    promise; `auditwheel show` confirms it (tests/packaging). GPUSHARE_WHEEL_PLAT overrides it,
    and a build that is not on glibc (musl, macOS) keeps its plain platform tag, which no index
    takes but which still installs locally.
    """
    override = os.environ.get("GPUSHARE_WHEEL_PLAT")
    if override:
        return override
    plain = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    libc, version = platform.libc_ver()
    if not plain.startswith("linux_") or libc != "glibc" or not version:
        return plain
    major, minor = glibc
    return f"manylinux_{major}_{minor}_{plain.removeprefix('linux_')}"
