"""The command line in plain words: ``gpushare run`` says "no NVIDIA GPU found" once when there is
none, ``gpushare status --watch`` redraws until Ctrl-C, and ``release``/``evict`` say what the
scheduler now does (``--json`` for the raw reply). Against a real scheduler and a real client
under the shim on the stand-in driver (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sched_helpers import late_evict_answer

from jupyter_gpushare import __version__

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    env.pop("LD_PRELOAD", None)
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env or _env(),
    )


def test_run_says_no_gpu_once(native_build: Any, tmp_path: Path) -> None:
    shim = str(native_build.require_shim())
    # No driver at all (an empty directory first on the library path, no libcuda anywhere).
    empty = tmp_path / "empty"
    empty.mkdir()
    no_driver = _env(GPUSHARE_LIBRARY=shim, LD_LIBRARY_PATH=str(empty))
    probe = subprocess.run(
        [sys.executable, "-c", "import ctypes; ctypes.CDLL('libcuda.so.1')"],
        env=no_driver,
        capture_output=True,
    )
    if probe.returncode == 0:
        import pytest

        pytest.skip("this machine has an NVIDIA driver installed system-wide")
    out = cli("run", "--", sys.executable, "-c", "print('ran')", env=no_driver)
    assert out.returncode == 0 and out.stdout.strip() == "ran", out
    assert out.stderr.count("no NVIDIA GPU found") == 1, out.stderr
    assert (
        "gpushare run: no NVIDIA GPU found (the NVIDIA driver's libcuda.so.1 is not " in out.stderr
    )
    # The stand-in driver reports a device: nothing is said.
    with_gpu = _env(GPUSHARE_LIBRARY=shim, LD_LIBRARY_PATH=str(native_build.fake_dir))
    out = cli("run", "--", sys.executable, "-c", "print('ran')", env=with_gpu)
    assert out.returncode == 0 and out.stdout.strip() == "ran", out
    assert "no NVIDIA GPU found" not in out.stderr, out.stderr


def test_release_and_evict_say_what_happens(harness: Any) -> None:
    sched = harness.scheduler(pool="1GiB", quantum=60.0)
    sock = str(harness.socket_path)
    holder = harness.spawn("hold", 60.0, 64 * MiB, 20000, client_id="A", idle_seconds=0)
    holder.wait_event("first_launch", 30)
    out = cli("release", "A", "--socket", sock)
    assert out.returncode == 0, out
    assert out.stdout.strip() == (
        "gpushare release: asked A to give the GPU back: its running GPU work finishes first, "
        "and its next GPU call waits for a turn"
    )
    sched.wait_log("control release client=A")
    out = cli("evict", "A", "--socket", sock)
    assert out.returncode == 0 and out.stdout.startswith("gpushare evict: asked A to give"), out
    assert "move its memory to host memory" in out.stdout
    out = cli("evict", "A", "--socket", sock, "--json")
    assert out.returncode == 0, out
    reply = json.loads(out.stdout)
    assert {k: reply[k] for k in ("ok", "action", "client")} == {
        "ok": True,
        "action": "evict",
        "client": "A",
    }
    # The scheduler says what it did (docs/protocol.md): a revoke, or why nothing went out.
    assert isinstance(reply["done"], bool) and reply["effect"]
    out = cli("release", "nobody", "--socket", sock)
    assert out.returncode == 1 and "no client 'nobody'" in out.stderr, out
    holder.kill()


def test_status_watch_redraws_until_ctrl_c(harness: Any) -> None:
    harness.scheduler(pool="1GiB")
    sock = str(harness.socket_path)
    holder = harness.spawn("hold", 60.0, 64 * MiB, 20000, client_id="A", idle_seconds=0)
    holder.wait_event("first_launch", 30)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter_gpushare",
            "status",
            "--watch",
            "--interval=0.2",
            f"--socket={sock}",
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    frames: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        while len(frames) < 4 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("Every 0.2 s, "):
                frames.append("")
            elif frames:
                frames[-1] += line
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        holder.kill()
    assert len(frames) == 4, frames
    # Each full redraw (the last one may be cut by Ctrl-C) is this scheduler's status, with the
    # client that holds the GPU.
    for frame in frames[:3]:
        assert f"gpushare scheduler {__version__} on {sock}" in frame, frame
        assert "holder: A " in frame, frame
        assert "not available" not in frame, frame
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    out = cli("status", "--watch", "--interval", "0", f"--socket={sock}")
    assert out.returncode == 2 and "--interval must be positive" in out.stderr


def test_evict_waits_for_a_checkpoint_longer_than_other_requests(tmp_path: Path) -> None:
    """An evict of a holder that ignores its revoke is answered once the driver's checkpoint has
    copied its memory to the host (scheduler/features/sleeping.py): seconds per tens of GiB.
    ``gpushare evict`` waits for that answer instead of giving up after the 10 s of every other
    request (it said the scheduler did not answer while the checkpoint went on). A stand-in
    scheduler answers 11 s after the request."""
    effect = "its process was checkpointed by root: 768.00 MiB left the GPU without its help"
    body = {"ok": True, "action": "evict", "client": "A", "done": True}
    body |= {"checkpointed": True, "effect": effect}
    with late_evict_answer(tmp_path / "s.sock", 11.0, body) as asked:
        started = time.monotonic()
        out = cli("evict", "A", "--socket", str(tmp_path / "s.sock"))
    assert out.returncode == 0, out
    assert out.stdout.strip() == f"gpushare evict: A: {effect}", out
    assert time.monotonic() - started >= 11.0
    assert len(asked) == 1, asked
