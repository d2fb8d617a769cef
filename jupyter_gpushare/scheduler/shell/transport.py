"""The scheduler's transport: the Unix socket, peer credentials, connections and their limits.

Nothing here decides anything about the GPU: it binds the socket safely (a directory of the right
owner and mode, a stale socket removed, a live one refused), says who a peer is as the kernel
reports it (``SO_PEERCRED``), reads frames off a connection and hands each decoded message on,
and writes frames without letting a peer that does not read grow the scheduler's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import secrets
import socket
import stat
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ... import paths
from ...protocol import (
    ErrorCode,
    FrameDecoder,
    Message,
    MsgType,
    ProtocolError,
    encode,
    error_message,
)
from .users import Identity

__all__ = [
    "MAX_WRITE_BUFFER",
    "Connection",
    "EventBudget",
    "LogLimiter",
    "PeerCred",
    "SchedulerConfigError",
    "SchedulerStartError",
    "SocketFile",
    "listen",
    "read_peer_credentials",
]

#: A peer that leaves this much unread data in its socket is not reading: it is dropped.
MAX_WRITE_BUFFER = 1 << 20
#: The longest path a Unix socket address holds (sun_path minus its terminating NUL).
MAX_SOCKET_PATH = 107
_PEERCRED = struct.Struct("3i")
#: Bytes read off a connection at once: what one read decodes (~450 small frames) without
#: giving the event loop back.
READ_SIZE = 16384
#: The scheduler's logger (a traitlets logger: a Logger or a LoggerAdapter).
Log = Any


class SchedulerStartError(RuntimeError):
    """The scheduler cannot listen (another one runs, a bad directory, a path too long, ...)."""


class SchedulerConfigError(SchedulerStartError):
    """The configuration cannot work (a socket path or directory, a group): the operator must
    change it (``gpushare scheduler`` exits with 2, as for an invalid value)."""


class LogLimiter:
    """Lines about peers, at most ``burst`` warnings and ``info_burst`` info lines per uid and
    ``period`` seconds.

    A peer that opens a thousand bad connections, or cycles REQUEST and RELEASE as fast as its
    frame budget lets it, must not grow the log by megabytes a second (nor push everyone else's
    lines out of it): past its budget its lines are counted, and the count is logged when its
    next period starts. Warnings and info lines have budgets of their own, so a flood of info
    lines never hides a warning. The first line past a budget says so at once (a reader must
    not take the silence for quiet), and every line past it is still written at DEBUG level:
    ``--debug`` keeps them all (32 notebook kernels of one uid spend the info budget in
    seconds, and a GPU run at DEBUG lost the grants it was run to see).
    """

    def __init__(
        self,
        log: Log,
        burst: int = 20,
        period: float = 60.0,
        info_burst: int = 300,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self._clock = clock  # tests pass their own
        self.burst = burst
        self.info_burst = info_burst
        self.period = period
        # level -> uid -> (period start, used, held)
        self._budgets: dict[str, dict[int, tuple[float, int, int]]] = {"warning": {}, "info": {}}

    def allow(self, uid: int, level: str = "warning") -> bool:
        budget = self._budgets[level]
        burst = self.burst if level == "warning" else self.info_burst
        now = self._clock()
        start, used, held = budget.get(uid, (now, 0, 0))
        if now - start >= self.period:
            if held:
                what = "warning(s)" if level == "warning" else "info line(s)"
                getattr(self.log, level)(
                    "uid %d: %d more %s about it were not logged", uid, held, what
                )
            start, used, held = now, 0, 0
        if used < burst:
            budget[uid] = (start, used + 1, held)
            return True
        if not held:
            what = "warnings" if level == "warning" else "info lines"
            getattr(self.log, level)(
                "uid %d: more than %d %s about it in %.0f s: the rest are counted, not logged, "
                "until %.0f s from now (--debug logs them as debug lines)",
                uid,
                burst,
                what,
                self.period,
                start + self.period - now,
            )
        budget[uid] = (start, used, held + 1)
        if len(budget) > 4096:  # bounded: forget the oldest periods
            for key in sorted(budget, key=lambda k: budget[k][0])[:1024]:
                del budget[key]
        return False

    def warning(self, uid: int, msg: str, *args: Any) -> None:
        if self.allow(uid):
            self.log.warning(msg, *args)
        else:
            self.log.debug(msg, *args)

    def info(self, uid: int, msg: str, *args: Any) -> None:
        if self.allow(uid, "info"):
            self.log.info(msg, *args)
        else:
            self.log.debug(msg, *args)

    def exception(self, uid: int, msg: str, *args: Any) -> None:
        if self.allow(uid):
            self.log.exception(msg, *args)
        else:
            self.log.debug(msg, *args)

    def log_for(self, uid: int) -> _LimitedLog:
        """A logger whose warnings and info lines about ``uid`` go through the limit (debug
        lines do not)."""
        return _LimitedLog(self, uid)


class _LimitedLog:
    def __init__(self, limiter: LogLimiter, uid: int) -> None:
        self._limiter, self._uid = limiter, uid

    def warning(self, msg: str, *args: Any) -> None:
        self._limiter.warning(self._uid, msg, *args)

    def info(self, msg: str, *args: Any) -> None:
        self._limiter.info(self._uid, msg, *args)

    def debug(self, msg: str, *args: Any) -> None:
        self._limiter.log.debug(msg, *args)


@dataclass(frozen=True)
class PeerCred:
    """The peer's identity as the kernel reports it (``SO_PEERCRED``)."""

    pid: int
    uid: int
    gid: int


