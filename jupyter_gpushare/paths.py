"""Where the scheduler's socket lives (docs/protocol.md, "Transport and identity")."""

from __future__ import annotations

import errno
import os
import pwd
import socket
import stat
import struct
from collections.abc import Mapping

__all__ = [
    "ENV_SERVICE_USER",
    "SYSTEM_SOCKET",
    "SocketDistrusted",
    "check_peer",
    "connect_trusted",
    "default_socket_path",
    "open_own_directory",
    "open_socket_directory",
    "service_uid",
    "socket_distrust",
    "via_directory",
]

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


ENV_SERVICE_USER = "GPUSHARE_SERVICE_USER"


class SocketDistrusted(Exception):
    """The socket, its directory or the peer answering there is not one this user may trust."""


def service_uid(environ: Mapping[str, str] | None = None) -> int | None:
    """The uid of the service account the operator names (``$GPUSHARE_SERVICE_USER``: a user
    name or a uid), or None. Never inferred from who owns a file (issue 22, item 2); an unknown
    name trusts nobody more."""
    env = os.environ if environ is None else environ
    name = env.get(ENV_SERVICE_USER, "")
    if not name:
        return None
    if name.isdigit():
        return int(name)
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


def trusted_uids(uid: int | None = None, service: int | None = None) -> frozenset[int]:
    """Whom a peer may send its HELLO: itself, root, the named service account."""
    me = os.getuid() if uid is None else uid
    return frozenset({me, 0} | ({service} if service is not None else set()))


def _check_directory(directory: str, st: os.stat_result, me: int, trusted: frozenset[int]) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise SocketDistrusted(f"refusing the socket: {directory} is not a directory")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "everyone" if st.st_mode & stat.S_IWOTH else "its group"
        raise SocketDistrusted(
            f"refusing the socket: its directory {directory} is writable by {who}"
        )
    if st.st_uid not in (me, 0) and os.path.basename(directory) == per_user_directory(me):
        raise SocketDistrusted(
            f"refusing the socket: {directory} belongs to uid {st.st_uid}, not to this "
            "user (another user made this user's socket directory)"
        )
    if st.st_uid not in trusted:
        raise SocketDistrusted(
            f"refusing the socket: its directory {directory} belongs to uid {st.st_uid} "
            f"(not this user, root or {ENV_SERVICE_USER})"
        )


def _open_checked_directory(directory: str, me: int, trusted: frozenset[int]) -> int:
    """``directory`` opened with O_PATH|O_NOFOLLOW|O_DIRECTORY and checked on the fd
    (:func:`_check_directory`); a link is refused. The caller closes the fd."""
    try:
        fd = os.open(directory, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        if isinstance(exc, NotADirectoryError) or exc.errno == errno.ELOOP:
            raise SocketDistrusted(
                f"refusing the socket: its directory {directory} is a link or not a directory"
            ) from exc
        raise
    try:
        _check_directory(directory, os.fstat(fd), me, trusted)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_socket_directory(path: str, uid: int | None = None, service: int | None = None) -> int:
    """The socket's directory, opened without following a link (O_PATH), checked on that fd,
    with the socket in it checked too (docs/protocol.md, "Trusting the socket"). Connect through
    the fd (:func:`via_directory`): what is checked is what is connected to. Raises
    :class:`SocketDistrusted`, or OSError when something is missing. The caller closes the fd.

    * The directory is not writable by its group or by everyone (anyone could swap the socket);
    * it belongs to this user, root or the named service account, and this user's own
      ``gpushare-$UID`` directory (which anyone could make first in /tmp) to this user or root;
    * the socket is a socket and belongs to one of those.
    """
    me = os.getuid() if uid is None else uid
    trusted = trusted_uids(me, service)
    base = os.path.basename(path)
    fd = _open_checked_directory(os.path.dirname(path) or ".", me, trusted)
    try:
        sock_st = os.stat(base, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISSOCK(sock_st.st_mode):
            raise SocketDistrusted(f"refusing {path}: it is not a socket")
        if sock_st.st_uid not in trusted:
            raise SocketDistrusted(f"refusing {path}: it belongs to uid {sock_st.st_uid}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_own_directory(directory: str, uid: int | None = None) -> int:
    """For a scheduler about to put its socket in ``directory``: the directory opened without
    following a link (O_PATH), that belongs to this user or root and that neither its group nor
    everyone may write, checked on the fd. Bind through it (:func:`via_directory`) and rename
    with ``src_dir_fd``/``dst_dir_fd``: a symlink flipped since the check cannot move the
    socket into another user's directory. Raises :class:`SocketDistrusted` or OSError; the
    caller closes the fd."""
    me = os.getuid() if uid is None else uid
    return _open_checked_directory(directory, me, frozenset({me, 0}))


def via_directory(fd: int, path: str) -> str:
    """The address that reaches ``path``'s socket through its opened directory ``fd``:
    ``/proc/self/fd/N/<name>`` walks from that directory, so a link flipped since cannot send
    the connection elsewhere (no privilege, no chdir; it also lifts sun_path's limit on the
    directory part). Without /proc, the path itself (the peer check still holds)."""
    via = f"/proc/self/fd/{fd}"
    return f"{via}/{os.path.basename(path)}" if os.path.isdir(via) else path


def check_peer(
    sock: socket.socket, path: str, uid: int | None = None, service: int | None = None
) -> None:
    """Refuse a connected socket whose listener (SO_PEERCRED) runs as someone this user does
    not trust: called before the first byte is sent."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, peer_uid, _gid = struct.unpack("3i", creds)
    if peer_uid not in trusted_uids(uid, service):
        raise SocketDistrusted(
            f"refusing {path}: the scheduler answering there runs as uid {peer_uid} (not this "
            f"user, root or {ENV_SERVICE_USER})"
        )


def connect_trusted(path: str, timeout: float) -> socket.socket:
    """A connection to the socket at ``path`` that passed every check, peer included (blocking:
    off an event loop). Raises :class:`SocketDistrusted` or OSError."""
    service = service_uid()
    fd = open_socket_directory(path, service=service)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(via_directory(fd, path))
        check_peer(sock, path, service=service)
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(fd)
    return sock


def socket_distrust(path: str, uid: int | None = None) -> str | None:
    """Why the socket at ``path`` must not be used, or None (the checks of
    :func:`open_socket_directory`, without connecting). Missing files are not refused here
    (connecting says they are missing)."""
    try:
        os.close(open_socket_directory(path, uid, service_uid()))
    except SocketDistrusted as exc:
        return str(exc)
    except OSError:
        return None
    return None
