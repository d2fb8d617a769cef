"""Cells coming: a notebook's execute request, seen before the kernel takes it.

The kernel watcher (:mod:`.kernel_watch`) hears of a cell when the kernel starts it (iopub
``busy``). A cell queued behind another in the same kernel (run all, or shift-enter twice) is
known earlier: its ``execute_request`` passes through the server's kernel websocket while the
kernel still runs the cell before it. The server extension wraps the server's websocket
connection class (:func:`install`) so that a shell ``execute_request`` for a kernel the watcher
sees busy tells the scheduler ``kernel_state coming``; the scheduler may then restore the
kernel's evicted memory ahead of its turn (docs/architecture.md, "Restore ahead"). The request
goes on to the kernel unchanged, and a message that cannot be read is passed on all the same.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from jupyter_server.services.kernels.connection.base import (
    deserialize_binary_message,
    deserialize_msg_from_ws_v1,
)
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection

__all__ = ["EXECUTE_REQUEST", "execute_request_on_shell", "hinting_class", "install"]

EXECUTE_REQUEST = "execute_request"
WS_V1 = "v1.kernel.websocket.jupyter.org"
SETTING = "kernel_websocket_connection_class"


def execute_request_on_shell(conn: Any, incoming: str | bytes) -> bool:
    """Whether the websocket message ``incoming`` of the connection ``conn`` is a shell
    ``execute_request`` (a substring test first: other messages are not parsed)."""
    needle: str | bytes = EXECUTE_REQUEST if isinstance(incoming, str) else EXECUTE_REQUEST.encode()
    if needle not in incoming:  # type: ignore[operator]
        return False
    if getattr(conn, "subprotocol", None) == WS_V1:
        channel, parts = deserialize_msg_from_ws_v1(incoming)
        header = conn.session.unpack(parts[0])
    else:
        msg = deserialize_binary_message(incoming) if isinstance(incoming, bytes) else None
        msg = msg if msg is not None else json.loads(incoming)
        channel, header = msg.get("channel"), msg.get("header") or {}
    return (channel or "shell") == "shell" and header.get("msg_type") == EXECUTE_REQUEST


def hinting_class(base: type, hint: Callable[[str], None]) -> type:
    """``base`` (a kernel websocket connection class) that calls ``hint(kernel_id)`` for each
    shell execute request before passing it on."""

    class HintingConnection(base):  # type: ignore[misc,valid-type]
        def handle_incoming_message(self, incoming_msg: Any) -> None:
            try:
                if execute_request_on_shell(self, incoming_msg):
                    hint(str(self.kernel_id))
            except Exception:  # a hint is never worth a lost message
                self.log.debug("gpushare: no cell hint from a websocket message", exc_info=True)
            super().handle_incoming_message(incoming_msg)

    HintingConnection.__name__ = HintingConnection.__qualname__ = f"GPUShare{base.__name__}"
    return HintingConnection


def install(settings: dict[str, Any], hint: Callable[[str], None]) -> type:
    """Wrap the server's kernel websocket connection class (the one configured, else jupyter
    server's own) in the tornado ``settings``; returns the class now in use."""
    base = settings.get(SETTING) or ZMQChannelsWebsocketConnection
    if getattr(base, "gpushare_hint", None) is not None:
        return base  # installed already (a second start)
    cls = hinting_class(base, hint)
    cls.gpushare_hint = hint  # type: ignore[attr-defined]
    settings[SETTING] = cls
    return cls