UNKNOWN_PEER = PeerCred(0, -1, -1)


def read_peer_credentials(sock: socket.socket | None) -> PeerCred:
    """The peer's pid, uid and gid from ``SO_PEERCRED``; unknown (uid -1) when unavailable."""
    if sock is None:
        return UNKNOWN_PEER
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    except OSError:
        return UNKNOWN_PEER
    return PeerCred(*_PEERCRED.unpack(raw))


@dataclass
class Connection:
    """One accepted connection: a shim (once its HELLO is accepted) or a control peer."""

    serial: int
    peer: PeerCred
    writer: asyncio.StreamWriter | None
    kind: str = "new"  # "new" | "shim" | "control"
    #: The id the scheduler knows this shim by (after disambiguation); None before HELLO.
    client_id: str | None = None
    #: The id its HELLO asked for (its resume secret is bound to it).
    requested_id: str = ""
    #: Its HELLO's kernel secret proved the binding of the id it asked for (.kernel_ids).
    id_proven: bool = False
    device: str | None = None
    left: bool = False  # a Leave for this client went to the policy already
    closed: bool = False
    memory: dict[str, int] = field(
        default_factory=lambda: {"used": 0, "managed": 0, "pinned": 0, "evicted": 0}
    )
    requested_at: float | None = None
    granted_at: float | None = None
    grant: str = ""  # the random number of its current grant (its resume secret's, .resume)
    identity: Identity | None = None  # shims: from HELLO; control peers: from the last message
    requested_quota: int = 0  # what the kernel (or a set_quota) asked for; 0 = none
    requested_weight: float = 1.0
    quota: int = 0  # the effective quota the client was told
    quota_by_admin: bool = False  # an admin set it: the users config's ceiling does not apply
    revoking: bool = False  # a REVOKE is out: its RELEASED answer is a handoff (metrics)
    accounted_at: float | None = None  # GPU time of the current hold counted up to here
    revoked_at: float | None = None  # a REVOKE went out and no RELEASED came yet
    overdue: bool = False  # its revoke deadline passed: the policy counts it released
    #: Accepted on a device-plugin allocation's socket (features/allocations.py): its id and
    #: the ceiling no quota of this connection may pass; "" and 0 on the shared socket.
    allocation: str = ""
    ceiling: int = 0
    #: Bytes NVML last saw this client's process hold on its device (.nvml_check); 0: none seen.
    observed: int = 0
    observed_at: float = 0.0  # when that NVML reading was taken (monotonic)
    moved_at: float = 0.0  # its last eviction or restore (monotonic): older readings predate it
    context_bytes: int = 0  # its shim's estimate of its CUDA context (HELLO)
    #: Lines about this peer within its uid's budget (LogLimiter.log_for); None: the given log.
    peer_log: Any = None
    claim_logged: int = 0  # the level of its under-claim logged already (.nvml_check.under_claim)

    @property
    def name(self) -> str:
        who = self.client_id or self.kind
        return f"{who} (conn {self.serial}, pid {self.peer.pid}, uid {self.peer.uid})"

    def send(self, msg: Message, log: Log) -> bool:
        return self.write_frame(encode(msg), log)

    def write_frame(self, frame: bytes, log: Log) -> bool:
        """Queue ``frame``; a peer whose unread data passes MAX_WRITE_BUFFER is dropped."""
        writer = self.writer
        if writer is None or self.closed or writer.is_closing():
            return False
        try:
            writer.write(frame)
        except (ConnectionError, OSError, RuntimeError) as exc:
            log.debug("cannot write to %s: %s", self.name, exc)
            return False
        transport = writer.transport
        if transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
            (self.peer_log or log).warning("%s does not read its socket; dropping it", self.name)
            transport.abort()
            return False
        return True

    def error(
        self,
        code: ErrorCode,
        text: str,
        log: Log,
    ) -> None:
        log.debug("error %s to %s: %s", code.name.lower(), self.name, text)
        self.send(error_message(code, text), log)


