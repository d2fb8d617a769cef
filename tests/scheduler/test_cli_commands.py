"""The `gpushare` command line, run as the native tests and users run it: as subprocesses."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sched_helpers import DEVICE, GiB, MiB

from jupyter_gpushare.protocol import Message, MsgType, read_message_sync, write_message_sync

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["JUPYTER_CONFIG_DIR"] = str(tmp_path / "jupyter-config")  # no stray user config
    env.pop("GPUSHARE_SOCKET", None)
    return env


def gpushare(
    *args: str, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class SchedulerProcess:
    def __init__(self, args: list[str], env: dict[str, str], sock: str) -> None:
        self.sock = sock
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter_gpushare", "scheduler", "--socket", sock, *args],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                _, err = self.proc.communicate(timeout=5)
                raise AssertionError(f"the scheduler did not start:\n{err}")
            time.sleep(0.02)

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=15)
        return self.proc.returncode, err


@pytest.fixture
def start_scheduler(cli_env: dict[str, str], sock_path: str) -> Iterator[object]:
    procs: list[SchedulerProcess] = []

    def start(*args: str) -> SchedulerProcess:
        proc = SchedulerProcess(list(args), cli_env, sock_path)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.communicate(timeout=5)


def shim_hello(path: str, client_id: str, **fields: object) -> tuple[socket.socket, Message]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    hello = {
        "client_id": client_id,
        "pid": os.getpid(),
        "device_uuid": DEVICE,
        "device_name": "Fake GPU",
        "device_total": 80 * GiB,
        "user": "tester",
        "label": "notebook.ipynb",
        "version": "test",
        **fields,
    }
    write_message_sync(sock, Message(MsgType.HELLO, hello))
    welcome = read_message_sync(sock)
    assert welcome is not None and welcome.type == MsgType.WELCOME
    return sock, welcome


def test_scheduler_status_and_sigterm(
    start_scheduler, cli_env: dict[str, str], sock_path: str
) -> None:
    # Exactly how the native tests start it (NVML is absent here: a log line, no traceback).
    sched = start_scheduler("--pool", "1GiB", "--quantum", "2", "--log-level", "DEBUG")
    sock, welcome = shim_hello(sock_path, "kernel-1", quota=512 * MiB)
    assert welcome.fields["pool_bytes"] == GiB
    assert welcome.fields["quantum_ms"] == 2000
    write_message_sync(
        sock,
        Message(
            MsgType.REQUEST,
            {"used_bytes": 300 * MiB, "managed_bytes": 200 * MiB, "pinned_bytes": 100 * MiB},
        ),
    )
    grant = read_message_sync(sock)
    assert grant is not None and grant.type == MsgType.GRANT

    out = gpushare("status", "--socket", sock_path, "--json", env=cli_env)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["socket"] == sock_path
    (dev,) = doc["devices"]
    assert dev["pool_bytes"] == GiB and dev["holders"] == ["kernel-1"]
    assert dev["clients"][0]["quota_bytes"] == 512 * MiB

    cli_env["GPUSHARE_SOCKET"] = sock_path  # the default path honours GPUSHARE_SOCKET
    out = gpushare("status", env=cli_env)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert DEVICE in text and "Fake GPU" in text
    assert "pool 1.00 GiB of 80.00 GiB" in text
    assert "mode shared" in text and "holder: kernel-1" in text
    assert "CLIENT" in text and "GPU TIME" in text
    row = next(line for line in text.splitlines() if "kernel-1" in line and "running" in line)
    assert "300.00 MiB" in row and "512.00 MiB" in row and "notebook.ipynb" in row

    sock.close()
    code, err = sched.stop()
    assert code == 0, err
    assert "Traceback" not in err
    assert "grant client=kernel-1" in err  # logs go to stderr
    assert "NVML" in err or "device" in err
    assert not os.path.exists(sock_path)  # SIGTERM removed the socket


def test_status_when_no_scheduler(cli_env: dict[str, str], sock_dir: str) -> None:
    out = gpushare("status", "--socket", os.path.join(sock_dir, "none.sock"), env=cli_env)
    assert out.returncode == 1
    assert "scheduler not available" in out.stderr and "none.sock" in out.stderr
    assert "Traceback" not in out.stderr
    out = gpushare("status", "--json", "--socket", os.path.join(sock_dir, "x.sock"), env=cli_env)
    assert out.returncode == 1 and out.stdout == ""


def test_config_file_and_command_line_precedence(
    start_scheduler, cli_env: dict[str, str], sock_path: str, tmp_path: Path
) -> None:
    config = tmp_path / "my_config.py"
    config.write_text(
        'c.GPUShareScheduler.pool_size = "3GiB"\nc.GPUShareScheduler.base_quantum = 7\n'
    )
    sched = start_scheduler("--config", str(config), "--no-nvml")
    sock, welcome = shim_hello(sock_path, "k")
    assert welcome.fields["pool_bytes"] == 3 * GiB
    assert welcome.fields["quantum_ms"] == 7000
    sock.close()
    sched.stop()
    sched = start_scheduler("--config", str(config), "--pool", "2GiB", "--no-nvml")
    sock, welcome = shim_hello(sock_path, "k")
    assert welcome.fields["pool_bytes"] == 2 * GiB  # the command line wins
    assert welcome.fields["quantum_ms"] == 7000
    sock.close()
    sched.stop()


def test_scheduler_errors(start_scheduler, cli_env: dict[str, str], sock_path: str) -> None:
    out = gpushare("scheduler", "--socket", sock_path, "--pool", "lots", env=cli_env)
    assert out.returncode == 2
    assert "invalid size 'lots'" in out.stderr and "Traceback" not in out.stderr
    sched = start_scheduler("--no-nvml")
    out = gpushare("scheduler", "--socket", sock_path, "--no-nvml", env=cli_env)
    assert out.returncode == 1
    assert "already listening" in out.stderr and "Traceback" not in out.stderr
    assert os.path.exists(sock_path)  # the refused one left the live socket alone
    code, err = sched.stop()
    assert code == 0, err


def test_sigint_stops_cleanly(start_scheduler, sock_path: str) -> None:
    sched = start_scheduler("--no-nvml")
    sched.proc.send_signal(signal.SIGINT)
    code, err = sched.stop()
    assert code == 0 and "Traceback" not in err
    assert not os.path.exists(sock_path)


def _harmless_library() -> str | None:
    for path in ("/lib/x86_64-linux-gnu/libm.so.6", "/lib64/libm.so.6", "/usr/lib64/libm.so.6"):
        if os.path.exists(path):
            return path
    return None


PRINT_ENV = (
    "import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
    "if k.startswith(('GPUSHARE_', 'LD_PRELOAD'))}))"
)


@pytest.mark.skipif(_harmless_library() is None, reason="no libm to stand in for the shim")
def test_run_sets_up_the_shim(cli_env: dict[str, str]) -> None:
    lib = _harmless_library()
    assert lib is not None
    cli_env["GPUSHARE_LIBRARY"] = lib
    cli_env["LD_PRELOAD"] = ""
    out = gpushare(
        "run", "--socket", "/tmp/x.sock", "--memory-limit", "1.5GiB", "--weight", "2",
        "--client-id", "c1", "--", sys.executable, "-c", PRINT_ENV, env=cli_env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    env = json.loads(out.stdout)
    assert env["LD_PRELOAD"] == os.path.realpath(lib)
    assert env["GPUSHARE_SOCKET"] == "/tmp/x.sock"
    assert env["GPUSHARE_MEMORY_LIMIT"] == str(3 << 29)
    assert env["GPUSHARE_WEIGHT"] == "2.0"
    assert env["GPUSHARE_CLIENT_ID"] == "c1"
    assert env["GPUSHARE_LABEL"].startswith(sys.executable)
    # Without `--`: the command starts at the first non-option; its own options are its own.
    out = gpushare("run", "--weight", "3", sys.executable, "-c", PRINT_ENV, env=cli_env)
    assert out.returncode == 0, out.stderr
    env = json.loads(out.stdout)
    assert env["GPUSHARE_WEIGHT"] == "3.0" and "GPUSHARE_MEMORY_LIMIT" not in env


def test_run_errors(cli_env: dict[str, str], tmp_path: Path) -> None:
    out = gpushare("run", env=cli_env)
    assert out.returncode == 2 and "no command given" in out.stderr
    out = gpushare("run", "--memory-limit", "1G", "--", env=cli_env)
    assert out.returncode == 2 and "no command given" in out.stderr
    lib = tmp_path / "libgpushare.so"
    lib.write_bytes(b"")
    cli_env["GPUSHARE_LIBRARY"] = str(tmp_path / "missing.so")
    out = gpushare("run", "--", "true", env=cli_env)
    assert out.returncode == 1 and "GPUSHARE_LIBRARY" in out.stderr
    lib_path = _harmless_library()
    if lib_path is not None:
        cli_env["GPUSHARE_LIBRARY"] = lib_path
        out = gpushare("run", "--", "no-such-command-xyz", env=cli_env)
        assert out.returncode == 127 and "command not found: no-such-command-xyz" in out.stderr
        out = gpushare("run", "--memory-limit", "lots", "--", "true", env=cli_env)
        assert out.returncode == 2 and "invalid size" in out.stderr
    for text in (out.stderr,):
        assert "Traceback" not in text


def test_no_subcommand(cli_env: dict[str, str]) -> None:
    out = gpushare(env=cli_env)
    assert out.returncode == 2
    assert "scheduler" in out.stdout + out.stderr and "status" in out.stdout + out.stderr
    out = gpushare("--help", env=cli_env)
    assert out.returncode == 0 and "scheduler" in out.stdout
    out = gpushare("scheduler", "--help-all", env=cli_env)
    assert out.returncode == 0 and "GPUShareScheduler.pool_size" in out.stdout
