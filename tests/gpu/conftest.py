"""Fixtures of the GPU suite (pytest -m gpu): real PyTorch, CuPy and JAX under the real shim.

Run on a machine with an NVIDIA GPU. The scheduler runs as a subprocess, exactly as an operator
would start it, with a memory pool far below the card: memory pressure comes from the pool, never
from exhausting the card (oversubscribing managed memory can hang a GPU).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

WORKLOADS = Path(__file__).parent / "workloads"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.gpu)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def record(self) -> dict:
        """The workload's JSON line (the last line of stdout that parses as JSON)."""
        for line in reversed(self.stdout.splitlines()):
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError(f"no JSON record in stdout:\n{self.stdout}\nstderr:\n{self.stderr}")


@dataclass
class Scheduler:
    socket: Path
    log: Path
    process: subprocess.Popen

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def status(self) -> dict:
        return json.loads(self.status_text("--json"))

    def status_text(self, *options: str) -> str:
        """``gpushare status`` as it prints (a table; the document with ``--json``)."""
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "jupyter_gpushare",
                "status",
                "--socket",
                str(self.socket),
                *options,
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return out.stdout


def require(module: str) -> ModuleType:
    """Import ``module`` or fail: a framework missing on the GPU machine is a failure of the GPU
    suite (it would otherwise pass by skipping what it exists to check), not a skip."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"the GPU suite needs {module} on this machine: {exc}", pytrace=False)


def nvidia_smi(*query: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", *query, "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]


def card_used_mib() -> int:
    return int(nvidia_smi("--query-gpu=memory.used", "-i", "0")[0][0])


def process_mib(pid: int) -> int | None:
    """The process's memory on the GPU as nvidia-smi lists it (None: not in the compute list,
    which is also what a container whose pids nvidia-smi cannot map shows)."""
    for row in nvidia_smi("--query-compute-apps=pid,used_memory"):
        if row[0] == str(pid):
            return int(row[1])
    return None


def ms_of(log: str, what: str, client: str) -> float:
    """The ms= figure of the last ``WHAT client=CLIENT`` line of a scheduler log (0.0: none)."""
    found = re.findall(rf"{what} client={re.escape(client)} .*?ms=([\d.]+)", log)
    return float(found[-1]) if found else 0.0


def workload_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(WORKLOADS), env.get("PYTHONPATH", "")] if p)
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def shimmed_env(socket: Path | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    from jupyter_gpushare.shim import shim_environment

    env = workload_env(extra)
    return shim_environment(env, socket=str(socket) if socket else "/nonexistent/gpushare.sock")


def run_workload(script: str, *args: str, env: dict[str, str], timeout: float = 600) -> Result:
    proc = subprocess.run(
        [sys.executable, str(WORKLOADS / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def kill_holder(holder: subprocess.Popen, waiter: subprocess.Popen) -> tuple[dict, float]:
    """SIGKILL the holder; the waiter's record once it ends (it must end well and correct), and
    the time of the kill (time.time())."""
    holder.send_signal(signal.SIGKILL)
    killed_at = time.time()
    holder.wait(timeout=30)
    out, err = waiter.communicate(timeout=300)
    assert waiter.returncode == 0, err
    record = Result(0, out, err).record
    assert record["correct"], record
    return record, killed_at


def start_workload(script: str, *args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKLOADS / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def start_scheduler(
    sock: Path,
    log: Path,
    quantum: float = 2.0,
    pool: str = "24GiB",
    args: tuple[str, ...] = (),
    **popen: Any,
) -> Scheduler:
    """A node scheduler (NVML discovery: every GPU of the machine) on ``sock``, appending to
    ``log``; the caller stops it (``running_scheduler`` does). ``args``: more options;
    ``popen``: more of Popen's arguments (e.g. ``user``: a service account). The environment's
    GPUSHARE_TEST_SCHEDULER_ARGS (split on spaces) comes last: a campaign's way to run the same
    tests with, e.g., ``--log-level DEBUG`` or a policy switch turned off, for a diagnosis."""
    more = os.environ.get("GPUSHARE_TEST_SCHEDULER_ARGS", "").split()
    # One log level: traitlets refuses a second value for the same option.
    level = [] if any(a.startswith("--log-level") for a in more) else ["--log-level", "INFO"]
    with log.open("a") as log_file:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyter_gpushare",
                "scheduler",
                "--socket",
                str(sock),
                # "": the default pool (the card less pool_reserve), as an operator runs it
                *(["--pool", pool] if pool else []),
                "--quantum",
                str(quantum),
                *level,
                *args,
                *more,
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            **popen,
        )
    deadline = time.monotonic() + 30
    # Connectable, not only there: a killed scheduler leaves its socket file behind.
    while not _listening(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"scheduler did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return Scheduler(sock, log, proc)


def _listening(sock: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(sock))
        return True
    except OSError:
        return False
    finally:
        probe.close()


@contextlib.contextmanager
def running_scheduler(
    tmp_path: Path, pool: str = "24GiB", quantum: float = 2.0, args: tuple[str, ...] = ()
) -> Iterator[Scheduler]:
    """A node scheduler, stopped on exit (the one in ``sched.process`` then: a test that
    restarts the scheduler swaps it)."""
    sched = start_scheduler(
        tmp_path / "gpushare.sock", tmp_path / "scheduler.log", quantum, pool, args
    )
    try:
        yield sched
    finally:
        proc = sched.process
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        print("---- scheduler log ----")
        print(sched.log_text())


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[Scheduler]:
    """A node scheduler with a 24 GiB pool and a 2 s base quantum."""
    with running_scheduler(tmp_path) as sched:
        yield sched
