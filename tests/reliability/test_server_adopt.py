"""The Jupyter server killed (SIGKILL) and started again with
``c.GPUShareProvisioner.survive_server_restart = True`` under a node scheduler: its gpushare
kernel outlives it and the new server adopts it (docs/reliability.md, "The Jupyter server
restarted"). The kernel keeps its id, its state (a variable set before the crash) and its
scheduler client (same id, same memory); a notebook reconnects through the new server's
websocket and runs cells; shutting it down there ends it and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from provisioner_helpers import GPU_PRELUDE
from test_server_crash import TOKEN, MiB, Server, kernelspec_and_env, pid_alive, run_cell
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect


async def _execute(port: int, kid: str, code: str, expressions: dict[str, str]) -> dict[str, Any]:
    """Run ``code`` in kernel ``kid`` through the server's kernel websocket, as a notebook does;
    returns the execute_reply's content."""
    request = HTTPRequest(
        f"ws://127.0.0.1:{port}/api/kernels/{kid}/channels?session_id={uuid.uuid4().hex}",
        headers={"Authorization": f"token {TOKEN}"},
    )
    ws = await websocket_connect(request)
    try:
        msg_id = uuid.uuid4().hex
        ws.write_message(
            json.dumps(
                {
                    "header": {
                        "msg_id": msg_id,
                        "msg_type": "execute_request",
                        "session": uuid.uuid4().hex,
                        "username": "test",
                        "version": "5.3",
                        "date": "2026-01-01T00:00:00Z",
                    },
                    "parent_header": {},
                    "metadata": {},
                    "content": {
                        "code": code,
                        "silent": False,
                        "store_history": True,
                        "user_expressions": expressions,
                        "allow_stdin": False,
                        "stop_on_error": True,
                    },
                    "channel": "shell",
                    "buffers": [],
                }
            )
        )
        while True:
            raw = await asyncio.wait_for(ws.read_message(), 60)
            assert raw is not None, "the websocket closed"
            msg = json.loads(raw)
            if (
                msg.get("msg_type") == "execute_reply"
                and msg.get("parent_header", {}).get("msg_id") == msg_id
            ):
                return dict(msg["content"])
    finally:
        ws.close()


def _clients(sched: Any) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for d in sched.status()["devices"] for c in d["clients"]}


@pytest.mark.timeout(240)
def test_server_killed_kernel_survives_and_is_adopted(harness, tmp_path):
    sched = harness.scheduler(pool="1GiB", quantum=30.0)
    env, runtime = kernelspec_and_env(harness, tmp_path, "gpushare-adopt")
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "jupyter_server_config.py").write_text(
        "c.GPUShareProvisioner.survive_server_restart = True\n"
    )
    sock = str(harness.socket_path)
    t0 = time.monotonic()
    first = Server(tmp_path, env, sock).start()
    first_up = time.monotonic() - t0  # the baseline: a server's start on this machine, now
    second: Server | None = None
    kernel_pid = 0
    try:
        notebook = {"path": "nb.ipynb", "name": "nb.ipynb", "type": "notebook"}
        session = first.request(
            "POST", "api/sessions", notebook | {"kernel": {"name": "gpushare-adopt"}}
        )
        kid = session["kernel"]["id"]
        run_cell(runtime, kid, GPU_PRELUDE + f"\nassert alloc({300 * MiB})[0] == 0\nx = 41\n")
        before = _clients(sched)[kid]
        assert before["used_bytes"] == 316 * MiB, before
        kernel_pid = before["pid"]
        record = runtime / f"gpushare-kernel-{kid}.json"
        assert json.loads(record.read_text())["provisioner_info"]["pid"] == kernel_pid

        first.kill()
        # ipykernel's parent poller checks every second: past 2.5 s it would have ended it.
        time.sleep(2.5)
        assert pid_alive(kernel_pid), "the kernel ended with its server"
        after_kill = _clients(sched)[kid]
        assert (after_kill["pid"], after_kill["used_bytes"]) == (kernel_pid, 316 * MiB)

        t0 = time.monotonic()
        second = Server(tmp_path, env, sock).start()
        # The server answers requests while its extensions start: adoption follows shortly,
        # within 3x the first server's start (measured above, on the same machine and load).
        while not (kernels := second.get("api/kernels")):
            assert time.monotonic() - t0 < 3 * first_up, (first_up, second.log.read_text())
            time.sleep(0.05)
        started = time.monotonic() - t0
        (listed,) = kernels
        assert listed["id"] == kid and listed["name"] == "gpushare-adopt", listed
        assert "gpushare: adopted kernel " + kid in second.log.read_text()

        # Reopening the notebook finds its kernel (a new session of the same path and kernel).
        reopened = second.request("POST", "api/sessions", notebook | {"kernel": {"name": "x"}})
        assert reopened["kernel"]["id"] == kid and reopened["path"] == "nb.ipynb", reopened
        assert [s["kernel"]["id"] for s in second.get("api/sessions")] == [kid]

        # A notebook reconnects through the new server and uses the state from before.
        reply = asyncio.run(
            _execute(second.port, kid, f"y = x + 1\nassert alloc({50 * MiB})[0] == 0", {"y": "y"})
        )
        assert reply["status"] == "ok", reply
        assert reply["user_expressions"]["y"]["data"]["text/plain"] == "42", reply

        clients = _clients(sched)
        assert list(clients) == [kid], clients  # the same client, not a new one
        assert clients[kid]["pid"] == kernel_pid
        assert clients[kid]["used_bytes"] == 366 * MiB, clients[kid]
        doc = second.get("gpushare/api/status")
        (client,) = [c for d in doc["devices"] for c in d["clients"]]
        assert client["id"] == kid and client["jupyter"]["local"] is True, client
        print(f"new server up and kernel adopted in {started:.2f} s (first start {first_up:.2f} s)")

        # A restart in the new server starts a child of its own under the same id and record.
        second.request("POST", f"api/kernels/{kid}/restart")
        assert not pid_alive(kernel_pid), "the adopted process outlived its restart"
        restarted = json.loads(record.read_text())["provisioner_info"]["pid"]
        assert restarted != kernel_pid and pid_alive(restarted)
        run_cell(runtime, kid, GPU_PRELUDE + f"\nassert alloc({10 * MiB})[0] == 0\n")
        assert _clients(sched)[kid]["pid"] == restarted
        kernel_pid = restarted

        # Shut down in the new server: the process ends, the scheduler and the runtime dir
        # keep nothing of it.
        second.request("DELETE", f"api/kernels/{kid}")
        deadline = time.monotonic() + 20
        while pid_alive(kernel_pid) or kid in _clients(sched):
            assert time.monotonic() < deadline, "the adopted kernel did not end"
            time.sleep(0.05)
        assert second.get("api/kernels") == []
        assert not record.exists()
        assert not (runtime / f"kernel-{kid}.json").exists()
    finally:
        if second is not None:
            second.stop()
        first.kill()
        if kernel_pid and pid_alive(kernel_pid):
            os.kill(kernel_pid, 9)


