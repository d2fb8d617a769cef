"""A cell that keeps the GPU far past its quantum: the others are told why they wait, and the
operator sees it and can act.

The holder runs GPU kernels of 3 s each (the stand-in driver's sleep kernel): when its quantum
ends the scheduler revokes it, but the shim can only answer once the running kernel is done (the
revoke is honoured at the next kernel boundary). Meanwhile the waiter's status says so, with the
holder's user and how long it has been asked; ``gpushare status`` prints it; ``gpushare
release``/``evict`` act on clients by id.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20
CONTEXT = 64 * MiB
BIG = 640 * MiB
ROOT = Path(__file__).resolve().parents[2]


def common(**extra):
    return {"context_bytes": CONTEXT, "idle_seconds": 0, "log": "info", **extra}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_waiters_are_told_about_a_holder_past_its_quantum(harness):
    sched = harness.scheduler(pool="1GiB", quantum=1.0)
    sock = str(harness.socket_path)
    a = harness.spawn("hold", 30.0, BIG, 3_000_000, **common(client_id="A"))
    a.wait_event("first_launch", 30)
    b = harness.spawn("hold", 0.5, BIG, 20000, **common(client_id="B"))
    b.wait_event("hold_start", 30)

    deadline = time.monotonic() + 20
    while True:
        dev = sched.status()["devices"][0]
        clients = {c["id"]: c for c in dev["clients"]}
        wait = (clients.get("B") or {}).get("wait") or {}
        if wait.get("reason") == "releasing" and clients["A"]["revoking_seconds"] >= 1.0:
            break
        assert time.monotonic() < deadline, f"no 'releasing' wait reason: {dev}"
        time.sleep(0.1)
    assert wait["text"].startswith(f"waiting for {clients['A']['user']}'s kernel to finish its GPU")
    assert wait["holders"][0]["id"] == "A" and wait["holders"][0]["state"] == "revoking"
    assert clients["A"]["held_seconds"] > clients["A"]["quantum_seconds"]

    text = cli("status", "--socket", sock)
    assert text.returncode == 0, text
    assert "B: waiting for" in text.stdout and "A: asked to release" in text.stdout, text.stdout

    # The holder answers at its kernel boundary; the waiter runs.
    first = b.wait_event("first_copy", 30)
    assert first["waited"] > 1.0
    assert b.finish(60).ok().event("hold_end")["data_ok"]

    # The operator's levers, by client id.
    a.wait_event("tick", 30, where=lambda e: e["status"]["state"] == "holding")
    out = cli("evict", "A", "--socket", sock, "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["ok"] is True, out
    sched.wait_log("control evict client=A")
    out = cli("release", "nobody", "--socket", sock)
    assert out.returncode == 1 and "no client 'nobody'" in out.stderr, out
    out = cli("release", "--socket", sock)
    assert out.returncode == 2 and "one client id is needed" in out.stderr, out
    a.kill()
