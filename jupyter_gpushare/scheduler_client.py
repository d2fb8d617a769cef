"""A small client for the scheduler's control messages (``gpushare status``, the server extension).

    >>> client = SchedulerClient()                      # the default socket
    >>> doc = client.status_sync()                      # the status document (docs/protocol.md)
    >>> await client.control("kernel_state", client="k1", state="idle")

Every call opens its own connection, sends one message and reads one answer: there is no state to
go stale when the scheduler restarts. A missing or unreachable scheduler raises
:class:`SchedulerUnavailable`; a refused request raises :class:`SchedulerError` with the protocol's
error code.

Identity: every message carries ``user`` and ``token`` when they are known (the arguments, else
``$GPUSHARE_USER`` and ``$GPUSHARE_USER_TOKEN``): a scheduler whose ``token_uids`` include this
process's uid (JupyterHub, Kubernetes) needs them to know which user speaks; for any other uid it
goes by ``SO_PEERCRED`` and ignores them (docs/protocol.md, "Transport and identity").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any

from .identity import ENV_TOKEN, ENV_USER
from .paths import (
    SocketDistrusted,
    check_peer,
    connect_trusted,
    default_socket_path,
    open_socket_directory,
    service_uid,
    via_directory,
)
from .protocol import (
    ErrorCode,
    Message,
    MsgType,
    ProtocolError,
    encode,
    read_message,
    read_message_sync,
    write_message_sync,
)

__all__ = ["SchedulerClient", "SchedulerError", "SchedulerUnavailable"]


class SchedulerUnavailable(ConnectionError):
    """No scheduler answers on the socket (not running, wrong path, no permission)."""

    def __init__(self, socket_path: str, reason: str) -> None:
        super().__init__(f"gpushare scheduler not available at {socket_path}: {reason}")
        self.socket_path = socket_path
        self.reason = reason


class SchedulerError(Exception):
    """The scheduler answered ERROR."""

    def __init__(self, code: int, message: str) -> None:
        try:
            name = ErrorCode(code).name.lower()
        except ValueError:
            name = f"error {code}"
        super().__init__(f"{name}: {message}")
        self.code = code
        self.name = name
        self.message = message


def _unavailable(path: str, exc: BaseException) -> SchedulerUnavailable:
    if isinstance(exc, FileNotFoundError):
        reason = "the socket does not exist (is `gpushare scheduler` running?)"
    elif isinstance(exc, ConnectionRefusedError):
        reason = "connection refused (a stale socket: the scheduler is not running)"
    elif isinstance(exc, PermissionError):
        reason = "permission denied"
    elif isinstance(exc, (TimeoutError, asyncio.TimeoutError, socket.timeout)):
        reason = "timed out"
    else:
        reason = str(exc) or exc.__class__.__name__
    return SchedulerUnavailable(path, reason)


async def _connect_trusted_async(path: str, timeout: float) -> socket.socket:
    """:func:`paths.connect_trusted` without blocking the event loop on the connect: the
    directory checked on its fd, connected through it, the peer checked before any byte."""
    service = service_uid()
    fd = open_socket_directory(path, service=service)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(loop.sock_connect(sock, via_directory(fd, path)), timeout)
        check_peer(sock, path, service=service)
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(fd)
    return sock


def _answer(path: str, reply: Message | None, expected: MsgType) -> dict[str, Any]:
    if reply is None:
        raise SchedulerUnavailable(path, "the scheduler closed the connection without answering")
    if reply.type == MsgType.ERROR:
        raise SchedulerError(int(reply.get("error_code", 0)), str(reply.get("message", "")))
    if reply.type != expected:
        raise SchedulerError(
            int(ErrorCode.UNEXPECTED), f"expected {expected.name}, got {reply.type_name}"
        )
    body = reply.get("body")
    if not isinstance(body, dict):
        raise SchedulerError(int(ErrorCode.BAD_FRAME), f"{expected.name} without a body object")
    return body


#: Seconds a request waits to connect, and again for its answer, unless its caller says more.
REQUEST_SECONDS = 10.0


class SchedulerClient:
    """Talks to the scheduler at ``socket_path`` (default: :func:`default_socket_path`)."""

    def __init__(
        self,
        socket_path: str | None = None,
        timeout: float = REQUEST_SECONDS,
        *,
        user: str | None = None,
        token: str | None = None,
    ) -> None:
        self.socket_path = socket_path or default_socket_path()
        self.timeout = timeout
        self.user = user if user is not None else os.environ.get(ENV_USER, "")
        self.token = token if token is not None else os.environ.get(ENV_TOKEN, "")

    def _identified(self, msg: Message) -> Message:
        """``msg`` with this client's user and token (docs/protocol.md), when it has them."""
        fields = dict(msg.fields)
        if self.user:
            fields["user"] = self.user
        if self.token:
            fields["token"] = self.token
        return Message(msg.type, fields)

    # -- async ------------------------------------------------------------------------------

    async def request(self, msg: Message, expected: MsgType) -> dict[str, Any]:
        path = self.socket_path
        try:
            sock = await _connect_trusted_async(path, self.timeout)
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        except SocketDistrusted as exc:
            raise SchedulerUnavailable(path, str(exc)) from exc
        except (OSError, asyncio.TimeoutError) as exc:
            raise _unavailable(path, exc) from exc
        try:
            writer.write(encode(self._identified(msg)))
            await writer.drain()
            reply = await asyncio.wait_for(read_message(reader), self.timeout)
        except ProtocolError as exc:
            raise SchedulerError(int(exc.code), f"bad answer from the scheduler: {exc}") from exc
        except (OSError, asyncio.TimeoutError) as exc:
            raise _unavailable(path, exc) from exc
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        return _answer(path, reply, expected)

    async def status(self, device: str | None = None) -> dict[str, Any]:
        """The status document (all devices, or the one of UUID ``device``)."""
        return await self.request(_status_message(device), MsgType.STATUS)

    async def control(self, action: str, **kwargs: Any) -> dict[str, Any]:
        """Send a control action (``release``, ``evict``, ``set_quota``, ``kernel_state``,
        ``place``)."""
        return await self.request(_control_message(action, kwargs), MsgType.CONTROL_REPLY)

    async def release(self, client: str) -> dict[str, Any]:
        return await self.control("release", client=client)

    async def evict(self, client: str) -> dict[str, Any]:
        return await self.control("evict", client=client)

    async def set_quota(self, client: str, quota: int) -> dict[str, Any]:
        return await self.control("set_quota", client=client, quota=quota)

    async def kernel_state(self, client: str, state: str) -> dict[str, Any]:
        return await self.control("kernel_state", client=client, state=state)

    async def place(
        self,
        client: str,
        need: int | None = None,
        device: str | int | None = None,
        reachable: list[str] | None = None,
    ) -> dict[str, Any]:
        """Ask which GPU a kernel about to start goes to (and reserve room there); only the
        GPUs of UUIDs in ``reachable`` are candidates when it is given."""
        fields: dict[str, Any] = {"client": client}
        if need:
            fields["need"] = need
        if device is not None and device != "":
            fields["device"] = device
        if reachable is not None:
            fields["reachable"] = reachable
        return await self.control("place", **fields)

    # -- sync -------------------------------------------------------------------------------

    def request_sync(self, msg: Message, expected: MsgType) -> dict[str, Any]:
        path = self.socket_path
        try:
            sock = connect_trusted(path, self.timeout)
        except SocketDistrusted as exc:
            raise SchedulerUnavailable(path, str(exc)) from exc
        except OSError as exc:
            raise _unavailable(path, exc) from exc
        try:
            try:
                write_message_sync(sock, self._identified(msg))
                reply = read_message_sync(sock)
            except ProtocolError as exc:
                raise SchedulerError(
                    int(exc.code), f"bad answer from the scheduler: {exc}"
                ) from exc
            except OSError as exc:
                raise _unavailable(path, exc) from exc
        finally:
            sock.close()
        return _answer(path, reply, expected)

    def status_sync(self, device: str | None = None) -> dict[str, Any]:
        return self.request_sync(_status_message(device), MsgType.STATUS)

    def control_sync(self, action: str, **kwargs: Any) -> dict[str, Any]:
        return self.request_sync(_control_message(action, kwargs), MsgType.CONTROL_REPLY)


def _status_message(device: str | None) -> Message:
    return Message(MsgType.STATUS_REQUEST, {"body": {"device": device}} if device else {})


def _control_message(action: str, kwargs: dict[str, Any]) -> Message:
    return Message(MsgType.CONTROL, {"body": {"action": action, **kwargs}})
