"""Helpers and fixtures for the scheduler shell tests: a live scheduler on a short temporary
socket path and fake shim clients that speak the protocol through jupyter_gpushare.protocol.

A uniquely named module (not conftest) so that ``from sched_helpers import ...`` never picks up
another directory's conftest; conftest.py re-exports the fixtures."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket as socketlib
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from jupyter_gpushare.protocol import (  # noqa: E402
    FrameDecoder,
    Message,
    MsgType,
    encode,
    read_message_sync,
    write_message_sync,
)
from jupyter_gpushare.scheduler.shell.server import GPUShareScheduler, PeerCred  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
DEVICE = "GPU-00000000-1111-2222-3333-444444444444"


@pytest.fixture
def sock_path(sock_dir: str) -> str:  # sock_dir: tests/conftest.py
    return os.path.join(sock_dir, "s.sock")


class FakeCredScheduler(GPUShareScheduler):
    """A scheduler whose peers' credentials can be faked: the n-th accepted connection gets
    ``fake_creds[n]`` (a dict of ``uid``/``pid`` overrides) when set, so authorisation and
    duplicate-id tests need no second user account or process."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fake_creds: list[dict[str, int] | None] = []
        self._accepted = 0

    def peer_credentials(self, sock: Any) -> PeerCred:
        real = super().peer_credentials(sock)
        n = self._accepted
        self._accepted += 1
        fake = self.fake_creds[n] if n < len(self.fake_creds) else None
        if fake:
            return PeerCred(fake.get("pid", real.pid), fake.get("uid", real.uid), real.gid)
        return real


@pytest.fixture
async def make_scheduler(sock_path: str) -> AsyncIterator[Any]:
    started: list[GPUShareScheduler] = []

    async def make(**kwargs: Any) -> FakeCredScheduler:
        kwargs.setdefault("socket_path", sock_path)
        kwargs.setdefault("use_nvml", False)
        kwargs.setdefault("pool_size", "1GiB")
        kwargs.setdefault("base_quantum", 30.0)
        # The scripted clients here read exact message sequences; pre-copy requests to idle
        # clients are tested on their own (test_scheduler_server.py).
        kwargs.setdefault("precopy_idle", False)
        # Faked credentials name this test's own pid: never checkpoint it (tests/native has the
        # deep-idle tests, on the stand-in driver).
        kwargs.setdefault("deep_idle_seconds", 0)
        # The node's host budget ("auto" reads this machine's memory) only where a test asks
        # for it: the scripted clients claim memory they do not have.
        kwargs.setdefault("host_budget", 0)
        server = FakeCredScheduler(**kwargs)
        await server.start()
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop()


@pytest.fixture
async def scheduler(make_scheduler: Any) -> FakeCredScheduler:
    return await make_scheduler()


class FakeShim:
    """A shim (or control peer) written in Python with the protocol module."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder()
        self.inbox: list[Message] = []
        self.client_id = ""

    @classmethod
    async def connect(cls, path: str) -> FakeShim:
        reader, writer = await asyncio.open_unix_connection(path)
        return cls(reader, writer)

    async def send(self, mtype: MsgType | int, **fields: Any) -> None:
        self.writer.write(encode(Message(mtype, fields)))
        await self.writer.drain()

    async def send_raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def hello(
        self,
        client_id: str,
        *,
        device: str = DEVICE,
        total: int = 80 * GiB,
        quota: int = 0,
        weight_milli: int = 1000,
        user: str = "tester",
        **extra: Any,
    ) -> Message:
        self.client_id = client_id
        await self.send(
            MsgType.HELLO,
            client_id=client_id,
            pid=os.getpid(),
            device_uuid=device,
            device_name="Fake GPU",
            device_total=total,
            quota=quota,
            weight_milli=weight_milli,
            user=user,
            label=f"{client_id}.ipynb",
            context_bytes=0,
            version="test",
            **extra,
        )
        return await self.expect(MsgType.WELCOME)

    async def request(self, used: int, *, managed: int | None = None, evicted: int = 0) -> None:
        await self.send(
            MsgType.REQUEST,
            used_bytes=used,
            managed_bytes=used if managed is None else managed,
            pinned_bytes=0 if managed is None else used - managed,
            evicted_bytes=evicted,
        )

    async def recv(self, timeout: float = 3.0) -> Message | None:
        """The next message, or None when the connection closed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.inbox:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"{self.client_id}: no message within {timeout}s")
            data = await asyncio.wait_for(self.reader.read(65536), remaining)
            if not data:
                return None
            self.inbox.extend(self.decoder.feed(data))
        return self.inbox.pop(0)

    async def expect(self, mtype: MsgType, timeout: float = 3.0) -> Message:
        msg = await self.recv(timeout)
        assert msg is not None, f"{self.client_id}: connection closed, expected {mtype.name}"
        assert msg.type == mtype, f"{self.client_id}: expected {mtype.name}, got {msg}"
        return msg

    async def expect_nothing(self, timeout: float = 0.3) -> None:
        try:
            msg = await self.recv(timeout)
        except (TimeoutError, asyncio.TimeoutError):
            return
        raise AssertionError(f"{self.client_id}: expected nothing, got {msg}")

    async def expect_closed(self, timeout: float = 3.0) -> None:
        msg = await self.recv(timeout)
        assert msg is None, f"{self.client_id}: expected the connection to close, got {msg}"

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()


@pytest.fixture
async def connect(sock_path: str) -> AsyncIterator[Any]:
    shims: list[FakeShim] = []

    async def _connect(path: str | None = None) -> FakeShim:
        shim = await FakeShim.connect(path or sock_path)
        shims.append(shim)
        return shim

    yield _connect
    for shim in shims:
        await shim.close()


@contextlib.contextmanager
def late_evict_answer(path: Path, delay: float, body: dict[str, Any]) -> Any:
    """A stand-in scheduler on ``path`` that answers an ``evict`` control ``delay`` seconds after
    it arrives (with ``body``): a checkpoint that takes that long (scheduler/features/
    sleeping.py). Other connections (a checkpoint agent) are held open, unanswered. Yields the
    control messages it was asked."""
    server = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    server.settimeout(0.2)
    asked: list[Message] = []
    held: list[socketlib.socket] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.settimeout(60)
            held.append(conn)
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    def answer(conn: socketlib.socket) -> None:
        with contextlib.suppress(OSError):
            message = read_message_sync(conn)
            if message.type != MsgType.CONTROL or message.get("body", {}).get("action") != "evict":
                return  # an agent's hello: kept open, never answered
            asked.append(message)
            time.sleep(delay)
            write_message_sync(conn, Message(MsgType.CONTROL_REPLY, {"body": body}))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield asked
    finally:
        stop.set()
        thread.join(5)
        server.close()
        for conn in held:
            conn.close()