class EventBudget:
    """How many frames of a peer the scheduler reads per second: a token bucket per key (a uid, or
    a user a token proved on a uid many users share).

    A peer past its budget is not refused: its connections simply stop being read for a while,
    so its socket buffers fill and its writes block (backpressure), while everyone else's
    messages, status requests and HELLOs are served in between.
    """

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._buckets: dict[Any, tuple[float, float]] = {}  # key -> (tokens, at)

    def debt(self, key: Any, spent: int, now: float) -> float:
        """Take ``spent`` frames from ``key``'s bucket; the seconds it must now pause."""
        if self.rate <= 0:
            return 0.0
        tokens, at = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate) - spent
        self._buckets[key] = (tokens, now)
        if len(self._buckets) > 4096:  # bounded: forget the full buckets (they owe nothing)
            for k in [k for k, (t, _) in self._buckets.items() if t >= self.burst][:2048]:
                del self._buckets[k]
        return 0.0 if tokens >= 0 else -tokens / self.rate


def merge_memory(first: Message, then: Message) -> Message:
    """Two MEMORY frames of one peer in a row as one: each field as the later one says it
    (absent fields keep their value, as :func:`.translate.memory_after` reads them)."""
    return Message(MsgType.MEMORY, {**first.fields, **then.fields})


async def serve_frames(
    conn: Connection,
    reader: asyncio.StreamReader,
    on_message: Callable[[Connection, Message], Awaitable[None]],
    log: Log,
    pace: Callable[[Connection, int], Awaitable[None]] | None = None,
) -> None:
    """Read frames off ``conn`` and hand each message to ``on_message`` until the peer closes,
    sends something undecodable (answered with an ERROR), or ``conn`` is closed.

    Consecutive MEMORY frames in what one read brought are merged (only the latest claim
    matters), and after each read ``pace(conn, frames)`` may pause the connection: a peer
    that writes frames as fast as it can costs the scheduler a bounded share of its time."""
    writer = conn.writer
    assert writer is not None
    decoder = FrameDecoder()
    try:
        while not conn.closed:
            data = await reader.read(READ_SIZE)
            if not data:
                decoder.eof()
                break
            frames = 0
            memory: Message | None = None
            try:
                for msg in decoder.feed(data):
                    frames += 1
                    if msg.type == MsgType.MEMORY:
                        memory = msg if memory is None else merge_memory(memory, msg)
                        continue
                    if memory is not None:
                        await on_message(conn, memory)
                        memory = None
                        if conn.closed:
                            break
                    await on_message(conn, msg)
                    if conn.closed:
                        break
            except ProtocolError:
                if memory is not None and not conn.closed:  # what came before the bad frame
                    await on_message(conn, memory)
                raise
            if memory is not None and not conn.closed:
                await on_message(conn, memory)
            if not conn.closed and not writer.is_closing():
                await writer.drain()
            if pace is not None and frames:
                await pace(conn, frames)
    except ProtocolError as exc:
        log.warning("protocol error from %s: %s; closing it", conn.name, exc.message)
        conn.send(error_message(exc.code, exc.message), log)
    except (ConnectionError, OSError) as exc:
        log.debug("connection %s: %s", conn.name, exc)


