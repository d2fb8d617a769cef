"""Hatch build hook: compile libgpushare.so into the package, so `pip install .` ships the shim."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

HERE = Path(__file__).resolve().parent


def _native_build() -> Any:
    spec = importlib.util.spec_from_file_location("gpushare_native_build", HERE / "native" / "build.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        output = HERE / "jupyter_gpushare" / "lib" / "libgpushare.so"
        _native_build().build_shim(output)
        # The wheel now holds a native library: tag it for this platform, not py3-none-any.
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        build_data["artifacts"].append("jupyter_gpushare/lib/libgpushare.so")
