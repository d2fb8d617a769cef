"""Where the scheduler's socket lives (docs/protocol.md, "Transport and identity")."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

__all__ = ["SYSTEM_SOCKET", "default_socket_path", "socket_distrust"]

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


def per_user_directory(uid: int) -> str:
    """The name of the per-user socket directory (``gpushare-$UID``)."""
    return f"gpushare-{uid}"


def socket_distrust(path: str, uid: int | None = None) -> str | None:
    """Why the socket at ``path`` must not be used, or None (docs/protocol.md, "Trusting the
    socket"). A peer sends its user, token and command line in its first message: never to a
    socket another user could have put there.

    * The socket's directory must not be writable by its group or by everyone (anyone could
      swap the socket);
    * it must belong to this user or root; a directory of another account (a node scheduler's
      service account, /run/gpushare) is trusted only when the socket belongs to that account
      too, and never for this user's own ``gpushare-$UID`` directory, which another user could
      have made first (in /tmp when XDG_RUNTIME_DIR is unset);
    * the socket must belong to this user, root, or the directory's owner.

    Missing files are not refused here (connecting says they are missing).
    """
    me = os.getuid() if uid is None else uid
    directory = os.path.dirname(path) or "."
    try:
        dir_st = os.stat(directory)
    except OSError:
        return None
    trusted = {me, 0}
    if dir_st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "everyone" if dir_st.st_mode & stat.S_IWOTH else "its group"
        return f"refusing the socket: its directory {directory} is writable by {who}"
    if dir_st.st_uid not in trusted and os.path.basename(directory) == per_user_directory(me):
        return (
            f"refusing the socket: {directory} belongs to uid {dir_st.st_uid}, not to this "
            "user (another user made this user's socket directory)"
        )
    try:
        sock_st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(sock_st.st_mode):
        return f"refusing {path}: it is not a socket"
    if sock_st.st_uid not in trusted | {dir_st.st_uid} or (
        dir_st.st_uid not in trusted and sock_st.st_uid != dir_st.st_uid
    ):
        return f"refusing {path}: it belongs to uid {sock_st.st_uid}"
    return None
