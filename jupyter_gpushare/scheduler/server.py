"""The scheduler's asyncio shell: sockets, peer credentials, timers and NVML around the policy.

The policy (:mod:`.policy`) decides; this module only translates. Each accepted connection is
identified by ``SO_PEERCRED``; its first message decides what it is (``HELLO``: a shim client;
``STATUS_REQUEST``/``CONTROL``: a control peer). Shim messages become policy events stamped with
``time.monotonic()``, the policy's decisions become ``GRANT``/``REVOKE``/``EVICT``/``SET_QUOTA``
frames, and one timer fires :class:`~.events.Tick` at ``policy.next_deadline()``. A connection
that closes, for any reason, is a :class:`~.events.Leave` at once.

Configuration is through traitlets, e.g. in ``jupyter_server_config.py`` or ``gpushare_config.py``::

    c.GPUShareScheduler.pool_size = "24GiB"
    c.GPUShareScheduler.base_quantum = 5.0
    c.GPUShareScheduler.admin_uids = [1001]

Socket permissions
------------------
Who may *connect* is decided by the socket's directory and mode; who may *act on a client* is
decided per message from the kernel-verified uid (``SO_PEERCRED``), never from what a peer says.

* Per-user (embedded in a user's Jupyter server, the default for non-root): the socket lives in
  ``${XDG_RUNTIME_DIR:-/tmp}/gpushare-$UID/``, which the scheduler creates with mode ``0700`` and
  refuses to use when another (non-root) user owns it. Only that user can reach the socket, so
  the socket itself can keep the permissive default mode.
* Node-wide (root or a service account, ``/run/gpushare/``): every user's kernels must reach the
  socket, so the directory is created ``0755`` and the socket is ``0666`` (connecting to a Unix
  socket needs write permission; execute bits mean nothing there). To limit the GPU to a group,
  set ``socket_group`` and ``socket_mode = 0o660``. A user who can connect can queue for the GPU
  and see the status, but can only release, evict or re-quota their own kernels.

Duplicate client ids
--------------------
Two live connections may announce the same ``client_id``: a kernel's subprocess inherits
``GPUSHARE_CLIENT_ID`` with ``LD_PRELOAD``. Refusing the second one would leave that process
running unshared, so the scheduler *disambiguates*: the second client becomes ``<id>#<pid>`` (and
``<id>#<pid>.<n>`` in the unlikely case that is taken too); control actions naming ``<id>`` keep
reaching the first, the kernel itself. The one exception is a reconnection: a HELLO from the same
process (same verified pid and uid) as the existing connection replaces it (the old connection
leaves first), because that is the shim reconnecting before the scheduler saw the old socket close.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import pwd
import socket
import stat
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from traitlets import Bool, Float, Int, List, TraitError, Unicode, Union, default, validate
from traitlets.config import LoggingConfigurable

from .._version import __version__
from ..paths import default_socket_path
from ..protocol import (
    CONTROL_MESSAGES,
    SHIM_MESSAGES,
    ErrorCode,
    FrameDecoder,
    Message,
    MsgType,
    ProtocolError,
    encode,
    error_message,
)
from ..units import format_size, parse_size
from . import events as ev
from .devices import Discovery, UtilizationSampler, discover_devices_async
from .policy import Policy, PolicyConfig

__all__ = [
    "Connection",
    "GPUShareScheduler",
    "PeerCred",
    "SchedulerConfigError",
    "SchedulerStartError",
]

#: A peer that leaves this much unread data in its socket is not reading: it is dropped.
MAX_WRITE_BUFFER = 1 << 20
_PEERCRED = struct.Struct("3i")
#: The longest device UUID and name a HELLO may carry ("GPU-" or "MIG-" UUIDs have 40 characters).
MAX_DEVICE_UUID = 64
MAX_DEVICE_NAME = 256


class SchedulerStartError(RuntimeError):
    """The scheduler cannot listen (another one runs, a bad directory, a path too long, ...)."""


class SchedulerConfigError(SchedulerStartError):
    """The configuration cannot work (a socket path or directory, a group): the operator must
    change it (``gpushare scheduler`` exits with 2, as for an invalid value)."""


@dataclass(frozen=True)
class PeerCred:
    """The peer's identity as the kernel reports it (``SO_PEERCRED``)."""

    pid: int
    uid: int
    gid: int


@dataclass
class Connection:
    """One accepted connection: a shim client or a control peer."""

    serial: int
    peer: PeerCred
    writer: asyncio.StreamWriter | None
    kind: str = "new"  # "new" | "shim" | "control"
    client: str | None = None
    device: str | None = None
    left: bool = False  # a Leave for this client went to the policy already
    closed: bool = False
    memory: dict[str, int] = field(
        default_factory=lambda: {"used": 0, "managed": 0, "pinned": 0, "evicted": 0}
    )
    requested_at: float | None = None
    granted_at: float | None = None
    revoked_at: float | None = None  # a REVOKE went out and no RELEASED came yet

    @property
    def name(self) -> str:
        who = self.client or self.kind
        return f"{who} (conn {self.serial}, pid {self.peer.pid}, uid {self.peer.uid})"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _bytes(n: int) -> str:
    return f"bytes={n} ({format_size(n)})"


