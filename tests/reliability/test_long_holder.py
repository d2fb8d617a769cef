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

from jupyter_gpushare import status_text

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
    # 120 s: A is still there for the operator's levers at the end (killed then), however slow
    a = harness.spawn("hold", 120.0, BIG, 3_000_000, **common(client_id="A"))
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

    # The command line's text of that status. Read by a second process, it may come after A's
    # answer on a loaded machine (A answers at the end of its 3 s kernel): the status it read
    # says which lines it must show, and the text must show them.
    text = cli("status", "--socket", sock, "--json")
    assert text.returncode == 0, text
    shown = {c["id"]: c for d in json.loads(text.stdout)["devices"] for c in d["clients"]}
    lines = status_text.explanations(list(shown.values()))
    if (shown.get("B") or {}).get("wait"):
        assert any(line.startswith("  B: waiting for") for line in lines), lines
    if (shown.get("A") or {}).get("revoking_seconds", 0) >= 1.0:
        assert any(line.startswith("  A: asked to release") for line in lines), lines
    # And the holder's line on its own, from the status the loop above read.
    (held,) = [ln for ln in status_text.explanations([clients["A"]]) if "asked to release" in ln]
    assert held.startswith(f"  A: asked to release {clients['A']['revoking_seconds']:.0f}s ago")

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
