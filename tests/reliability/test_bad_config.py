"""Bad configuration gives one clear line at start, never a traceback later.

``gpushare scheduler`` exits with 2 and ``invalid configuration: ...`` for a value that cannot
work (sizes, times, modes, uids, a socket path or directory, a group); the library raises the same
messages (TraitError / SchedulerConfigError) for the server extension and the provisioner, which
log them and keep the Jupyter server up (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from traitlets import TraitError

from jupyter_gpushare.provisioner import GPUShareProvisioner
from jupyter_gpushare.scheduler.shell.server import GPUShareScheduler, SchedulerConfigError
from jupyter_gpushare.scheduler_client import SchedulerUnavailable
from jupyter_gpushare.serverextension.backend import SchedulerBackend

ROOT = Path(__file__).resolve().parents[2]


def scheduler_cli(*args: str, cwd: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    env["PYTHONPATH"] = str(ROOT)
    env["JUPYTER_CONFIG_DIR"] = cwd  # no stray user config
    return subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare", "scheduler", "--no-nvml", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=env,
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--pool", "lots"], "--pool: invalid size"),
        (["--reserve=-1GiB"], "--reserve: invalid size"),
        (["--keep-free", "lots"], "--keep-free: invalid size"),
        (["--quantum", "0"], "base_quantum must be a positive number"),
        (["--GPUShareScheduler.move_factor=-2"], "move_factor must be a positive number"),
        (["--GPUShareScheduler.recovery_seconds=-1"], "recovery_seconds must be 0 or more"),
        (["--GPUShareScheduler.socket_mode=4096"], "socket_mode must be permission bits"),
        (["--GPUShareScheduler.admin_uids=-5"], "admin_uids: -5 is not a uid"),
        (["--GPUShareScheduler.socket_group=no-such-group-xyz"], "no such group"),
        (["--socket", "/tmp/" + "x" * 120 + "/s.sock"], "too long"),
    ],
)
def test_scheduler_cli_rejects_bad_values(sock_dir: str, args: list[str], says: str) -> None:
    if "--socket" not in args:
        args = ["--socket", os.path.join(sock_dir, "s.sock"), *args]
    out = scheduler_cli(*args, cwd=sock_dir)
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr, out.stderr
    assert "invalid configuration" in out.stderr and says in out.stderr, out.stderr


def test_scheduler_cli_socket_directory_that_cannot_be_made(sock_dir: str) -> None:
    blocker = Path(sock_dir) / "file"
    blocker.write_text("a file where the socket's directory should be")
    out = scheduler_cli("--socket", str(blocker / "run" / "s.sock"), cwd=sock_dir)
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr, out.stderr
    assert "cannot put the socket at" in out.stderr and "GPUSHARE_SOCKET" in out.stderr


def test_scheduler_cli_socket_path_that_is_not_a_socket(sock_dir: str) -> None:
    path = Path(sock_dir) / "s.sock"
    path.write_text("not a socket")
    out = scheduler_cli("--socket", str(path), cwd=sock_dir)
    assert out.returncode == 2 and "is not a socket" in out.stderr, out
    assert path.read_text() == "not a socket"


def test_missing_socket_directory_is_created(sock_dir: str) -> None:
    """A missing directory is no error: the scheduler makes it (0700 for a per-user one)."""

    async def run() -> None:
        path = os.path.join(sock_dir, "new", "deeper", "s.sock")
        sched = GPUShareScheduler(socket_path=path, use_nvml=False)
        await sched.start()
        try:
            assert os.path.exists(path)
        finally:
            await sched.stop()

    asyncio.run(run())


def test_library_raises_the_same_messages() -> None:
    with pytest.raises(TraitError, match="base_quantum must be a positive number"):
        GPUShareScheduler(base_quantum=-1)
    with pytest.raises(ValueError, match="pool_size"):
        GPUShareScheduler(pool_size="12 parsecs")
    with pytest.raises(TraitError, match="memory_limit"):
        GPUShareProvisioner(memory_limit="lots")
    with pytest.raises(TraitError, match="weight must be positive"):
        GPUShareProvisioner(weight=0)


def test_server_extension_reports_a_bad_scheduler_config_and_stays_up(sock_dir: str) -> None:
    """The embedded scheduler with an invalid value: one error line; every API request then
    answers 503 with the reason (the Jupyter server itself keeps running)."""
    logged: list[str] = []

    class Log:
        def __getattr__(self, level: str):
            return lambda msg, *a: logged.append(f"{level}: {msg % a}")

    def make(path: str) -> GPUShareScheduler:
        return GPUShareScheduler(socket_path=path, use_nvml=False, pool_size="lots")

    async def run() -> None:
        backend = SchedulerBackend(
            "embedded", os.path.join(sock_dir, "s.sock"), make_scheduler=make, log=Log()
        )
        await backend.ensure_started()
        assert backend.error and "pool_size" in backend.error, backend.error
        await backend.stop()

    asyncio.run(run())
    errors = [line for line in logged if line.startswith("error")]
    assert len(errors) == 1 and "pool_size" in errors[0] and "\n" not in errors[0], logged


def test_scheduler_config_error_is_a_start_error() -> None:
    from jupyter_gpushare.scheduler.shell.server import SchedulerStartError

    assert issubclass(SchedulerConfigError, SchedulerStartError)


def test_server_extension_with_an_invalid_mode_runs_no_scheduler(sock_dir: str) -> None:
    """jupyter_server logs a trait that fails validation at link time and loads the extension
    anyway, with the bad value: the backend must then refuse to guess (it used to take any
    unknown mode for 'node')."""
    logged: list[str] = []

    class Log:
        def __getattr__(self, level: str):
            return lambda msg, *a: logged.append(f"{level}: {msg % a}")

    async def run() -> None:
        backend = SchedulerBackend("bogus", os.path.join(sock_dir, "s.sock"), log=Log())
        await backend.ensure_started()
        assert backend.error and "GPUShareExtension.scheduler = 'bogus'" in backend.error
        with pytest.raises(SchedulerUnavailable, match="invalid configuration"):
            await backend.status()

    asyncio.run(run())
    assert [line for line in logged if line.startswith("error")], logged


def test_scheduler_cli_users_config_that_does_not_load(sock_dir: str) -> None:
    """A users config with a syntax error: one line, exit 2, nothing started (issue 22)."""
    users = Path(sock_dir) / "users.toml"
    users.write_text("[defaults\nquota = \n")
    socket = os.path.join(sock_dir, "s.sock")
    out = scheduler_cli(
        "--socket", socket, f"--GPUShareScheduler.users_config={users}", cwd=sock_dir
    )
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr and str(users) in out.stderr, out.stderr
    assert not os.path.exists(socket)