def group_id(group: str) -> int:
    """A group name or number as a gid (SchedulerConfigError for an unknown name)."""
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise SchedulerConfigError(f"socket_group {group!r}: no such group") from None


@dataclass
class SocketFile:
    """Where the socket goes and with which permissions; the blocking steps of binding it.

    Every method blocks (file system calls, a probe connection): run them in an executor.
    """

    path: str
    mode: int = 0o666
    dir_mode: int | None = None
    group: str = ""
    #: (st_dev, st_ino) of the socket this scheduler published: it removes only its own.
    published: tuple[int, int] | None = None
    #: The socket's directory, opened and checked (:meth:`prepare_directory`).
    _dir_fd: int | None = field(default=None, repr=False, compare=False)

    @property
    def directory(self) -> str:
        return os.path.dirname(self.path) or "."

    @property
    def resume_marker(self) -> str:
        """Left by a scheduler that stopped with shims connected: they will come back."""
        return f"{self.path}.clients"

    def check_length(self) -> None:
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH:
            raise SchedulerConfigError(
                f"socket path is too long for a Unix socket (max {MAX_SOCKET_PATH} bytes): "
                f"{self.path}"
            )

    def prepare_directory(self, log: Log) -> bool:
        """Create the socket's directory; remove a stale socket; refuse a live or foreign one.

        The directory is opened without following a link and checked on that fd
        (:func:`paths.open_own_directory`); every later step (the stale socket, the bind, the
        rename) goes through the fd, so a link flipped since the check cannot put the socket in
        another user's directory (issue 22, item 1). Returns whether the last scheduler here left
        clients behind (a stale socket: it crashed; or its resume marker: it stopped with clients
        connected).
        """
        directory = self.directory
        uid = os.getuid()
        if not os.path.lexists(directory):
            mode = self.dir_mode
            if mode is None:
                per_user = os.path.basename(directory) == f"gpushare-{uid}" and uid != 0
                mode = 0o700 if per_user else 0o755
            os.makedirs(directory, mode=mode, exist_ok=True)
            os.chmod(directory, mode, follow_symlinks=False)  # makedirs' mode: under the umask
            if self.group:
                os.chown(directory, -1, group_id(self.group), follow_symlinks=False)
        self.close_directory()
        try:
            fd = paths.open_own_directory(directory, uid)
        except paths.SocketDistrusted as exc:
            # Another user made it (first, in /tmp), or a link: they could swap the socket.
            raise SchedulerConfigError(
                f"refusing to put the socket in {directory}: "
                f"{str(exc).removeprefix('refusing the socket: ')} "
                "(set GPUSHARE_SOCKET or socket_path to a directory you own)"
            ) from None
        self._dir_fd = fd
        name = self.name
        stale = False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.basename(self.resume_marker), dir_fd=fd)
            stale = True
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return stale
        if not stat.S_ISSOCK(st.st_mode):
            raise SchedulerConfigError(
                f"{self.path} exists and is not a socket; refusing to replace it"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(2.0)
        try:
            probe.connect(paths.via_directory(fd, self.path))
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing the stale socket %s", self.path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
            return True
        except OSError as exc:
            raise SchedulerStartError(
                f"cannot check the existing socket {self.path}: {exc}"
            ) from exc
        finally:
            probe.close()
        raise SchedulerStartError(f"another gpushare scheduler is already listening on {self.path}")

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def _fd(self) -> int:
        if self._dir_fd is None:
            raise SchedulerStartError(f"{self.directory}: not prepared (prepare_directory)")
        return self._dir_fd

    def bind(self) -> tuple[socket.socket, str]:
        """Bind and listen under a temporary name in the socket's directory (through its fd).

        :meth:`publish` renames it into place once the server accepts, so the path appears only
        when connecting to it works (shims and tests poll for the file). Returns the socket and
        the temporary name (in the directory). The name is unique to this socket, and so is the
        address that ``getsockname`` gives its connections.
        """
        fd = self._fd()
        tmp = f".gpushare-{os.getpid()}-{secrets.token_hex(4)}.sock"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=fd)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(paths.via_directory(fd, os.path.join(self.directory, tmp)))
            os.chmod(tmp, self.mode, dir_fd=fd)
            if self.group:
                os.chown(tmp, -1, group_id(self.group), dir_fd=fd, follow_symlinks=False)
            sock.listen(128)
        except BaseException:
            sock.close()
            self.discard(tmp)
            raise
        return sock, tmp

    def discard(self, tmp: str) -> None:
        """Remove the temporary name of a socket that was not published."""
        if self._dir_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._dir_fd)

    def publish(self, tmp: str) -> None:
        fd = self._fd()
        os.rename(tmp, self.name, src_dir_fd=fd, dst_dir_fd=fd)
        st = os.stat(self.name, dir_fd=fd, follow_symlinks=False)
        self.published = (st.st_dev, st.st_ino)

    def write_resume_marker(self) -> None:
        if self._dir_fd is None:
            return
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        with contextlib.suppress(OSError):
            fd = os.open(os.path.basename(self.resume_marker), flags, 0o644, dir_fd=self._dir_fd)
            with open(fd, "w") as f:
                f.write(f"{os.getpid()}\n")

    def remove(self) -> None:
        """Remove the socket file if it is still the one this scheduler published; let go of
        the directory."""
        fd = self._dir_fd
        if fd is None:
            return
        try:
            st = os.stat(self.name, dir_fd=fd, follow_symlinks=False)
            if self.published == (st.st_dev, st.st_ino):
                os.unlink(self.name, dir_fd=fd)
        except FileNotFoundError:
            pass
        finally:
            self.close_directory()

    def close_directory(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None


async def listen(
    sock_file: SocketFile,
    on_connection: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    log: Log,
) -> tuple[asyncio.AbstractServer, bool]:
    """Serve ``on_connection`` on the socket; the server and whether the last scheduler there
    left clients behind (see :meth:`SocketFile.prepare_directory`)."""
    loop = asyncio.get_running_loop()
    sock_file.check_length()
    path = sock_file.path
    try:
        left_clients = await loop.run_in_executor(None, sock_file.prepare_directory, log)
        sock, tmp = await loop.run_in_executor(None, sock_file.bind)
    except SchedulerStartError:
        sock_file.close_directory()
        raise
    except (PermissionError, FileExistsError, NotADirectoryError, FileNotFoundError) as exc:
        # A directory that cannot be made or written (or a file in its way): one clear line.
        sock_file.close_directory()
        raise SchedulerConfigError(
            f"cannot put the socket at {path}: {exc.strerror} ({exc.filename or path}); "
            "set GPUSHARE_SOCKET or socket_path to a directory this user may write"
        ) from None
    server: asyncio.AbstractServer | None = None
    try:
        server = await asyncio.start_unix_server(on_connection, sock=sock)
        await loop.run_in_executor(None, sock_file.publish, tmp)
    except BaseException:
        if server is not None:
            server.close()
        sock.close()
        sock_file.discard(tmp)
        sock_file.close_directory()
        raise
    return server, left_clients
