"""Hatch build hook: compile libgpushare.so into the package, so `pip install .` ships the shim."""

from __future__ import annotations

import importlib.util
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


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        output = HERE / "jupyter_gpushare" / "lib" / "libgpushare.so"
        _native_build().build_shim(output)
        # The wheel now holds a native library, but no Python extension: any Python 3 on this
        # platform can load it, so tag it py3-none-<platform> rather than cpXY-cpXY-<platform>.
        build_data["pure_python"] = False
        platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
        build_data["tag"] = f"py3-none-{platform}"
        build_data["artifacts"].append("jupyter_gpushare/lib/libgpushare.so")
