"""Helpers of the MPS tests: the stand-in ``nvidia-cuda-mps-control`` (tests/mps/stub/) and what
it records.

The stand-in speaks the documented control interface (``-d``; commands on stdin) and records
every command in ``<log dir>/commands.jsonl``; the MPS servers and clients it reports come from
``<pipe dir>/stub-state.json``, which the tests write (real processes stand for the clients, so
that "was it still alive when terminate_client came" can be checked).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

STUB_DIR = Path(__file__).resolve().parent / "stub"
STUB = STUB_DIR / "nvidia-cuda-mps-control"


def commands(log_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(log_dir) / "commands.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def command_names(log_dir: str | Path) -> list[str]:
    return [c["command"].split()[0] if c["command"] else "" for c in commands(log_dir)]


def set_clients(pipe_dir: str | Path, servers: dict[int, list[int]]) -> None:
    state_path = Path(pipe_dir) / "stub-state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    state["servers"] = {str(k): list(v) for k, v in servers.items()}
    state_path.write_text(json.dumps(state))


def sleeper() -> subprocess.Popen[bytes]:
    """A process that stands for an MPS client."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def with_child(**popen: Any) -> tuple[subprocess.Popen[str], int]:
    """A process standing for a kernel, and the pid of a subprocess it started (both MPS clients
    in the tests: a kernel's subprocesses inherit its MPS environment)."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(120)']); print(p.pid, flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        **popen,
    )
    assert parent.stdout is not None
    return parent, int(parent.stdout.readline())


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def stub_binary() -> Path:
    assert os.access(STUB, os.X_OK), f"{STUB} is not executable"
    return STUB


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
