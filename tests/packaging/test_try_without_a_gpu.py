"""docs/try-without-a-gpu.md's commands, verbatim, from the checkout's root: two programs under
the shim on the stand-in driver take turns on a 1 GiB pool, and `gpushare status` shows one
holding the GPU and the other waiting."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.packaging.test_readme_commands import _block

ROOT = Path(__file__).resolve().parents[2]


def test_two_programs_take_turns_on_the_stand_in() -> None:
    if not (ROOT / "jupyter_gpushare" / "lib" / "libgpushare.so").is_file():
        pytest.skip("the shim is not built here (pip install -e . builds it)")
    script = _block("docs/try-without-a-gpu.md", "T=$(mktemp -d)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSHARE_", "LD_"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # its background scheduler and programs go with it
    )
    try:
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gpushare stand-in GPU" in out.stdout and "pool 1.00 GiB" in out.stdout, out.stdout
    assert "holder: pid-" in out.stdout and "queue: pid-" in out.stdout, out.stdout
    assert "waiting #1" in out.stdout, out.stdout
    assert "reason='quantum expired'" in out.stdout, out.stdout
