"""Cells coming (serverextension/cell_hint.py): a shell execute request that passes the server's
kernel websocket while the kernel runs another cell tells the scheduler ``kernel_state coming``;
every message goes on to the kernel unchanged."""

from __future__ import annotations

import json
import logging
from typing import Any

from jupyter_client.session import Session
from jupyter_server.services.kernels.connection.base import serialize_msg_to_ws_v1
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection
from test_kernel_watch import KERNEL, Kernel, settle, watching

from jupyter_gpushare.serverextension.cell_hint import (
    WS_V1,
    execute_request_on_shell,
    hinting_class,
    install,
)

SESSION = Session()


class Conn:
    """What the check reads of a connection: its subprotocol and session."""

    def __init__(self, subprotocol: str | None = None) -> None:
        self.subprotocol, self.session = subprotocol, SESSION


def as_json(msg_type: str, channel: str = "shell") -> str:
    return json.dumps({**SESSION.msg(msg_type, {"code": "x = 1"}), "channel": channel}, default=str)


def as_v1(msg_type: str, channel: str = "shell") -> bytes:
    return serialize_msg_to_ws_v1(SESSION.msg(msg_type, {"code": "1"}), channel, SESSION.pack)


def test_a_shell_execute_request_is_recognised_in_both_websocket_protocols() -> None:
    assert execute_request_on_shell(Conn(), as_json("execute_request"))
    assert execute_request_on_shell(Conn(WS_V1), as_v1("execute_request"))
    assert not execute_request_on_shell(Conn(), as_json("complete_request"))
    assert not execute_request_on_shell(Conn(WS_V1), as_v1("kernel_info_request"))
    assert not execute_request_on_shell(Conn(), as_json("execute_request", channel="control"))


def test_the_wrapped_connection_hints_and_passes_every_message_on() -> None:
    passed: list[Any] = []
    hints: list[str] = []

    class Base:
        kernel_id, subprotocol, session = KERNEL, None, SESSION
        log = logging.getLogger("test")

        def handle_incoming_message(self, incoming_msg: Any) -> None:
            passed.append(incoming_msg)

    conn = hinting_class(Base, hints.append)()
    conn.handle_incoming_message(as_json("execute_request"))
    conn.handle_incoming_message(as_json("inspect_request"))
    conn.handle_incoming_message('{"execute_request": not json')  # unreadable: passed on
    assert hints == [KERNEL]
    assert len(passed) == 3


def test_install_wraps_the_configured_class_once() -> None:
    settings: dict[str, Any] = {}
    cls = install(settings, lambda kernel_id: None)
    assert settings["kernel_websocket_connection_class"] is cls
    assert issubclass(cls, ZMQChannelsWebsocketConnection)
    assert install(settings, lambda kernel_id: None) is cls


async def test_a_cell_coming_is_told_only_while_the_kernel_runs_another() -> None:
    kernel = Kernel()
    watcher, w, sent = await watching(kernel)
    watcher.watches[KERNEL] = w
    watcher.coming(KERNEL)  # idle: its busy follows at once and says the same
    cell = kernel.request()
    watcher._on_iopub(w, kernel.status("busy", cell))
    watcher.coming(KERNEL)  # queued behind the running cell
    watcher.coming("another-kernel")  # not watched
    await settle(watcher)
    assert sent == [(KERNEL, "busy"), (KERNEL, "coming")]