class GPUShareScheduler(LoggingConfigurable):
    """The node's GPU scheduler: one policy, one Unix socket, many shim clients."""

    socket_path = Unicode(
        help="""Path of the scheduler's Unix socket. Default: $GPUSHARE_SOCKET, else
        /run/gpushare/scheduler.sock for root and ${XDG_RUNTIME_DIR:-/tmp}/gpushare-$UID/
        scheduler.sock for everyone else (the shim computes the same default).""",
    ).tag(config=True)

    @default("socket_path")
    def _default_socket_path(self) -> str:
        return default_socket_path()

    socket_mode = Int(
        0o666,
        help="""Permission bits of the socket file. Connecting needs write permission; who may
        reach the socket at all is decided by its directory (0700 per user, 0755 node-wide). Use
        0o660 with socket_group to limit a node-wide scheduler to one group.""",
    ).tag(config=True)

    socket_dir_mode = Int(
        None,
        allow_none=True,
        help="""Mode of the socket's directory when the scheduler creates it. Default: 0700 for a
        per-user directory (gpushare-$UID) and 0755 otherwise (a node-wide socket that every
        user's kernels must reach). An existing directory is never chmod-ed.""",
    ).tag(config=True)

    socket_group = Unicode(
        "",
        help="Group name (or gid) that owns the socket; '' leaves the scheduler's own group.",
    ).tag(config=True)

    pool_size = Union(
        [Int(), Unicode()],
        default_value="",
        help="""Memory pool per device that the scheduler hands out: bytes or a size such as
        '24GiB' (1024-based units). '' or 0: the device's total memory minus pool_reserve. A
        pool larger than a device is clamped to the device.""",
    ).tag(config=True)

    pool_reserve = Union(
        [Int(), Unicode()],
        default_value="1GiB",
        help="""Memory kept out of the automatic pool (pool_size = ''): what the driver keeps for
        itself and what processes outside the scheduler use (the X server, monitoring agents).
        Contexts of shimmed processes are already counted per client (context_bytes).""",
    ).tag(config=True)

    base_quantum = Float(5.0, help="Time quantum (seconds) of exclusive turns.").tag(config=True)
    move_factor = Float(
        4.0,
        help="""A turn lasts at least move_factor times the time its memory takes to move, so a
        handoff costs at most 1/move_factor of the GPU's time.""",
    ).tag(config=True)
    max_quantum = Float(60.0, help="Upper bound of a turn (seconds).").tag(config=True)
    evict_bandwidth = Float(
        10e9, help="Estimated GPU-to-host bandwidth of an eviction (bytes/second)."
    ).tag(config=True)
    restore_bandwidth = Float(
        50e9, help="Estimated host-to-GPU bandwidth of a restore (bytes/second)."
    ).tag(config=True)
    usage_half_life = Float(
        600.0, help="Half-life (seconds) of the GPU usage that fair share remembers per user."
    ).tag(config=True)

    admin_uids = List(
        Int(),
        help="""Uids that may act on any client (release, evict, set_quota, kernel_state), in
        addition to root and the scheduler's own uid. Everyone else may act on their own
        clients only (the uid comes from SO_PEERCRED).""",
    ).tag(config=True)

    use_nvml = Bool(
        True,
        help="""Discover devices with NVML at start. When off, or when NVML is missing, devices
        are learnt from the shims' HELLO messages.""",
    ).tag(config=True)

    utilization_interval = Float(
        1.0,
        help="""Seconds between two readings of each GPU's utilisation through NVML (shown in the
        status for people to read; scheduling never depends on it). 0 turns the readings off.""",
    ).tag(config=True)

    recovery_seconds = Float(
        3.0,
        help="""When the last scheduler on this socket left clients behind (it crashed: its
        socket is still there; or it stopped with clients connected: it left <socket>.clients),
        how long to hold back grants so that those clients can reconnect and say what they held
        (shims retry within 2.5 s). Only in this window are such claims believed. 0 turns the
        window off. See docs/reliability.md.""",
    ).tag(config=True)

    revoke_warning_seconds = Float(
        60.0,
        help="""Log a warning when a holder has not answered a revoke for this long (its GPU work
        still runs while others wait; docs/reliability.md). 0 turns the warning off.""",
    ).tag(config=True)

    @validate("base_quantum", "move_factor", "max_quantum", "evict_bandwidth", "restore_bandwidth")
    def _validate_positive(self, proposal: Any) -> Any:
        value = proposal["value"]
        if not value > 0 or value == float("inf"):
            raise TraitError(f"{proposal['trait'].name} must be a positive number, not {value!r}")
        return value

    @validate(
        "usage_half_life", "utilization_interval", "recovery_seconds", "revoke_warning_seconds"
    )
    def _validate_non_negative(self, proposal: Any) -> Any:
        value = proposal["value"]
        if not value >= 0 or value == float("inf"):
            raise TraitError(f"{proposal['trait'].name} must be 0 or more, not {value!r}")
        return value

    @validate("admin_uids")
    def _validate_uids(self, proposal: Any) -> Any:
        bad = [uid for uid in proposal["value"] if uid < 0]
        if bad:
            raise TraitError(f"admin_uids: {bad[0]} is not a uid")
        return proposal["value"]

    @validate("socket_mode", "socket_dir_mode")
    def _validate_mode(self, proposal: Any) -> Any:
        value = proposal["value"]
        if value is not None and not 0 <= value <= 0o777:
            raise TraitError(f"{proposal['trait'].name} must be permission bits (0 to 0o777)")
        return value

    @validate("pool_size", "pool_reserve")
    def _validate_size(self, proposal: Any) -> Any:
        value = proposal["value"]
        if value != "":
            try:
                parse_size(value)
            except ValueError as exc:
                raise ValueError(f"{proposal['trait'].name}: {exc}") from None
        return value

    # ----------------------------------------------------------------------------------------

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.own_uid = os.getuid()
        self.policy: Policy | None = None
        self.discovery = Discovery([], "not started")
        self._server: asyncio.AbstractServer | None = None
        self._socket_ino: tuple[int, int] | None = None
        self._connections: dict[int, Connection] = {}
        self._clients: dict[str, Connection] = {}
        self._devices: dict[str, str] = {}  # lower-case uuid -> uuid as registered
        self._serial = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_deadline: float | None = None
        self._stopping = False
        self._stop_requested: asyncio.Event | None = None
        self._user_names: dict[int, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._utilization: dict[str, int] = {}  # device uuid -> percent, from the sampler task
        self._sampler: asyncio.Future[None] | None = None
        # Set by _prepare_socket_dir: the last scheduler on this socket crashed (its socket is
        # left), or stopped with clients connected (its marker is left): they may come back.
        self._found_stale_socket = False

    # ----------------------------------------------------------------------------------------
    # Lifecycle

    @property
    def started(self) -> bool:
        return self._server is not None

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig(
            base_quantum=self.base_quantum,
            move_factor=self.move_factor,
            # A base quantum above the bound raises the bound (said once at start, in start()).
            max_quantum=max(self.max_quantum, self.base_quantum),
            evict_bandwidth=self.evict_bandwidth,
            restore_bandwidth=self.restore_bandwidth,
            usage_half_life=self.usage_half_life,
        )

    def pool_for(self, total_bytes: int) -> int:
        """The pool of a device of ``total_bytes`` under the configured pool_size/pool_reserve."""
        size = parse_size(self.pool_size) if self.pool_size != "" else 0
        if size:
            if total_bytes and size > total_bytes:
                self.log.warning(
                    "pool_size %s is larger than the device (%s): using the whole device",
                    format_size(size),
                    format_size(total_bytes),
                )
                return total_bytes
            return size
        reserve = parse_size(self.pool_reserve) if self.pool_reserve != "" else 0
        return max(total_bytes - reserve, 0)

    async def start(self) -> None:
        """Discover devices, bind the socket and start serving."""
        if self._server is not None:
            return
        self._stopping = False
        self._stop_requested = asyncio.Event()
        self.policy = Policy(self.policy_config())
        if self.max_quantum < self.base_quantum:
            self.log.warning(
                "gpushare: max_quantum %.1f s is below base_quantum %.1f s: using %.1f s for both",
                self.max_quantum,
                self.base_quantum,
                self.base_quantum,
            )
        if self.use_nvml:
            self.discovery = await discover_devices_async()
        else:
            self.discovery = Discovery([], "disabled (use_nvml = False)")
        if self.discovery.error is not None:
            self.log.warning(
                "gpushare: no NVML device discovery: %s; devices will be learnt from the shims",
                self.discovery.error,
            )
        elif not self.discovery.devices:
            self.log.warning("gpushare: NVML found no GPU; devices will be learnt from the shims")
        for dev in self.discovery.devices:
            self._register_device(dev.uuid, dev.name, dev.total_bytes)
        self._found_stale_socket = False
        await self._listen()
        if self._found_stale_socket and self.recovery_seconds > 0:
            self.policy.recover_until(time.monotonic() + self.recovery_seconds)
            self.log.info(
                "gpushare: the last scheduler on %s had clients; holding grants back for %.1f s "
                "while they reconnect",
                self.socket_path,
                self.recovery_seconds,
            )
            self._reschedule()
        if self.discovery.devices and self.utilization_interval > 0:
            self._sampler = asyncio.ensure_future(self._sample_utilization())

    async def _sample_utilization(self) -> None:
        """Keep ``self._utilization`` fresh, reading NVML in an executor, until the scheduler
        stops."""
        loop = asyncio.get_running_loop()
        sampler = UtilizationSampler()
        error = await loop.run_in_executor(None, sampler.open)
        if error is not None:
            self.log.warning("gpushare: no GPU utilisation readings: %s", error)
            return
        uuids = [dev.uuid for dev in self.discovery.devices]
        try:
            while not self._stopping:
                self._utilization = await loop.run_in_executor(None, sampler.sample, uuids)
                await asyncio.sleep(self.utilization_interval)
        finally:
            await loop.run_in_executor(None, sampler.close)

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        path = self.socket_path
        if len(os.fsencode(path)) > 107:
            raise SchedulerConfigError(
                f"socket path is too long for a Unix socket (max 107 bytes): {path}"
            )
        try:
            await loop.run_in_executor(None, self._prepare_socket_dir, path)
            sock, tmp = await loop.run_in_executor(None, self._bind, path)
        except SchedulerStartError:
            raise
        except (PermissionError, FileExistsError, NotADirectoryError, FileNotFoundError) as exc:
            # A directory that cannot be made or written (or a file in its way): one clear line.
            raise SchedulerConfigError(
                f"cannot put the socket at {path}: {exc.strerror} ({exc.filename or path}); "
                "set GPUSHARE_SOCKET or socket_path to a directory this user may write"
            ) from None
        try:
            self._server = await asyncio.start_unix_server(self._on_connection, sock=sock)
            self._socket_ino = await loop.run_in_executor(None, self._publish, tmp, path)
        except BaseException:
            if self._server is not None:
                self._server.close()
                self._server = None
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.log.info(
            "gpushare scheduler %s listening on %s (%d device(s), policy: quantum %.1fs)",
            __version__,
            path,
            len(self._devices),
            self.base_quantum,
        )

    def _bind(self, path: str) -> tuple[socket.socket, str]:
        """Bind and listen under a temporary name in the socket's directory (blocking).

        :meth:`_publish` renames it into place once the server accepts, so the path appears only
        when connecting to it works (shims and tests poll for the file).
        """
        tmp = os.path.join(os.path.dirname(path) or ".", f".gpushare-{os.getpid()}.sock")
        if len(os.fsencode(tmp)) > 107:
            tmp = path
        elif os.path.lexists(tmp):
            os.unlink(tmp)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(tmp)
            os.chmod(tmp, self.socket_mode)
            if self.socket_group:
                os.chown(tmp, -1, self._gid(self.socket_group))
            sock.listen(128)
        except BaseException:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return sock, tmp

    @staticmethod
    def _publish(tmp: str, path: str) -> tuple[int, int]:
        if tmp != path:
            os.rename(tmp, path)
        st = os.stat(path)
        return (st.st_dev, st.st_ino)

    @staticmethod
    def _gid(group: str) -> int:
        if group.isdigit():
            return int(group)
        try:
            return grp.getgrnam(group).gr_gid
        except KeyError:
            raise SchedulerConfigError(f"socket_group {group!r}: no such group") from None

    def _prepare_socket_dir(self, path: str) -> None:
        """Create the socket's directory; remove a stale socket; refuse a live or foreign one."""
        directory = os.path.dirname(path) or "."
        uid = os.getuid()
        if not os.path.isdir(directory):
            mode = self.socket_dir_mode
            if mode is None:
                per_user = os.path.basename(directory) == f"gpushare-{uid}" and uid != 0
                mode = 0o700 if per_user else 0o755
            os.makedirs(directory, mode=mode, exist_ok=True)
            os.chmod(directory, mode)  # makedirs' mode is filtered by the umask
            if self.socket_group:
                os.chown(directory, -1, self._gid(self.socket_group))
        st = os.stat(directory)
        if uid != 0 and st.st_uid not in (uid, 0):
            raise SchedulerConfigError(
                f"refusing to put the socket in {directory}: it belongs to uid {st.st_uid}, "
                "not to this user (set GPUSHARE_SOCKET or socket_path to a directory you own)"
            )
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._resume_marker)
            self._found_stale_socket = True
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise SchedulerConfigError(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(2.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            self.log.info("removing the stale socket %s", path)
            self._found_stale_socket = True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        except OSError as exc:
            raise SchedulerStartError(f"cannot check the existing socket {path}: {exc}") from exc
        finally:
            probe.close()
        raise SchedulerStartError(f"another gpushare scheduler is already listening on {path}")

    async def stop(self) -> None:
        """Stop accepting, drop every connection, remove the socket file."""
        if self._server is None:
            return
        self._stopping = True
        server, self._server = self._server, None
        server.close()
        self._cancel_timer()
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
            self._sampler = None
        shims = any(c.kind == "shim" and not c.left for c in self._connections.values())
        if shims and self.recovery_seconds > 0:
            # The shims keep running and will reconnect to the next scheduler on this socket:
            # tell it to take them back (a restart by the service manager, not only a crash).
            await asyncio.get_running_loop().run_in_executor(None, self._write_resume_marker)
        for conn in list(self._connections.values()):
            if conn.writer is not None:
                conn.writer.close()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2.0)
        await asyncio.get_running_loop().run_in_executor(None, self._remove_socket)
        self._connections.clear()
        self._clients.clear()
        if self._stop_requested is not None:
            self._stop_requested.set()
        self.log.info("gpushare scheduler stopped")

    @property
    def _resume_marker(self) -> str:
        return f"{self.socket_path}.clients"

    def _write_resume_marker(self) -> None:
        with contextlib.suppress(OSError), open(self._resume_marker, "w") as f:
            f.write(f"{os.getpid()}\n")

    def _remove_socket(self) -> None:
        path = self.socket_path
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return
        if self._socket_ino == (st.st_dev, st.st_ino):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def request_stop(self) -> None:
        """Ask :meth:`run_forever` to stop (safe from a signal handler on the loop)."""
        if self._stop_requested is not None:
            self._stop_requested.set()

    async def run_forever(self) -> None:
        """Start (if needed) and serve until :meth:`request_stop`; then stop cleanly."""
        if self._server is None:
            await self.start()
        assert self._stop_requested is not None
        try:
            await self._stop_requested.wait()
        finally:
            await self.stop()

    # ----------------------------------------------------------------------------------------
    # Devices

    def _register_device(self, uuid: str, name: str, total: int) -> str:
        key = uuid.lower()
        known = self._devices.get(key)
        if known is not None:
            return known
        assert self.policy is not None
        pool = self.pool_for(total)
        self.policy.add_device(uuid, name=name, total_bytes=total, pool_bytes=pool)
        self._devices[key] = uuid
        self.log.info(
            "device %s (%s): total %s, pool %s", uuid, name or "?", format_size(total),
            format_size(pool),
        )  # fmt: skip
        return uuid

    def _device_for_hello(self, msg: Message) -> str:
        uuid = str(msg.get("device_uuid") or "")
        known = self._devices.get(uuid.lower())
        if known is not None:
            return known
        if not uuid:
            if len(self._devices) == 1:
                return next(iter(self._devices.values()))
            uuid = "GPU-unknown"
        total = int(msg.get("device_total") or 0)
        if not total:
            self.log.warning("device %s: HELLO did not say its memory size", uuid)
        return self._register_device(uuid, str(msg.get("device_name") or ""), total)

    # ----------------------------------------------------------------------------------------
    # Identity and authorisation

    def peer_credentials(self, sock: socket.socket | None) -> PeerCred:
        """The peer's pid, uid and gid from ``SO_PEERCRED`` (tests override this)."""
        if sock is None:
            return PeerCred(0, -1, -1)
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        except OSError:
            return PeerCred(0, -1, -1)
        pid, uid, gid = _PEERCRED.unpack(raw)
        return PeerCred(pid, uid, gid)

    def is_admin(self, uid: int) -> bool:
        return uid == 0 or uid == self.own_uid or uid in self.admin_uids

    def authorize(self, peer_uid: int, client_uid: int) -> bool:
        """May a peer of ``peer_uid`` act on a client of ``client_uid``?"""
        if peer_uid < 0:
            return False
        return peer_uid == client_uid or self.is_admin(peer_uid)

    async def _user_name(self, uid: int) -> str:
        name = self._user_names.get(uid)
        if name is None:
            loop = asyncio.get_running_loop()
            name = await loop.run_in_executor(None, _lookup_user, uid)
            self._user_names[uid] = name
        return name

    def _assign_client_id(self, requested: str, conn: Connection) -> str:
        existing = self._clients.get(requested)
        if existing is None:
            return requested
        if existing.peer.pid > 0 and existing.peer == conn.peer:
            self.log.info("client %s reconnected: the old connection leaves", requested)
            self._client_gone(existing, "replaced by a reconnection")
            if existing.writer is not None:
                existing.writer.close()
            return requested
        base = f"{requested}#{conn.peer.pid}"
        candidate, n = base, 1
        while candidate in self._clients:
            n += 1
            candidate = f"{base}.{n}"
        self.log.info(
            "client id %s is taken by %s: the new client (pid %d) is %s",
            requested,
            existing.name,
            conn.peer.pid,
            candidate,
        )
        return candidate

    # ----------------------------------------------------------------------------------------
    # Connections

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._serial += 1
        peer = self.peer_credentials(writer.get_extra_info("socket"))
        conn = Connection(self._serial, peer, writer)
        self._connections[conn.serial] = conn
        self.log.debug("connection %d from pid %d uid %d", conn.serial, peer.pid, peer.uid)
        decoder = FrameDecoder()
        try:
            while not conn.closed:
                data = await reader.read(65536)
                if not data:
                    decoder.eof()
                    break
                for msg in decoder.feed(data):
                    await self._dispatch(conn, msg)
                    if conn.closed:
                        break
                if not conn.closed and not writer.is_closing():
                    await writer.drain()
        except ProtocolError as exc:
            self.log.warning("protocol error from %s: %s; closing it", conn.name, exc.message)
            self._send(conn, error_message(exc.code, exc.message))
        except (ConnectionError, OSError) as exc:
            self.log.debug("connection %s: %s", conn.name, exc)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.log.exception("internal error on %s; closing it", conn.name)
        finally:
            self._client_gone(conn, "connection closed")
            conn.closed = True
            self._connections.pop(conn.serial, None)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    def _client_gone(self, conn: Connection, why: str) -> None:
        """The client's connection is done: Leave at once (its grant and memory go)."""
        if conn.kind != "shim" or conn.left or conn.client is None:
            return
        conn.left = True
        if self._clients.get(conn.client) is conn:
            del self._clients[conn.client]
        if self._stopping:
            return
        held = None if conn.granted_at is None else time.monotonic() - conn.granted_at
        self.log.info(
            "leave client=%s (%s) %s held_ms=%s", conn.client, why,
            _bytes(conn.memory["used"]), _ms(held),
        )  # fmt: skip
        self._handle(ev.Leave(time.monotonic(), conn.client))

    def _send(self, conn: Connection, msg: Message) -> bool:
        return self._write_frame(conn, encode(msg))

    def _write_frame(self, conn: Connection, frame: bytes) -> bool:
        writer = conn.writer
        if writer is None or conn.closed or writer.is_closing():
            return False
        try:
            writer.write(frame)
        except (ConnectionError, OSError, RuntimeError) as exc:
            self.log.debug("cannot write to %s: %s", conn.name, exc)
            return False
        transport = writer.transport
        if transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
            self.log.warning("%s does not read its socket; dropping it", conn.name)
            transport.abort()
            return False
        return True

    def _error(self, conn: Connection, code: ErrorCode, text: str) -> None:
        self.log.debug("error %s to %s: %s", code.name.lower(), conn.name, text)
        self._send(conn, error_message(code, text))

    async def _dispatch(self, conn: Connection, msg: Message) -> None:
        mtype = msg.type
        if mtype in CONTROL_MESSAGES:
            if conn.kind == "new":
                conn.kind = "control"
            if mtype == MsgType.STATUS_REQUEST:
                self._on_status_request(conn, msg)
            else:
                self._on_control(conn, msg)
            return
        if mtype == MsgType.HELLO:
            if conn.kind != "new":
                self._error(
                    conn,
                    ErrorCode.UNEXPECTED,
                    f"HELLO on a {conn.kind} connection (one per client)",
                )
                return
            await self._on_hello(conn, msg)
            return
        if mtype not in SHIM_MESSAGES:
            self._error(conn, ErrorCode.UNEXPECTED, f"message type {msg.type_name} is not accepted")
            return
        if conn.kind != "shim" or conn.client is None:
            self._error(conn, ErrorCode.UNEXPECTED, f"{msg.type_name} before HELLO")
            return
        if conn.left:
            self._error(conn, ErrorCode.UNEXPECTED, f"{msg.type_name} after GOODBYE")
            return
        self._on_shim_message(conn, msg)

    # ----------------------------------------------------------------------------------------
    # Shim messages

    async def _on_hello(self, conn: Connection, msg: Message) -> None:
        assert self.policy is not None
        uuid, name = str(msg.get("device_uuid") or ""), str(msg.get("device_name") or "")
        if len(uuid) > MAX_DEVICE_UUID or len(name) > MAX_DEVICE_NAME:
            # Devices learnt from HELLOs are never forgotten, so a peer must not be able to grow
            # that table without bound (real UUIDs are 40 characters, names a few dozen).
            self._error(
                conn,
                ErrorCode.BAD_REQUEST,
                f"HELLO: device_uuid may have at most {MAX_DEVICE_UUID} characters and "
                f"device_name at most {MAX_DEVICE_NAME}",
            )
            return
        requested = str(msg.get("client_id") or "") or f"pid-{msg.get('pid') or conn.peer.pid}"
        user = await self._user_name(conn.peer.uid)
        if conn.closed or self._stopping:
            return
        client = self._assign_client_id(requested, conn)
        device = self._device_for_hello(msg)
        conn.kind = "shim"
        conn.client = client
        conn.device = device
        self._clients[client] = conn
        weight_milli = int(msg.get("weight_milli") or 1000)
        quota = int(msg.get("quota") or 0)
        label = str(msg.get("label") or "")
        pid = conn.peer.pid or int(msg.get("pid") or 0)
        resume = _resume_fields(msg)
        join = ev.Join(
            time.monotonic(),
            client,
            device,
            user,
            weight=weight_milli / 1000.0,
            quota=quota,
            context_bytes=int(msg.get("context_bytes") or 0),
            uid=conn.peer.uid,
            pid=pid,
            label=label,
            **resume,
        )
        self.log.info(
            "join client=%s device=%s user=%s uid=%d pid=%d quota=%s weight=%.3g label=%r shim=%s",
            client,
            device,
            user,
            conn.peer.uid,
            pid,
            format_size(quota) if quota else "none",
            weight_milli / 1000.0,
            label,
            msg.get("version", "?"),
        )
        if resume:
            self.log.info("resume client=%s %s", client, resume)
            if "used" in resume:
                self._memory_from(conn, msg)
        decisions = self._policy_handle(join)
        rest: list[ev.Decision] = []
        resumed = 0
        for decision in decisions:
            if isinstance(decision, ev.QuotaChanged) and decision.client == client:
                quota = decision.quota
            elif isinstance(decision, ev.Grant) and decision.client == client:
                # A resumed grant: the WELCOME says so (resume = 1); no GRANT follows.
                resumed = 1
                conn.granted_at = time.monotonic()
                self.log.info("grant client=%s resumed", client)
            else:
                rest.append(decision)
        dev = self._device_snapshot(device)
        quantum_ms = int(dev.get("quantum_ms", self.base_quantum * 1000)) if dev else 0
        pool_bytes = int(dev.get("pool_bytes", 0)) if dev else 0
        self._send(
            conn,
            Message(
                MsgType.WELCOME,
                {
                    "pool_bytes": pool_bytes,
                    "quota": quota,
                    "quantum_ms": quantum_ms or int(self.base_quantum * 1000),
                    "version": __version__,
                    **({"resume": resumed} if "resume" in resume else {}),
                },
            ),
        )
        self._execute(rest)
        self._reschedule()

    def _memory_from(self, conn: Connection, msg: Message) -> dict[str, int]:
        mem = conn.memory
        for key, name in (
            ("used", "used_bytes"),
            ("managed", "managed_bytes"),
            ("pinned", "pinned_bytes"),
            ("evicted", "evicted_bytes"),
        ):
            if name in msg:
                mem[key] = int(msg[name])
        return mem

    def _on_shim_message(self, conn: Connection, msg: Message) -> None:
        client = conn.client
        assert client is not None
        now = time.monotonic()
        mtype = msg.type
        event: ev.Event
        if mtype == MsgType.REQUEST:
            mem = self._memory_from(conn, msg)
            if conn.requested_at is None:
                conn.requested_at = now
            self.log.debug("request client=%s %s", client, _bytes(mem["used"]))
            event = ev.Request(now, client, mem["used"], mem["managed"], mem["pinned"],
                               mem["evicted"])  # fmt: skip
        elif mtype == MsgType.MEMORY:
            mem = self._memory_from(conn, msg)
            event = ev.Memory(now, client, mem["used"], mem["managed"], mem["pinned"],
                              mem["evicted"])  # fmt: skip
        elif mtype == MsgType.RELEASED:
            evicted = bool(msg.get("flag", 0))
            moved = int(msg.get("bytes_moved") or 0)
            micros = int(msg.get("micros") or 0)
            if "evicted_bytes" in msg:
                conn.memory["evicted"] = int(msg["evicted_bytes"])
            held = None if conn.granted_at is None else now - conn.granted_at
            self.log.info(
                "release client=%s evicted=%d %s ms=%.1f held_ms=%s",
                client, int(evicted), _bytes(moved), micros / 1000.0, _ms(held),
            )  # fmt: skip
            if evicted:
                self.log.info(
                    "evicted client=%s %s ms=%.1f (on release)", client, _bytes(moved),
                    micros / 1000.0,
                )  # fmt: skip
            conn.granted_at = None
            conn.revoked_at = None
            event = ev.Released(now, client, evicted, moved, micros)
        elif mtype == MsgType.IDLE:
            self.log.debug("idle client=%s idle_ms=%s", client, msg.get("idle_ms", 0))
            event = ev.Idle(now, client)
        elif mtype == MsgType.EVICTED:
            moved = int(msg.get("bytes_moved") or 0)
            micros = int(msg.get("micros") or 0)
            if "evicted_bytes" in msg:
                conn.memory["evicted"] = int(msg["evicted_bytes"])
            self.log.info("evicted client=%s %s ms=%.1f", client, _bytes(moved), micros / 1000.0)
            event = ev.Evicted(now, client, moved, micros)
        elif mtype == MsgType.RESTORED:
            moved = int(msg.get("bytes_moved") or 0)
            micros = int(msg.get("micros") or 0)
            conn.memory["evicted"] = 0
            self.log.info("restored client=%s %s ms=%.1f", client, _bytes(moved), micros / 1000.0)
            event = ev.Restored(now, client, moved, micros)
        else:  # GOODBYE
            self.log.debug("goodbye client=%s", client)
            self._client_gone(conn, "goodbye")
            return
        self._handle(event)

    # ----------------------------------------------------------------------------------------
    # Policy

    def _policy_handle(self, event: ev.Event) -> list[ev.Decision]:
        assert self.policy is not None
        try:
            return list(self.policy.handle(event))
        except Exception:
            self.log.exception("policy failed on %r", event)
            return []

    def _handle(self, event: ev.Event) -> None:
        if self.policy is None:
            return
        self._execute(self._policy_handle(event))
        self._reschedule()

    def _execute(self, decisions: list[ev.Decision]) -> None:
        now = time.monotonic()
        for decision in decisions:
            conn = self._clients.get(decision.client)
            if conn is None or conn.closed:
                self.log.debug("decision %r for a client that is gone", decision)
                continue
            mem = conn.memory
            if isinstance(decision, ev.Grant):
                waited = None if conn.requested_at is None else now - conn.requested_at
                self.log.info(
                    "grant client=%s restore=%d %s waited_ms=%s",
                    decision.client, int(decision.restore),
                    _bytes(mem["evicted"] if decision.restore else mem["used"]), _ms(waited),
                )  # fmt: skip
                conn.requested_at = None
                conn.granted_at = now
                self._send(conn, Message(MsgType.GRANT, {"flag": int(decision.restore)}))
            elif isinstance(decision, ev.Revoke):
                held = None if conn.granted_at is None else now - conn.granted_at
                self.log.info(
                    "revoke client=%s evict=%d %s held_ms=%s reason=%r",
                    decision.client, int(decision.evict),
                    _bytes(mem["managed"] if decision.evict else mem["used"]), _ms(held),
                    decision.reason,
                )  # fmt: skip
                self._send(
                    conn,
                    Message(
                        MsgType.REVOKE, {"flag": int(decision.evict), "reason": decision.reason}
                    ),
                )
                self._watch_revoke(conn, now)
            elif isinstance(decision, ev.Evict):
                self.log.info(
                    "evict client=%s %s reason=%r", decision.client, _bytes(mem["managed"]),
                    decision.reason,
                )  # fmt: skip
                self._send(conn, Message(MsgType.EVICT, {"reason": decision.reason}))
            elif isinstance(decision, ev.QuotaChanged):
                self.log.info(
                    "quota client=%s quota=%s", decision.client,
                    format_size(decision.quota) if decision.quota else "none",
                )  # fmt: skip
                self._send(conn, Message(MsgType.SET_QUOTA, {"quota": decision.quota}))
            else:  # pragma: no cover - the Decision union is closed
                self.log.error("unknown decision %r", decision)

    def _watch_revoke(self, conn: Connection, sent: float) -> None:
        """Warn the operator once when a revoke goes unanswered for revoke_warning_seconds: a
        GPU kernel that runs that long keeps the device from everyone who waits."""
        conn.revoked_at = sent
        if self.revoke_warning_seconds <= 0:
            return

        def check() -> None:
            if conn.closed or conn.left or conn.revoked_at != sent or self._stopping:
                return
            self.log.warning(
                "gpushare: client %s (pid %d) has not released the GPU %.0f s after it was asked: "
                "its GPU work still runs while others wait (interrupt or end the kernel)",
                conn.client,
                conn.peer.pid,
                time.monotonic() - sent,
            )

        asyncio.get_running_loop().call_later(self.revoke_warning_seconds, check)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_deadline = None

    def _reschedule(self, after_tick: float | None = None) -> None:
        if self.policy is None or self._stopping:
            return
        deadline = self.policy.next_deadline()
        if deadline is not None and deadline == self._timer_deadline and self._timer is not None:
            return
        self._cancel_timer()
        if deadline is None:
            return
        now = time.monotonic()
        delay = max(0.0, deadline - now)
        if after_tick is not None and deadline <= after_tick:
            # The policy asked again for a moment it was just told about: do not spin.
            delay = max(delay, 0.01)
        loop = asyncio.get_running_loop()
        self._timer_deadline = deadline
        self._timer = loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_deadline = None
        if self.policy is None or self._stopping:
            return
        now = time.monotonic()
        self._execute(self._policy_handle(ev.Tick(now)))
        self._reschedule(after_tick=now)

    # ----------------------------------------------------------------------------------------
    # Status and control

    def _device_snapshot(self, uuid: str) -> dict[str, Any] | None:
        assert self.policy is not None
        for dev in self.policy.snapshot(time.monotonic()):
            if dev.get("uuid") == uuid:
                return dev
        return None

    def status_document(self, device: str | None = None) -> dict[str, Any]:
        """The status document of docs/protocol.md (``gpushare status --json`` prints it).

        ``waiting_since`` is a Unix time (seconds); the rest is the policy's snapshot unchanged,
        plus ``version``, ``socket`` and ``nvml`` (true, or why NVML discovery failed).
        """
        now = time.monotonic()
        wall = time.time()
        devices = self.policy.snapshot(now) if self.policy is not None else []
        if device:
            devices = [d for d in devices if str(d.get("uuid", "")).lower() == device.lower()]
        for dev in devices:
            dev["utilization_percent"] = self._utilization.get(str(dev.get("uuid")))
            for client in dev.get("clients", []):
                # The policy's clock is monotonic; readers want a wall-clock (Unix) time.
                since = client.get("waiting_since")
                if isinstance(since, (int, float)):
                    client["waiting_since"] = round(wall - (now - since), 3)
        return {
            "version": __version__,
            "socket": self.socket_path,
            "nvml": True if self.discovery.error is None else self.discovery.error,
            "devices": devices,
        }

    def _on_status_request(self, conn: Connection, msg: Message) -> None:
        body = msg.get("body")
        device = None
        if isinstance(body, dict):
            device = body.get("device")
            if device is not None and not isinstance(device, str):
                self._error(conn, ErrorCode.BAD_REQUEST, "'device' must be a device UUID string")
                return
        elif body is not None:
            self._error(conn, ErrorCode.BAD_REQUEST, "the STATUS_REQUEST body must be an object")
            return
        doc = self.status_document(device)
        try:
            frame = encode(Message(MsgType.STATUS, {"body": doc}))
        except ValueError:
            # Over the 64 KiB frame limit (hundreds of clients): keep the devices, drop the
            # per-client detail, and say so.
            for dev in doc["devices"]:
                dev["clients_truncated"] = len(dev.get("clients", []))
                dev["clients"] = []
            doc["truncated"] = True
            try:
                frame = encode(Message(MsgType.STATUS, {"body": doc}))
            except ValueError:
                # Still over: devices are learnt from HELLOs, whose uuid/name may each be ~64 KiB
                # (found by tests/scheduler/test_protocol_fuzz.py); without this the encode
                # raised, and STATUS failed with a traceback for every peer from then on.
                doc["devices_truncated"] = len(doc["devices"])
                doc["devices"] = []
                frame = encode(Message(MsgType.STATUS, {"body": doc}))
        self._write_frame(conn, frame)

    def _on_control(self, conn: Connection, msg: Message) -> None:
        body = msg.get("body")
        if not isinstance(body, dict):
            self._error(conn, ErrorCode.BAD_REQUEST, "CONTROL needs a body object with 'action'")
            return
        action = body.get("action")
        client = body.get("client")
        actions = ("release", "evict", "set_quota", "kernel_state")
        if action not in actions:
            self._error(
                conn,
                ErrorCode.BAD_REQUEST,
                f"unknown action {action!r} (one of: {', '.join(actions)})",
            )
            return
        if not isinstance(client, str) or not client:
            self._error(conn, ErrorCode.BAD_REQUEST, f"{action}: 'client' (a client id) is needed")
            return
        now = time.monotonic()
        event: ev.Event
        reply: dict[str, Any] = {"ok": True, "action": action, "client": client}
        if action == "set_quota":
            raw = body.get("quota")
            try:
                if raw is None or isinstance(raw, (bool, float)):
                    raise ValueError(f"invalid size {raw!r}")
                quota = parse_size(raw)
                if quota >= 1 << 64:
                    # The quota goes out as a u64 (SET_QUOTA): a larger one made encode() raise
                    # inside _execute and killed the control connection with a traceback, after
                    # the policy had already taken it (found by test_protocol_fuzz.py).
                    raise ValueError(f"invalid size {raw!r}: over the u64 limit")
            except ValueError as exc:
                self._error(conn, ErrorCode.BAD_REQUEST, f"set_quota: 'quota': {exc}")
                return
            event = ev.SetQuota(now, client, quota)
            reply["quota"] = quota
        elif action == "kernel_state":
            state = body.get("state")
            if state not in ("busy", "idle"):
                self._error(
                    conn, ErrorCode.BAD_REQUEST, "kernel_state: 'state' must be 'busy' or 'idle'"
                )
                return
            event = ev.Busy(now, client) if state == "busy" else ev.Idle(now, client)
            reply["state"] = state
        else:
            event = ev.AdminRelease(now, client, evict=action == "evict")
        target = self._clients.get(client)
        if target is None or self.policy is None or not self.policy.has_client(client):
            self._error(conn, ErrorCode.NOT_FOUND, f"no client {client!r}")
            return
        if not self.authorize(conn.peer.uid, target.peer.uid):
            self.log.warning(
                "forbidden: uid %d asked %s on %s (uid %d)",
                conn.peer.uid,
                action,
                client,
                target.peer.uid,
            )
            self._error(
                conn,
                ErrorCode.FORBIDDEN,
                f"uid {conn.peer.uid} may not {action} client {client!r} of uid {target.peer.uid}",
            )
            return
        log = self.log.debug if action == "kernel_state" else self.log.info
        log("control %s client=%s by uid %d %s", action, client, conn.peer.uid, body)
        self._handle(event)
        self._send(conn, Message(MsgType.CONTROL_REPLY, {"body": reply}))


def _resume_fields(msg: Message) -> dict[str, Any]:
    """The Join fields of a reconnecting shim's HELLO (docs/protocol.md, "Scheduler restarts").

    ``resume``: 1 = it held the device when the scheduler was lost, 2 = it waited for it; its
    memory (``used_bytes`` ...) rides along, so the pool's accounting is right from the start.
    """
    out: dict[str, Any] = {}
    if "used_bytes" in msg:
        out["used"] = int(msg["used_bytes"])
        out["managed"] = int(msg.get("managed_bytes") or 0)
        out["pinned"] = int(msg.get("pinned_bytes") or 0)
        out["evicted"] = int(msg.get("evicted_bytes") or 0)
    state = {1: "holding", 2: "waiting"}.get(int(msg.get("resume") or 0), "")
    if "resume" in msg:
        out["resume"] = state
        out["since"] = int(msg.get("since_ms") or 0) / 1000.0
        out["gpu_seconds"] = int(msg.get("gpu_ms") or 0) / 1000.0
    return out


def _lookup_user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)