def _adopt_without_server(runtime: Path, embedded: bool) -> dict[str, list[str]]:
    """adopt_kernels on ``runtime`` with no kernel manager and no scheduler: what it does
    before it would need either."""
    import logging

    from jupyter_gpushare.adoption import adopt_kernels

    async def no_status() -> dict[str, Any]:
        raise AssertionError("no scheduler needed")

    return asyncio.run(
        adopt_kernels(
            {},
            str(runtime),
            embedded=embedded,
            scheduler_status=no_status,
            log=logging.getLogger("test"),
        )
    )


@pytest.mark.timeout(60)
def test_embedded_scheduler_survivors_are_ended(tmp_path):
    """With an embedded scheduler the survivor's scheduler died with its server: the new server
    ends it (SIGTERM to its process group) instead of adopting it, and removes its record."""
    import subprocess

    from jupyter_gpushare.adoption import process_start_time

    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        doc = {
            "kernel_id": "orphan",
            "server_pid": 999999999,
            "provisioner_info": {"pid": proc.pid, "pgid": proc.pid},
            "start_time": process_start_time(proc.pid),
        }
        (tmp_path / "gpushare-kernel-orphan.json").write_text(json.dumps(doc))
        (tmp_path / "kernel-orphan.json").write_text("{}")
        outcome = _adopt_without_server(tmp_path, embedded=True)
        assert outcome["ended"] == ["orphan"], outcome
        assert proc.wait(10) == -15
        assert list(tmp_path.iterdir()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(60)
def test_records_of_gone_kernels_are_removed_and_live_servers_left_alone(tmp_path):
    """adopt_kernels' bookkeeping without a server: a record whose kernel process is gone is
    removed (with its connection file); one of a server that still runs is left alone."""
    from jupyter_gpushare.adoption import process_start_time

    runtime = tmp_path
    gone = {
        "kernel_id": "gone",
        "server_pid": 999999999,
        "provisioner_info": {"pid": 999999998},
        "start_time": 1,
    }
    mine = {
        "kernel_id": "other-server",
        "server_pid": os.getppid(),
        "server_start_time": process_start_time(os.getppid()),
        "provisioner_info": {"pid": os.getpid()},
        "start_time": process_start_time(os.getpid()),
    }
    for doc in (gone, mine):
        (runtime / f"gpushare-kernel-{doc['kernel_id']}.json").write_text(json.dumps(doc))
    (runtime / "kernel-gone.json").write_text("{}")
    (runtime / "gpushare-kernel-broken.json").write_text("{not json")

    outcome = _adopt_without_server(runtime, embedded=False)
    assert outcome == {"adopted": [], "ended": [], "gone": ["gone"], "skipped": []}
    left = sorted(p.name for p in Path(runtime).iterdir())
    assert left == ["gpushare-kernel-other-server.json"], left
