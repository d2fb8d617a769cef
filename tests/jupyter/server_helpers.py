"""Helpers and fixtures for the server extension's tests: a real jupyter-server with the gpushare
extension (pytest-jupyter's ``jp_serverapp``/``jp_fetch``/``jp_ws_fetch``), fake shim clients
that join its scheduler through the protocol, and kernel clients for real kernels.

The test modules import everything from here (``from server_helpers import *``): pytest-jupyter's
fixtures then apply to those modules only, not to the rest of tests/jupyter. pytest-jupyter runs
its server on ``jp_asyncio_loop``; pytest-asyncio (``asyncio_mode = auto``) runs the tests on a
loop of its own, so ``jp_asyncio_loop`` is overridden to be that loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pytest_jupyter.jupyter_server import *  # noqa: F403
from server_cleanup import jp_server_cleanup  # noqa: F401  (pytest-jupyter's, bounded)
from tornado.httpclient import HTTPClientError

from jupyter_gpushare.protocol import FrameDecoder, Message, MsgType, encode

MiB = 1 << 20
GiB = 1 << 30
DEVICE = "GPU-00000000-1111-2222-3333-444444444444"


@pytest.fixture
async def jp_asyncio_loop() -> AsyncIterator[asyncio.AbstractEventLoop]:  # type: ignore[no-redef]
    """The loop pytest-asyncio runs the test on (pytest-jupyter's servers must share it)."""
    yield asyncio.get_running_loop()


@pytest.fixture
def gpushare_config() -> dict[str, Any]:
    """Configuration of the extension and its embedded scheduler (tests may change it)."""
    return {
        "GPUShareExtension": {"status_interval": 0.1},
        "GPUShareScheduler": {"use_nvml": False, "pool_size": "1GiB", "base_quantum": 30.0},
    }


@pytest.fixture
def jp_server_config(gpushare_config: dict[str, Any]) -> dict[str, Any]:  # type: ignore[no-redef]
    config: dict[str, Any] = {
        "ServerApp": {"jpserver_extensions": {"jupyter_gpushare": True}},
        # Kernels on Unix sockets in the runtime directory (jp_runtime_dir): a TCP port picked
        # free can be taken by another process before the kernel binds it ("Address already in
        # use", a kernel that dies at its start; seen once on a loaded host).
        "KernelManager": {"transport": "ipc"},
    }
    for section, values in gpushare_config.items():
        config.setdefault(section, {}).update(values)
    return config


@pytest.fixture
def jp_runtime_dir() -> Iterator[Path]:  # type: ignore[no-redef]
    """A short runtime directory of its own (pytest-jupyter's is under tmp_path): the kernels'
    Unix sockets are named after their connection files there, and a socket's path has at most
    107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="jr-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _restore_gpushare_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extension sets $GPUSHARE_SOCKET in this process: undo it after each test."""
    monkeypatch.setenv("GPUSHARE_SOCKET", "")
    monkeypatch.delenv("GPUSHARE_SOCKET")


def extension(serverapp: Any) -> Any:
    """The GPUShareExtension instance of a running server."""
    point = serverapp.extension_manager.extension_points["jupyter_gpushare"]
    return point.app


async def started(serverapp: Any) -> Any:
    """The extension, once its scheduler has started (or failed to)."""
    ext = extension(serverapp)
    await ext.start_gpushare()
    await ext.backend.ensure_started()
    return ext


async def fetch_json(jp_fetch: Any, *parts: str, **kwargs: Any) -> Any:
    response = await jp_fetch(*parts, **kwargs)
    return json.loads(response.body.decode())


async def fetch_error(jp_fetch: Any, *parts: str, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    """The status code and JSON body of a request that must fail."""
    with pytest.raises(HTTPClientError) as info:
        await jp_fetch(*parts, **kwargs)
    err = info.value
    body: dict[str, Any] = {}
    if err.response is not None and err.response.body:
        try:
            body = json.loads(err.response.body.decode())
        except ValueError:
            body = {"raw": err.response.body.decode(errors="replace")}
    return err.code, body


def clients_of(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for d in doc.get("devices", []) for c in d.get("clients", [])}


async def wait_until(
    predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05, what: str = ""
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(interval)


class FakeShim:
    """A shim client written with the protocol module: joins the scheduler as ``client_id``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder()
        self.inbox: list[Message] = []

    @classmethod
    async def join(
        cls, path: str, client_id: str, *, used: int = 0, total: int = 16 * GiB
    ) -> FakeShim:
        reader, writer = await asyncio.open_unix_connection(path)
        shim = cls(reader, writer)
        await shim.send(
            MsgType.HELLO,
            client_id=client_id,
            pid=os.getpid(),
            device_uuid=DEVICE,
            device_name="Fake GPU",
            device_total=total,
            quota=0,
            weight_milli=1000,
            user="tester",
            label=f"{client_id}.ipynb",
            context_bytes=0,
            version="test",
        )
        await shim.expect(MsgType.WELCOME)
        if used:
            await shim.send(
                MsgType.MEMORY,
                used_bytes=used,
                managed_bytes=used,
                pinned_bytes=0,
                evicted_bytes=0,
            )
        return shim

    async def send(self, mtype: MsgType, **fields: Any) -> None:
        self.writer.write(encode(Message(mtype, fields)))
        await self.writer.drain()

    async def expect(self, mtype: MsgType, timeout: float = 5.0) -> Message:
        deadline = time.monotonic() + timeout
        while True:
            for i, msg in enumerate(self.inbox):
                if msg.type == mtype:
                    return self.inbox.pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {mtype.name} within {timeout}s (got {self.inbox})")
            data = await asyncio.wait_for(self.reader.read(65536), left)
            if not data:
                raise AssertionError(f"connection closed while waiting for {mtype.name}")
            self.inbox.extend(self.decoder.feed(data))

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


async def start_kernel(jp_fetch: Any, name: str = "python3", path: str | None = None) -> str:
    """Start a kernel through the REST API (a session when ``path`` is given); its id."""
    if path is None:
        model = await fetch_json(
            jp_fetch, "api", "kernels", method="POST", body=json.dumps({"name": name})
        )
        return str(model["id"])
    model = await fetch_json(
        jp_fetch,
        "api",
        "sessions",
        method="POST",
        body=json.dumps({"path": path, "type": "notebook", "kernel": {"name": name}}),
    )
    return str(model["kernel"]["id"])


async def kernel_client(serverapp: Any, kernel_id: str) -> Any:
    """A started, ready client of one of the server's kernels."""
    km = serverapp.kernel_manager.get_kernel(kernel_id)
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=60)
    return kc
