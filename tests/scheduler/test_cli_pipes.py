"""`gpushare status --json | head -1` (README.md, docs/operators/node-scheduler.md): the reader
closing the pipe early ends the command quietly, as SIGPIPE ends `ls | head -1`, never with a
BrokenPipeError traceback. The pipe here is closed before the command writes, so the broken pipe
happens on every run rather than 1 run in 8 as with a real `head`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args", [("status", "--json"), ("status",)])
def test_status_into_a_closed_pipe_ends_quietly(harness: Any, args: tuple[str, ...]) -> None:
    harness.scheduler()
    read_end, write_end = os.pipe()
    os.close(read_end)  # `head -1` has already gone
    try:
        out = subprocess.run(
            [sys.executable, "-m", "jupyter_gpushare", *args, "--socket", str(harness.socket_path)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    finally:
        os.close(write_end)
    assert out.stderr == "", out.stderr
    assert out.returncode == 128 + signal.SIGPIPE, out
