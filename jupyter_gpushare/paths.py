"""Where the scheduler's socket lives (docs/protocol.md, "Transport and identity")."""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["SYSTEM_SOCKET", "default_socket_path"]

SYSTEM_SOCKET = "/run/gpushare/scheduler.sock"


def default_socket_path(environ: Mapping[str, str] | None = None, uid: int | None = None) -> str:
    """The scheduler's socket path, computed exactly as the shim computes it.

    ``$GPUSHARE_SOCKET`` if set and non-empty; otherwise ``/run/gpushare/scheduler.sock`` for root
    and ``${XDG_RUNTIME_DIR:-/tmp}/gpushare-$UID/scheduler.sock`` for everyone else.
    """
    env = os.environ if environ is None else environ
    explicit = env.get("GPUSHARE_SOCKET")
    if explicit:
        return explicit
    if uid is None:
        uid = os.getuid()
    if uid == 0:
        return SYSTEM_SOCKET
    runtime = env.get("XDG_RUNTIME_DIR") or "/tmp"
    return os.path.join(runtime, f"gpushare-{uid}", "scheduler.sock")
