"""The extension's kernel watching (iopub busy/idle → kernel_state) with real ipykernel kernels,
its scheduler modes (embedded, node, auto) and a base_url prefix."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from jupyter_client.session import Session
from server_helpers import *  # noqa: F403
from server_helpers import (
    FakeShim,
    clients_of,
    extension,
    fetch_error,
    fetch_json,
    kernel_client,
    start_kernel,
    started,
    wait_until,
)

from jupyter_gpushare.scheduler.shell.server import GPUShareScheduler


def transitions(ext: Any, kernel_id: str) -> list[tuple[str, str]]:
    return [(t.state, t.outcome) for t in ext.watcher.transitions if t.kernel_id == kernel_id]


async def run_cell(kc: Any, code: str, timeout: float = 30.0) -> dict[str, Any]:
    reply = await kc.execute_interactive(code, timeout=timeout, output_hook=lambda msg: None)
    assert reply["content"]["status"] == "ok", reply["content"]
    return reply


async def test_busy_idle_reach_the_scheduler(jp_fetch: Any, jp_serverapp: Any) -> None:
    ext = await started(jp_serverapp)
    kid = await start_kernel(jp_fetch, path="work/watched.ipynb")
    kc = await kernel_client(jp_serverapp, kid)
    try:
        await wait_until(lambda: kid in ext.watcher.watches, what="the kernel to be watched")
        # Not known to the scheduler yet (no shim in this kernel): transitions are sent and the
        # scheduler's not_found is ignored quietly.
        await run_cell(kc, "import time; time.sleep(0.2)")
        await wait_until(
            lambda: ("idle", "not_found") in transitions(ext, kid), what="an idle transition"
        )
        assert ("busy", "not_found") in transitions(ext, kid)
        # Now a client of that id joins (as the kernel's shim would): the states are accepted.
        shim = await FakeShim.join(ext.backend.socket_path, kid)
        try:
            before = len(transitions(ext, kid))
            await run_cell(kc, "x = 1")
            await wait_until(
                lambda: transitions(ext, kid)[before:] == [("busy", "ok"), ("idle", "ok")],
                what=f"busy/idle accepted (got {transitions(ext, kid)[before:]})",
            )
            # Requests that run no user code (kernel_info, completion) are not cells.
            before = len(transitions(ext, kid))
            await kc.kernel_info(reply=True, timeout=10)
            # A first completion loads jedi's view of the builtins: over 10 s on a loaded machine.
            await kc.complete("pri", reply=True, timeout=90)
            await asyncio.sleep(0.3)
            assert transitions(ext, kid)[before:] == []
            # The status shows the kernel's notebook through the session manager.
            doc = await fetch_json(jp_fetch, "gpushare", "api", "status")
            info = clients_of(doc)[kid]["jupyter"]
            assert info["local"] is True and info["kernel_id"] == kid
            assert info["paths"] == ["work/watched.ipynb"]
            assert info["kernel_name"] == "python3"
            # A kernel of this server: its user may release it.
            reply = await fetch_json(
                jp_fetch, "gpushare", "api", "kernels", kid, "release", method="POST", body=""
            )
            assert reply["ok"] is True
        finally:
            await shim.close()
    finally:
        kc.stop_channels()


async def test_restart_and_shutdown_stop_watching(jp_fetch: Any, jp_serverapp: Any) -> None:
    ext = await started(jp_serverapp)
    kid = await start_kernel(jp_fetch)
    await wait_until(lambda: kid in ext.watcher.watches, what="the kernel to be watched")
    old = ext.watcher.watches[kid]
    await jp_fetch("api", "kernels", kid, "restart", method="POST", body="")
    await wait_until(
        lambda: kid in ext.watcher.watches and ext.watcher.watches[kid] is not old,
        what="a new watch after the restart",
    )
    assert old.stream.closed()
    kc = await kernel_client(jp_serverapp, kid)
    try:
        before = len(transitions(ext, kid))
        await run_cell(kc, "y = 2")
        await wait_until(
            lambda: [s for s, _ in transitions(ext, kid)[before:]] == ["busy", "idle"],
            what="busy/idle after the restart",
        )
    finally:
        kc.stop_channels()
    new = ext.watcher.watches[kid]
    await jp_fetch("api", "kernels", kid, method="DELETE")
    await wait_until(lambda: kid not in ext.watcher.watches, what="the watch to end")
    assert new.stream.closed()


async def test_existing_kernels_are_watched(jp_fetch: Any, jp_serverapp: Any) -> None:
    ext = extension(jp_serverapp)
    await ext.backend.ensure_started()
    await ext.start_gpushare()
    await ext.watcher.stop()  # as if the extension started after this kernel
    kid = await start_kernel(jp_fetch)
    assert kid not in ext.watcher.watches
    ext.watcher.start()
    assert kid in ext.watcher.watches


# ---------------------------------------------------------------------------------------------
# Modes


@pytest.fixture
async def node_scheduler(sock_dir: str) -> Any:
    sched = GPUShareScheduler(socket_path=f"{sock_dir}/node.sock", use_nvml=False, pool_size="2GiB")
    await sched.start()
    try:
        yield sched
    finally:
        await sched.stop()


class TestNodeMode:
    @pytest.fixture
    def gpushare_config(self, node_scheduler: Any) -> dict[str, Any]:
        return {
            "GPUShareExtension": {
                "scheduler": "node",
                "socket": node_scheduler.socket_path,
                "status_interval": 0.1,
            }
        }

    async def test_node_scheduler(
        self, jp_fetch: Any, jp_ws_fetch: Any, jp_serverapp: Any, node_scheduler: Any
    ) -> None:
        import os

        ext = await started(jp_serverapp)
        assert ext.backend.mode == "node" and ext.backend.scheduler is None
        assert os.environ["GPUSHARE_SOCKET"] == node_scheduler.socket_path
        doc = await fetch_json(jp_fetch, "gpushare", "api", "status")
        assert doc["socket"] == node_scheduler.socket_path
        assert doc["scheduler"]["mode"] == "node"
        # Node mode without admin_users: the viewer is no admin.
        assert doc["viewer"]["admin"] is False
        # Nobody listens: the node scheduler is not polled.
        polls = ext.broadcaster.polls
        await asyncio.sleep(0.5)
        assert ext.broadcaster.polls == polls
        ws = await jp_ws_fetch("gpushare", "api", "events")
        try:
            first = json.loads(await asyncio.wait_for(ws.read_message(), 10))
            assert first["type"] == "status"
            shim = await FakeShim.join(node_scheduler.socket_path, "node-client")
            try:
                while True:
                    msg = json.loads(await asyncio.wait_for(ws.read_message(), 10))
                    if "node-client" in clients_of(msg["status"]):
                        break
            finally:
                await shim.close()
        finally:
            ws.close()
        await wait_until(lambda: not ext.broadcaster.subscribers, what="the subscriber to go")
        await asyncio.sleep(0.3)
        polls = ext.broadcaster.polls
        await asyncio.sleep(0.5)
        assert ext.broadcaster.polls == polls, "polling went on without a listener"
        # The node scheduler going away is a 503, with the reason.
        await node_scheduler.stop()
        code, body = await fetch_error(jp_fetch, "gpushare", "api", "status")
        assert code == 503
        assert node_scheduler.socket_path in body["message"]


class TestAutoMode:
    @pytest.fixture
    def gpushare_config(self, sock_dir: str) -> dict[str, Any]:
        return {
            "GPUShareExtension": {"scheduler": "auto", "socket": f"{sock_dir}/absent.sock"},
            "GPUShareScheduler": {"use_nvml": False},
        }

    async def test_auto_falls_back_to_embedded(
        self, jp_fetch: Any, jp_serverapp: Any, sock_dir: str
    ) -> None:
        import os

        ext = await started(jp_serverapp)
        assert ext.backend.mode == "embedded"
        assert ext.backend.socket_path != f"{sock_dir}/absent.sock"
        assert os.environ["GPUSHARE_SOCKET"] == ext.backend.socket_path
        doc = await fetch_json(jp_fetch, "gpushare", "api", "status")
        assert doc["scheduler"] == {
            "mode": "embedded",
            "requested": "auto",
            "socket": ext.backend.socket_path,
            "error": None,
        }


class TestAutoFindsNode:
    @pytest.fixture
    def gpushare_config(self, node_scheduler: Any) -> dict[str, Any]:
        return {"GPUShareExtension": {"scheduler": "auto", "socket": node_scheduler.socket_path}}

    async def test_auto_uses_node(self, jp_serverapp: Any, node_scheduler: Any) -> None:
        ext = await started(jp_serverapp)
        assert ext.backend.mode == "node"
        assert ext.backend.socket_path == node_scheduler.socket_path

    async def test_the_server_offers_to_checkpoint_its_kernels(
        self, jp_serverapp: Any, node_scheduler: Any
    ) -> None:
        """Deep idle under a node scheduler that may not checkpoint this user's kernels (a
        service account): the server, their parent and of their uid, is their checkpoint agent
        (docs/architecture.md, "Deep idle")."""
        import os

        await started(jp_serverapp)
        await wait_until(
            lambda: any(a.peer.pid == os.getpid() for a in node_scheduler._agents.values()),
            what="the server's checkpoint agent at the node scheduler",
        )


class TestBaseUrl:
    @pytest.fixture
    def jp_base_url(self) -> str:
        return "/user/alice/"

    async def test_api_lives_under_base_url(
        self, jp_fetch: Any, jp_serverapp: Any, http_server_client: Any, jp_auth_header: Any
    ) -> None:
        from tornado.httpclient import HTTPClientError

        await started(jp_serverapp)
        doc = await fetch_json(jp_fetch, "gpushare", "api", "status")
        assert doc["scheduler"]["mode"] == "embedded"
        with pytest.raises(HTTPClientError) as info:
            await http_server_client.fetch("/gpushare/api/status", headers=jp_auth_header)
        assert info.value.code == 404


async def test_a_cell_queued_behind_another_says_it_is_coming(
    jp_fetch: Any, jp_ws_fetch: Any, jp_serverapp: Any
) -> None:
    """Through the server's kernel websocket (serverextension/cell_hint.py): an execute request
    sent while the kernel runs a cell reaches the scheduler as ``kernel_state coming``; the first
    cell, sent while the kernel was idle, does not (its busy says the same)."""
    ext = await started(jp_serverapp)
    kid = await start_kernel(jp_fetch)
    await wait_until(lambda: kid in ext.watcher.watches, what="the kernel to be watched")
    ws = await jp_ws_fetch("api", "kernels", kid, "channels")
    session = Session()

    def execute(code: str) -> str:
        msg = session.msg("execute_request", {"code": code, "silent": False})
        msg["channel"] = "shell"
        return json.dumps(msg, default=str)

    try:
        await ws.write_message(execute("import time; time.sleep(3)"))
        await wait_until(
            lambda: ext.watcher.watches[kid].state == "busy", what="the first cell to run"
        )
        await ws.write_message(execute("x = 1"))
        await wait_until(
            lambda: any(state == "coming" for state, _ in transitions(ext, kid)),
            what=f"a coming transition (got {transitions(ext, kid)})",
        )
        states = [state for state, _ in transitions(ext, kid)]
        assert states.count("coming") == 1 and states.index("coming") > states.index("busy")
    finally:
        ws.close()
