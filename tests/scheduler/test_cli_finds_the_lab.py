"""`gpushare status` in another shell finds the scheduler embedded in a JupyterLab server, through
the owner-only runtime file that the server writes (issue 23, item 5), and `gpushare lab` gives
the lab's terminals this environment's `gpushare`."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jupyter_gpushare.launch import interpreter, lab_argv, lab_env
from jupyter_gpushare.paths import SYSTEM_SOCKET

ROOT = Path(__file__).resolve().parents[2]


def test_status_from_another_shell_finds_the_lab(tmp_path: Path) -> None:
    if os.geteuid() == 0 and os.path.exists(SYSTEM_SOCKET):
        pytest.skip(f"a node scheduler listens on {SYSTEM_SOCKET}: the CLI rightly asks it")
    runtime = tmp_path / "runtime"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "GPUSHARE"))}
    env |= {
        "JUPYTER_RUNTIME_DIR": str(runtime),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_DATA_DIR": str(tmp_path / "data"),
        "XDG_RUNTIME_DIR": str(tmp_path / "xdg"),  # no per-user default socket there
        "PYTHONPATH": str(ROOT),
    }
    argv = [sys.executable, "-m", "jupyter_server", "--port=0", "--ServerApp.open_browser=False"]
    argv += ["--ServerApp.allow_root=True", f"--ServerApp.root_dir={tmp_path}"]
    server = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 90
        while not list(runtime.glob("gpushare-lab-*.json")):
            assert server.poll() is None, "the server ended"
            assert time.monotonic() < deadline, "no runtime file within 90 s"
            time.sleep(0.2)
        [file] = runtime.glob("gpushare-lab-*.json")
        assert stat.S_IMODE(file.stat().st_mode) == 0o600
        status = subprocess.run(
            [sys.executable, "-m", "jupyter_gpushare", "status"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert str(runtime) in status.stdout.splitlines()[0], status.stdout
    finally:
        server.send_signal(signal.SIGTERM)  # a clean stop: the extension removes the file
        server.wait(timeout=60)
    assert not list(runtime.glob("gpushare-lab-*.json"))


def test_gpushare_lab_as_root_without_a_display() -> None:
    argv = lab_argv(["--port", "9999"], {"PATH": "/usr/bin"}, euid=0)
    start = len(interpreter())
    assert argv[start:] == ["--allow-root", "--no-browser", "--port", "9999"]
    as_user = lab_argv([], {"DISPLAY": ":0"}, euid=1000)
    assert as_user == interpreter()
    # The lab's terminals inherit the server's PATH: this environment's gpushare comes first.
    path = lab_env({"PATH": "/usr/bin"})["PATH"].split(os.pathsep)
    assert path[0] == str(Path(sys.executable).parent) and "/usr/bin" in path
