"""Running native/tests/shim_probe.c (the issue-12 scenarios) under the shim, with the harness."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Harness, NativeBuild, Proc, Run, _load_build_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def shim_probe(native_build: NativeBuild) -> Path:
    build = _load_build_module()
    fake = native_build.fake_dir
    return build.build_program(
        [ROOT / "native" / "tests" / "shim_probe.c"],
        native_build.root / "bin" / "shim_probe",
        [f"-L{fake}", "-l:libcuda.so.1", f"-Wl,-rpath,{fake}"],
    )


def run_probe(
    harness: Harness, probe: Path, *args: Any, timeout: float = 60.0, **gpushare: Any
) -> Run:
    argv = [str(probe), *map(str, args)]
    extra = gpushare.pop("extra", None)
    env = harness.env(extra=extra, **gpushare)
    try:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{argv} still running after {timeout}s: {exc.stderr!r}") from None
    return Run(argv, out.returncode, out.stdout, out.stderr)


def spawn_probe(harness: Harness, probe: Path, *args: Any, **gpushare: Any) -> Proc:
    extra = gpushare.pop("extra", None)
    return harness.spawn_command(
        [str(probe), *map(str, args)], harness.env(extra=extra, **gpushare)
    )


def trace(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
