"""systemd's readiness protocol (sd_notify(3)) in a few lines, without a dependency: a service of
``Type=notify`` sends ``READY=1`` in a datagram to the Unix socket named by ``$NOTIFY_SOCKET``
(a path, or ``@name`` in the abstract namespace) once it serves; ``STOPPING=1`` as it stops.
Without ``$NOTIFY_SOCKET`` (not started by systemd) nothing is sent."""

from __future__ import annotations

import os
import socket

__all__ = ["sd_notify"]


def sd_notify(state: str) -> bool:
    """Send ``state`` (``"READY=1"``, ``"STOPPING=1"``, ``"STATUS=..."``, newline-separated) to
    systemd; True when it was sent. Never raises: readiness is a courtesy to the service
    manager, and a datagram to a local socket does not block."""
    path = os.environ.get("NOTIFY_SOCKET", "")
    if path.startswith("@"):
        path = "\0" + path[1:]
    elif not path.startswith("/"):
        return False  # unset, or a vsock address (VMs): not for a node daemon
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(1.0)
            sock.connect(path)
            sock.sendall(state.encode())
    except OSError:
        return False
    return True
