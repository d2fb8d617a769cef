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
decided per message from the peer's identity: the kernel-verified uid's name (``SO_PEERCRED``),
or, for the ``token_uids`` that many users share (JupyterHub, Kubernetes), the user a valid
token proves (:mod:`jupyter_gpushare.identity`) -- never from what a peer merely says.

* Per-user (embedded in a user's Jupyter server, the default for non-root): the socket lives in
  ``${XDG_RUNTIME_DIR:-/tmp}/gpushare-$UID/``, which the scheduler creates with mode ``0700`` and
  refuses to use when another (non-root) user owns it. Only that user can reach the socket, so
  the socket itself can keep the permissive default mode.
* Node-wide (root or a service account, ``/run/gpushare/``): every user's kernels must reach the
  socket, so the directory is created ``0755`` and the socket is ``0666`` (connecting to a Unix
  socket needs write permission; execute bits mean nothing there). To limit the GPU to a group,
  set ``socket_group`` and ``socket_mode = 0o660``. A user who can connect can queue for the GPU
  and see the status (their own kernels in full, everyone else's summed per user), but can only
  release, evict or re-quota their own kernels; admins see and act on everything.

Users config
------------
``users_config`` names the operator's TOML file of per-user and per-group quota ceilings,
weights and admins (:mod:`.users`). It is validated at start (a bad file stops the start with
the file's error) and re-read by :meth:`GPUShareScheduler.reload` (SIGHUP, or the ``reload``
control action): a bad new file is logged and the old one kept; new ceilings and weights apply
to the clients already connected at once.

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
import socket
import stat
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from traitlets import Bool, Enum, Float, Int, List, TraitError, Unicode, Union, default, validate
from traitlets.config import LoggingConfigurable

from .._version import __version__
from ..identity import KeyFileError, load_key, verify_token
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
from .mps import MPSError, MPSManager, process_uid
from .placement import PlacementError, choose_device, device_loads
from .policy import POLICIES, Policy, PolicyConfig
from .users import (
    Identity,
    Limits,
    UsersConfig,
    UsersConfigError,
    describe_limits,
    load_users_config,
    resolve_uids,
    system_groups,
    user_name,
)
from .views import filter_status

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
    identity: Identity | None = None  # shims: from HELLO; control peers: from the last message
    requested_quota: int = 0  # what the kernel (or a set_quota) asked for; 0 = none
    requested_weight: float = 1.0
    quota: int = 0  # the effective quota the client was told
    quota_by_admin: bool = False  # an admin set it: the users config's ceiling does not apply
    revoking: bool = False  # a REVOKE is out: its RELEASED answer is a handoff (metrics)
    accounted_at: float | None = None  # GPU time of the current hold counted up to here
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

    scheduling_policy = Enum(
        list(POLICIES),
        default_value="gpushare",
        help="""The scheduling policy. "gpushare": side by side while footprints fit the pool,
        turns otherwise, a holder whose cell ended gives the device away at once.
        "fixed-quantum": a baseline for comparison, an exclusive lock held for fixed_quantum
        seconds unless a timer every idle_check_interval seconds finds the holder idle.""",
    ).tag(config=True)
    fixed_quantum = Float(30.0, help="Turn length (seconds) of the fixed-quantum policy.").tag(
        config=True
    )
    idle_check_interval = Float(
        5.0, help="Seconds between the fixed-quantum policy's checks for an idle holder."
    ).tag(config=True)
    precopy_idle = Bool(
        True,
        help="""Ask an idle kernel whose memory is on the GPU to copy it to host memory in the
        background (PRECOPY) while it stays there, so that evicting it for the next arrival is
        an unmap of milliseconds instead of a copy of seconds. Costs host memory (the shim's
        GPUSHARE_HOST_BUDGET bounds the fast part) and PCIe bandwidth while nobody waits.""",
    ).tag(config=True)

    admin_uids = List(
        Int(),
        help="""Uids that may act on any client (release, evict, set_quota, kernel_state), in
        addition to root and the scheduler's own uid. Everyone else may act on their own
        clients only (the uid comes from SO_PEERCRED).""",
    ).tag(config=True)

    users_config = Unicode(
        "",
        help="""Path of the operator's users config (TOML): per-user and per-group memory quota
        ceilings and fair-share weights, defaults for everyone else, admins by user, group or
        uid. '' = none (no ceilings; weights as the kernels ask). See
        docs/operators/node-scheduler.md. Re-read on SIGHUP.""",
    ).tag(config=True)

    user_key_file = Unicode(
        "",
        help="""Path of the node's user key (create it with `gpushare keygen PATH`; mode 0600).
        Peers of token_uids prove their user with a token derived from it
        (jupyter_gpushare.identity). Re-read on SIGHUP.""",
    ).tag(config=True)

    token_uids = List(
        Union([Int(), Unicode()]),
        help="""Uids (or user names) that many users share: a JupyterHub spawning single-user
        servers under its own uid, the uid of Kubernetes user pods (1000, jovyan). A peer of
        one of them must send a user and a valid token (GPUSHARE_USER, GPUSHARE_USER_TOKEN),
        or it is refused; its identity is that user. Such a peer is never an admin by its uid,
        only by its user name or groups. Needs user_key_file.""",
    ).tag(config=True)

    metrics_port = Int(
        0,
        help="""Serve Prometheus metrics over HTTP on this port (0 = off). The listener runs in
        its own thread; the metrics are taken from the event loop's decisions and snapshots.""",
    ).tag(config=True)

    metrics_address = Unicode(
        "127.0.0.1",
        help="""Address the metrics listener binds to. The metrics include per-user GPU time
        and memory: keep it on localhost or a management network.""",
    ).tag(config=True)

    metrics_interval = Float(
        1.0, help="Seconds between two refreshes of the metrics' gauges (holders, queues, memory)."
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

    placement_estimate = Union(
        [Int(), Unicode()],
        default_value="1GiB",
        help="""Memory a kernel without a quota is expected to use, when the scheduler places a
        new kernel on a GPU (the ``place`` control action; a kernel with a quota is expected to
        use its quota). Bytes or a size such as '4GiB'.""",
    ).tag(config=True)

    placement_timeout = Float(
        120.0,
        help="""Seconds a placement reserves room on its GPU while the kernel has not connected
        (a kernel connects when it first uses CUDA). Reservations make kernels started at the
        same moment spread over the GPUs instead of all choosing the emptiest one.""",
    ).tag(config=True)

    mps = Bool(
        False,
        help="""MPS mode: run one NVIDIA MPS control daemon per GPU and make every kernel the
        provisioner starts a client of its GPU's MPS server, so kernels admitted side by side
        run concurrently, each with a compute share (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) and a
        hard memory limit (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) from its weight and quota. See
        docs/mps.md.""",
    ).tag(config=True)

    mps_control_binary = Unicode(
        "",
        help="""The nvidia-cuda-mps-control to run. Default: the one on PATH, else
        /usr/local/nvidia/bin or /usr/bin.""",
    ).tag(config=True)

    mps_devices = List(
        Unicode(),
        help="""GPUs (UUIDs or indices, as CUDA_VISIBLE_DEVICES takes them) that get an MPS
        daemon. Default: every GPU NVML discovers.""",
    ).tag(config=True)

    mps_default_thread_percentage = Float(
        100.0,
        help="""Compute share (percent of the SMs) of a weight-1 kernel in MPS mode; a kernel
        gets this times its weight (at most 100), unless its provisioner sets compute_share.
        Below 100 it is also the daemon's default (set_default_active_thread_percentage).""",
    ).tag(config=True)

    mps_runtime_dir = Unicode(
        "",
        help="""Where each MPS daemon's pipe and log directories go (mps-<n>/pipe, mps-<n>/log).
        Default: the socket's directory.""",
    ).tag(config=True)

    mps_terminate_timeout = Float(
        30.0, help="Seconds a terminate_client may take before it counts as failed."
    ).tag(config=True)

    @validate("mps_default_thread_percentage")
    def _validate_mps_percentage(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not 0 < value <= 100:
            raise ValueError(f"mps_default_thread_percentage must be in (0, 100], got {value!r}")
        return value

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

    @validate("pool_size", "pool_reserve", "placement_estimate")
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
        # client id -> (device uuid, need in bytes, monotonic expiry): see _on_place
        self._placements: dict[str, tuple[str, int, float]] = {}
        self.users = UsersConfig()
        self._user_key: bytes | None = None
        self._token_uids: frozenset[int] = frozenset()
        self._groups: dict[tuple[str, int], frozenset[str]] = {}  # (user, gid) -> system groups
        self.metrics: Any = None  # a .metrics.SchedulerMetrics when metrics_port is set
        self._metrics_task: asyncio.Future[None] | None = None
        self._mps: MPSManager | None = None
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
            policy=self.scheduling_policy,
            fixed_quantum=self.fixed_quantum,
            idle_check_interval=self.idle_check_interval,
            precopy_idle=self.precopy_idle,
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
        await self._load_access(initial=True)
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
        if self.metrics_port:
            try:
                await self._start_metrics()
            except BaseException:
                await self.stop()  # no half-started scheduler: the socket goes too
                raise
        if self.mps:
            await self._start_mps()
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
        await self._stop_metrics()
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
        if self._mps is not None:
            mps, self._mps = self._mps, None
            await mps.stop()
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
        """Whether a peer of ``uid`` is an admin by its uid alone (root, the scheduler's own uid,
        ``admin_uids`` and the users config's ``admins.uids``; never one of ``token_uids``)."""
        if uid < 0 or uid in self._token_uids:
            return False
        return (
            uid == 0
            or uid == self.own_uid
            or uid in self.admin_uids
            or uid in self.users.admin_uids
        )

    def authorize(self, peer_uid: int, client_uid: int) -> bool:
        """May a peer of ``peer_uid`` act on a client of ``client_uid``, by uids alone?

        The uid-only rule, for callers that have no identities; the scheduler itself decides
        with :meth:`may_act`, which also covers users sharing a uid (``token_uids``)."""
        if peer_uid < 0:
            return False
        return peer_uid == client_uid or self.is_admin(peer_uid)

    async def _user_name(self, uid: int) -> str:
        name = self._user_names.get(uid)
        if name is None:
            loop = asyncio.get_running_loop()
            name = await loop.run_in_executor(None, user_name, uid)
            self._user_names[uid] = name
        return name

    async def _groups_of(self, user: str, gid: int) -> frozenset[str]:
        """``user``'s groups: those whose ``members`` list names it in the users config, and
        (only when the config names system groups) its system groups, looked up off the loop."""
        groups = self.users.listed_groups(user)
        if not self.users.needs_system_groups:
            return groups
        key = (user, gid)
        found = self._groups.get(key)
        if found is None:
            loop = asyncio.get_running_loop()
            found = await loop.run_in_executor(None, system_groups, user, gid)
            self._groups[key] = found
        return groups | found

    async def identify(self, peer: PeerCred, msg: Message) -> Identity | str:
        """The peer's identity for ``msg`` (a HELLO or a control message), or why it is refused.

        Peers of ``token_uids`` are who their valid token says; everyone else is their uid's
        user, whatever ``user`` they send (docs/protocol.md, "Transport and identity").
        """
        claimed = str(msg.get("user") or "")
        if peer.uid in self._token_uids:
            token = str(msg.get("token") or "")
            if self._user_key is None:
                return (
                    f"uid {peer.uid} is one of the scheduler's token_uids, but the scheduler has "
                    "no user key (user_key_file) to check tokens with"
                )
            if not claimed or not token:
                return (
                    f"uid {peer.uid} is shared by many users: send a user and its token "
                    "(GPUSHARE_USER and GPUSHARE_USER_TOKEN, set by the hub)"
                )
            if not verify_token(self._user_key, claimed, token):
                self.log.warning("forbidden: uid %d sent a wrong token for %r", peer.uid, claimed)
                return f"the token for user {claimed!r} is not valid on this node"
            return await self._identity(claimed, peer, token=True)
        if peer.uid < 0:
            return "the peer's credentials are unknown (no SO_PEERCRED)"
        name = await self._user_name(peer.uid)
        if claimed and claimed != name:
            self.log.debug("uid %d (%s) says it is %r: ignored", peer.uid, name, claimed)
        return await self._identity(name, peer, token=False)

    async def _identity(self, user: str, peer: PeerCred, token: bool) -> Identity:
        """``user``'s identity with its groups and admin status under the current users config.

        A token identity's system groups are those of the user name (a hub user who is also a
        system user), not of the shared uid's gid; it is never an admin by uid.
        """
        groups = await self._groups_of(user, -1 if token else peer.gid)
        uid = None if token else peer.uid
        admin = (uid is not None and self.is_admin(uid)) or self.users.is_admin(user, uid, groups)
        return Identity(user, peer.uid, groups, admin, token)

    def may_act(self, who: Identity, target: Connection) -> bool:
        """May ``who`` release, evict, re-quota or mark the client of ``target``?"""
        owner = target.identity
        return who.admin or (owner is not None and owner.user == who.user)

    def limits_for(self, ident: Identity) -> Limits:
        return self.users.limits(ident.user, ident.groups)

    # ----------------------------------------------------------------------------------------
    # Users config, key, reload

    def _read_access(self) -> tuple[UsersConfig, bytes | None, frozenset[int]]:
        """Read and check the users config, the key and token_uids (blocking; may raise)."""
        users = load_users_config(self.users_config)
        token_uids = resolve_uids(list(self.token_uids))
        key = None
        if self.user_key_file:
            key = load_key(self.user_key_file)
        elif token_uids:
            raise UsersConfigError(
                "token_uids is set but user_key_file is not: tokens cannot be checked "
                "(create a key with `gpushare keygen PATH`)"
            )
        return users, key, token_uids

    async def _load_access(self, initial: bool = False) -> bool:
        loop = asyncio.get_running_loop()
        try:
            users, key, token_uids = await loop.run_in_executor(None, self._read_access)
        except (UsersConfigError, KeyFileError) as exc:
            if initial:
                raise SchedulerStartError(str(exc)) from None
            self.log.error("reload failed, keeping the previous configuration: %s", exc)
            return False
        self.users, self._user_key, self._token_uids = users, key, token_uids
        self._groups.clear()
        self.log.info(
            "access: users config %s (%d user(s), %d group(s); default %s), token uids %s",
            users.path or "none",
            len(users.users),
            len(users.groups),
            describe_limits(users.limits("", frozenset())),
            sorted(token_uids) or "none",
        )
        return True

    async def reload(self) -> bool:
        """Re-read the users config and the user key; apply new ceilings and weights to the
        clients already connected. A file that does not load is logged and changes nothing."""
        if not await self._load_access():
            return False
        now = time.monotonic()
        for conn in list(self._clients.values()):
            ident = conn.identity
            if conn.closed or ident is None:
                continue
            # Identities of connected clients keep their user; admin status and groups follow
            # the new file.
            conn.identity = ident = await self._identity(ident.user, conn.peer, ident.token)
            if conn.closed:
                continue
            limits = self.limits_for(ident)
            weight = limits.effective_weight(conn.requested_weight)
            self._handle(ev.SetWeight(now, conn.client or "", weight))
            quota = conn.requested_quota
            if not conn.quota_by_admin:
                quota = limits.effective_quota(quota)
            if quota != conn.quota:
                conn.quota = quota
                self._handle(ev.SetQuota(now, conn.client or "", quota))
        self.log.info("reloaded: %d client(s) re-checked", len(self._clients))
        return True

    def request_reload(self) -> None:
        """Reload from a signal handler on the loop (SIGHUP)."""
        task = asyncio.ensure_future(self.reload())
        self._tasks.add(task)  # type: ignore[arg-type]
        task.add_done_callback(self._tasks.discard)  # type: ignore[arg-type]

    # ----------------------------------------------------------------------------------------
    # Metrics

    async def _start_metrics(self) -> None:
        from .metrics import SchedulerMetrics

        loop = asyncio.get_running_loop()
        self.metrics = SchedulerMetrics()
        try:
            await loop.run_in_executor(
                None, self.metrics.serve, self.metrics_address, self.metrics_port
            )
        except OSError as exc:
            self.metrics = None
            raise SchedulerStartError(
                f"cannot serve metrics on {self.metrics_address}:{self.metrics_port}: {exc}"
            ) from exc
        self.log.info("metrics on http://%s:%d/metrics", self.metrics_address, self.metrics.port)
        self.refresh_metrics()
        self._metrics_task = asyncio.ensure_future(self._metrics_loop())

    async def _metrics_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(max(self.metrics_interval, 0.01))
            self.refresh_metrics()

    def refresh_metrics(self) -> None:
        """Count the GPU time of current holds and publish a fresh snapshot (on the loop)."""
        if self.metrics is None or self.policy is None:
            return
        now = time.monotonic()
        for conn in self._clients.values():
            self._account_gpu_time(conn, now)
        self.metrics.publish(self.policy.snapshot(now), len(self._connections))

    def _account_gpu_time(self, conn: Connection, now: float) -> None:
        if self.metrics is None or conn.granted_at is None or conn.identity is None:
            return
        since = conn.accounted_at if conn.accounted_at is not None else conn.granted_at
        if now > since:
            self.metrics.gpu_time(conn.identity.user, now - since)
        conn.accounted_at = now

    async def _stop_metrics(self) -> None:
        if self._metrics_task is not None:
            self._metrics_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._metrics_task
            self._metrics_task = None
        if self.metrics is not None:
            metrics, self.metrics = self.metrics, None
            await asyncio.get_running_loop().run_in_executor(None, metrics.shutdown)

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
        self._account_gpu_time(conn, time.monotonic())
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
            if conn.kind == "control":
                # Each control message is identified on its own (it may carry user and token).
                ident = await self.identify(conn.peer, msg)
                if conn.closed:
                    return
                if isinstance(ident, str):
                    self._error(conn, ErrorCode.FORBIDDEN, ident)
                    return
                conn.identity = ident
            if _mps_action(msg):
                await self._on_mps_control(conn, msg)
                return
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
        ident = await self.identify(conn.peer, msg)
        if conn.closed or self._stopping:
            return
        if isinstance(ident, str):
            self.log.warning("refused HELLO of %s: %s", conn.name, ident)
            self._error(conn, ErrorCode.FORBIDDEN, ident)
            conn.closed = True  # the reader loop ends and closes the socket after the ERROR
            return
        user = ident.user
        conn.identity = ident
        client = self._assign_client_id(requested, conn)
        device = self._device_for_hello(msg)
        conn.kind = "shim"
        conn.client = client
        conn.device = device
        self._clients[client] = conn
        weight_milli = int(msg.get("weight_milli") or 1000)
        quota = int(msg.get("quota") or 0)
        limits = self.limits_for(ident)
        conn.requested_quota, conn.requested_weight = quota, weight_milli / 1000.0
        quota = limits.effective_quota(quota)
        if quota != conn.requested_quota:
            self.log.info(
                "quota of client=%s user=%s clamped to its ceiling %s (asked %s)",
                client, user, format_size(quota),
                format_size(conn.requested_quota) if conn.requested_quota else "none",
            )  # fmt: skip
        weight_milli = round(limits.effective_weight(conn.requested_weight) * 1000)
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
        conn.quota = quota
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
                              mem["evicted"], self._precopied_from(msg, mem))  # fmt: skip
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
            self._account_gpu_time(conn, now)
            if self.metrics is not None:
                self.metrics.released(conn.device or "", conn.revoking, moved if evicted else 0)
            conn.granted_at = None
            conn.accounted_at = None
            conn.revoking = False
            conn.revoked_at = None
            event = ev.Released(now, client, evicted, moved, micros)
        elif mtype == MsgType.IDLE:
            self.log.debug("idle client=%s idle_ms=%s", client, msg.get("idle_ms", 0))
            precopied = self._precopied_from(msg, conn.memory) if "precopied_bytes" in msg else -1
            event = ev.Idle(now, client, precopied)
        elif mtype == MsgType.EVICTED:
            moved = int(msg.get("bytes_moved") or 0)
            micros = int(msg.get("micros") or 0)
            if "evicted_bytes" in msg:
                conn.memory["evicted"] = int(msg["evicted_bytes"])
            self.log.info("evicted client=%s %s ms=%.1f", client, _bytes(moved), micros / 1000.0)
            if self.metrics is not None:
                self.metrics.moved(conn.device or "", "evict", moved)
            event = ev.Evicted(now, client, moved, micros)
        elif mtype == MsgType.PRECOPIED:
            moved = int(msg.get("bytes_moved") or 0)
            micros = int(msg.get("micros") or 0)
            precopied = self._precopied_from(msg, conn.memory)
            self.log.info(
                "precopied client=%s %s ms=%.1f valid=%s", client, _bytes(moved),
                micros / 1000.0, format_size(precopied),
            )  # fmt: skip
            event = ev.Precopied(now, client, moved, micros, precopied)
        elif mtype == MsgType.RESTORED:
            moved = int(msg.get("bytes_moved") or 0)
            micros = int(msg.get("micros") or 0)
            conn.memory["evicted"] = 0
            self.log.info("restored client=%s %s ms=%.1f", client, _bytes(moved), micros / 1000.0)
            if self.metrics is not None:
                self.metrics.moved(conn.device or "", "restore", moved)
            event = ev.Restored(now, client, moved, micros)
        else:  # GOODBYE
            self.log.debug("goodbye client=%s", client)
            self._client_gone(conn, "goodbye")
            return
        self._handle(event)

    @staticmethod
    def _precopied_from(msg: Message, mem: dict[str, int]) -> int:
        """A client's pre-copied bytes: a claim, bounded by what it says it could evict."""
        claimed = int(msg.get("precopied_bytes") or 0)
        return max(0, min(claimed, mem.get("managed", 0)))

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
                conn.accounted_at = now
                if self.metrics is not None:
                    self.metrics.granted(conn.device or "", waited)
                self._send(conn, Message(MsgType.GRANT, {"flag": int(decision.restore)}))
            elif isinstance(decision, ev.Revoke):
                held = None if conn.granted_at is None else now - conn.granted_at
                self.log.info(
                    "revoke client=%s evict=%d %s held_ms=%s reason=%r",
                    decision.client, int(decision.evict),
                    _bytes(mem["managed"] if decision.evict else mem["used"]), _ms(held),
                    decision.reason,
                )  # fmt: skip
                conn.revoking = True
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
            elif isinstance(decision, ev.Precopy):
                self.log.info("precopy client=%s %s", decision.client, _bytes(mem["managed"]))
                self._send(conn, Message(MsgType.PRECOPY, {}))
            elif isinstance(decision, ev.QuotaChanged):
                self.log.info(
                    "quota client=%s quota=%s", decision.client,
                    format_size(decision.quota) if decision.quota else "none",
                )  # fmt: skip
                conn.quota = decision.quota
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

    def status_document(
        self, device: str | None = None, viewer: Identity | None = None
    ) -> dict[str, Any]:
        """The status document of docs/protocol.md (``gpushare status --json`` prints it).

        ``waiting_since`` is a Unix time (seconds); the rest is the policy's snapshot unchanged,
        plus ``version``, ``socket`` and ``nvml`` (true, or why NVML discovery failed). For a
        ``viewer`` who is not an admin, other users' clients are summed per user
        (:func:`.views.filter_status`); ``None`` (an in-process caller) sees everything.
        """
        now = time.monotonic()
        wall = time.time()
        devices = self.policy.snapshot(now) if self.policy is not None else []
        if device:
            devices = [d for d in devices if str(d.get("uuid", "")).lower() == device.lower()]
        for dev in devices:
            dev["index"] = self._device_index(str(dev.get("uuid")))
            dev["utilization_percent"] = self._utilization.get(str(dev.get("uuid")))
            for client in dev.get("clients", []):
                # The policy's clock is monotonic; readers want a wall-clock (Unix) time.
                since = client.get("waiting_since")
                if isinstance(since, (int, float)):
                    client["waiting_since"] = round(wall - (now - since), 3)
        doc = {
            "version": __version__,
            "socket": self.socket_path,
            "nvml": True if self.discovery.error is None else self.discovery.error,
            "devices": devices,
        }
        if self._mps is not None:
            doc["mps"] = self._mps.describe()
        return doc if viewer is None else filter_status(doc, viewer)

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
        doc = self.status_document(device, conn.identity)
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
        actions = ("release", "evict", "set_quota", "kernel_state", "reload", "place")
        if action not in actions:
            self._error(
                conn,
                ErrorCode.BAD_REQUEST,
                f"unknown action {action!r} (one of: {', '.join(actions)})",
            )
            return
        who = conn.identity
        if who is None:  # pragma: no cover - _dispatch identifies every control message
            self._error(conn, ErrorCode.FORBIDDEN, "unidentified peer")
            return
        if action == "reload":
            self._on_reload_request(conn, who)
            return
        if action == "place":
            self._on_place(conn, body)
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
        if not self.may_act(who, target):
            owner = target.identity.user if target.identity is not None else "?"
            self.log.warning(
                "forbidden: %s asked %s on %s (user %s)", who.describe(), action, client, owner
            )
            self._error(
                conn,
                ErrorCode.FORBIDDEN,
                f"{who.user} may not {action} client {client!r}: it belongs to another user "
                "(only its owner or an admin may)",
            )
            return
        if isinstance(event, ev.SetQuota):
            refusal = self._quota_refusal(who, target, event.quota)
            if refusal:
                self.log.warning("forbidden: %s: %s", who.describe(), refusal)
                self._error(conn, ErrorCode.FORBIDDEN, refusal)
                return
            target.requested_quota = event.quota
            target.quota_by_admin = who.admin
        log = self.log.debug if action == "kernel_state" else self.log.info
        log("control %s client=%s by %s %s", action, client, who.describe(), body)
        self._handle(event)
        self._send(conn, Message(MsgType.CONTROL_REPLY, {"body": reply}))

    # ----------------------------------------------------------------------------------------
    # MPS mode (scheduler/mps.py does the work; docs/mps.md)

    async def _start_mps(self) -> None:
        devices = list(self.mps_devices) or [dev.uuid for dev in self.discovery.devices]
        self._mps = MPSManager(
            runtime_dir=self.mps_runtime_dir or os.path.dirname(self.socket_path) or ".",
            binary=self.mps_control_binary,
            default_percentage=self.mps_default_thread_percentage,
            terminate_timeout=self.mps_terminate_timeout,
            log=self.log,
        )
        try:
            await self._mps.start(devices)
        except MPSError as exc:
            self._mps = None
            await self.stop()
            raise SchedulerStartError(f"MPS mode: {exc}") from exc

    async def _on_mps_control(self, conn: Connection, msg: Message) -> None:
        """The ``mps_env`` and ``mps_terminate`` control actions (docs/protocol.md)."""
        body = msg.get("body")
        assert isinstance(body, dict)
        action = body["action"]
        reply: dict[str, Any] = {"ok": True, "action": action, "enabled": self._mps is not None}
        if action == "mps_env":
            error = self._mps_env(body, reply)
        else:
            error = await self._mps_terminate(conn, body, reply)
        if error is not None:
            self._error(conn, error[0], f"{action}: {error[1]}")
            return
        self._send(conn, Message(MsgType.CONTROL_REPLY, {"body": reply}))

    def _may_terminate(self, conn: Connection, pid: int, owner_uid: int) -> bool:
        """May this control peer have process ``pid`` (of ``owner_uid``) terminate_client'ed?

        By uid: the process's owner or an admin. On a uid that many users share (token_uids),
        the uid says nothing about the user, so the process must be a kernel of the asking
        user's identity (or the asker an admin): else one hub user could end another's kernel.
        """
        who = conn.identity
        if who is not None and who.admin:
            return True
        if conn.peer.uid in self._token_uids:
            return who is not None and any(
                c.peer.pid == pid and c.identity is not None and c.identity.user == who.user
                for c in self._clients.values()
            )
        return self.authorize(conn.peer.uid, owner_uid)

    def _mps_env(self, body: dict[str, Any], reply: dict[str, Any]) -> tuple[ErrorCode, str] | None:
        weight, quota, share = (
            body.get("weight", 1.0),
            body.get("quota", 0),
            body.get("compute_share"),
        )
        device = body.get("device")
        try:
            if (
                isinstance(weight, bool)
                or not isinstance(weight, (int, float))
                or not 0 < weight < float("inf")  # NaN fails this too
            ):
                raise ValueError(f"'weight' must be a positive number, got {weight!r}")
            if share is not None and (
                isinstance(share, bool)
                or not isinstance(share, (int, float))
                or not 0 <= share <= 100
            ):
                raise ValueError(f"'compute_share' must be a percentage, got {share!r}")
            if device is not None and not isinstance(device, str):
                raise ValueError("'device' must be a device UUID or index string")
            quota_bytes = 0 if quota in (None, "", 0) else parse_size(quota)
        except ValueError as exc:
            return ErrorCode.BAD_REQUEST, str(exc)
        if self._mps is None:
            return None
        if device is None:
            device = self._least_loaded_mps_device()
        try:
            reply.update(
                self._mps.client_env(
                    device,
                    weight=float(weight),
                    compute_share=float(share) if share else None,
                    quota_bytes=quota_bytes,
                )
            )
        except MPSError as exc:
            return ErrorCode.NOT_FOUND, str(exc)
        self.log.info(
            "mps_env client=%s device=%s env=%s", body.get("client"), reply["device"],
            reply["env"],
        )  # fmt: skip
        return None

    def _least_loaded_mps_device(self) -> str | None:
        assert self._mps is not None
        counts = {
            str(dev.get("uuid", "")).lower(): len(dev.get("clients", []))
            for dev in (self.policy.snapshot(time.monotonic()) if self.policy else [])
        }
        daemons = list(self._mps.daemons)
        if not daemons:
            return None
        return min(daemons, key=lambda d: counts.get(d.lower(), 0))

    async def _mps_terminate(
        self, conn: Connection, body: dict[str, Any], reply: dict[str, Any]
    ) -> tuple[ErrorCode, str] | None:
        pid = body.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
            return ErrorCode.BAD_REQUEST, "'pid' (a process id) is needed"
        reply["pid"] = pid
        reply["terminated"] = []
        if self._mps is None:
            return None
        owner = await asyncio.get_running_loop().run_in_executor(None, process_uid, pid)
        if owner is None:
            return ErrorCode.NOT_FOUND, f"no process {pid}"
        if not self._may_terminate(conn, pid, owner):
            self.log.warning(
                "forbidden: uid %d asked mps_terminate of pid %d (uid %d)",
                conn.peer.uid, pid, owner,
            )  # fmt: skip
            return ErrorCode.FORBIDDEN, f"uid {conn.peer.uid} may not terminate pid {pid}"
        reply["terminated"] = await self._mps.terminate_process(pid, tree=body.get("tree", True))
        reply["ok"] = all(r["ok"] for r in reply["terminated"])
        return None

    # ----------------------------------------------------------------------------------------
    # Placement (several GPUs): see placement.py for the rule

    #: At most this many kernels may be placed and not connected yet (oldest dropped first).
    MAX_PLACEMENTS = 4096

    def _device_index(self, uuid: str) -> int | None:
        """NVML's index of a device (what nvidia-smi shows), None for one learnt from a shim."""
        for dev in self.discovery.devices:
            if dev.uuid.lower() == uuid.lower():
                return dev.index
        return None

    def place(
        self,
        client: str,
        need: int | None = None,
        device: str | int | None = None,
        reachable: list[str] | None = None,
    ) -> dict[str, Any]:
        """Choose the GPU of a kernel about to start and reserve room there until it connects.

        Raises PlacementError (no device known, or a pin naming none).
        """
        assert self.policy is not None
        now = time.monotonic()
        estimate = parse_size(self.placement_estimate)
        need = estimate if need is None or need <= 0 else need
        # A reservation ends when its kernel connects (the policy counts it then) or expires.
        self._placements = {
            cid: p
            for cid, p in self._placements.items()
            if p[2] > now and cid != client and not self.policy.has_client(cid)
        }
        devices = self.status_document()["devices"]
        loads = device_loads(devices, [(p[0], p[1]) for p in self._placements.values()], estimate)
        choice = choose_device(loads, need, device, reachable)
        while len(self._placements) >= self.MAX_PLACEMENTS:
            del self._placements[next(iter(self._placements))]
        self._placements[client] = (choice.uuid, need, now + self.placement_timeout)
        return {
            "device": choice.uuid,
            "index": choice.index,
            "fits": choice.fits,
            "free_bytes": choice.free_bytes,
            "need": need,
            "reason": choice.reason,
            "devices": len(loads),
        }

    def _on_place(self, conn: Connection, body: dict[str, Any]) -> None:
        """CONTROL ``place``: ``{"client": id, "need": bytes, "device": pin (index or UUID),
        "reachable": [UUIDs the kernel can use]}`` (all but client optional) -> the chosen
        device's uuid and index."""
        client = body.get("client")
        need = body.get("need")
        device = body.get("device")
        reachable = body.get("reachable")
        if reachable is not None and (
            not isinstance(reachable, list)
            or len(reachable) > 64
            or not all(isinstance(u, str) and len(u) <= MAX_DEVICE_UUID for u in reachable)
        ):
            self._error(conn, ErrorCode.BAD_REQUEST, "place: 'reachable' must list GPU UUIDs")
            return
        if not isinstance(client, str) or not client or len(client) > 256:
            self._error(conn, ErrorCode.BAD_REQUEST, "place: 'client' (a client id) is needed")
            return
        if need is not None and (not isinstance(need, int) or isinstance(need, bool) or need < 0):
            self._error(conn, ErrorCode.BAD_REQUEST, "place: 'need' must be a byte count")
            return
        if device is not None and (not isinstance(device, (str, int)) or isinstance(device, bool)):
            self._error(conn, ErrorCode.BAD_REQUEST, "place: 'device' must be an index or a UUID")
            return
        try:
            answer = self.place(client, need, device, reachable)
        except PlacementError as exc:
            # No device at all (no NVML, nothing connected yet): not_found, the caller goes on
            # without placement. A pin naming no device: bad_request, the caller's mistake.
            code = ErrorCode.BAD_REQUEST if self._devices else ErrorCode.NOT_FOUND
            self._error(conn, code, f"place: {exc}")
            return
        self.log.info(
            "place client=%s device=%s index=%s need=%s fits=%s reason=%r by uid %d",
            client, answer["device"], answer["index"], format_size(answer["need"]),
            answer["fits"], answer["reason"], conn.peer.uid,
        )  # fmt: skip
        reply = {"ok": True, "action": "place", "client": client, **answer}
        self._send(conn, Message(MsgType.CONTROL_REPLY, {"body": reply}))

    def _quota_refusal(self, who: Identity, target: Connection, quota: int) -> str | None:
        """Why ``who`` may not give ``target`` this quota (over its user's ceiling), or None.

        The users config's quota is a ceiling on every kernel of the user; only an admin may
        set a quota above it (or none at all where there is a ceiling).
        """
        if who.admin or target.identity is None:
            return None
        ceiling = self.limits_for(target.identity).quota
        if ceiling == 0 or (quota != 0 and quota <= ceiling):
            return None
        asked = format_size(quota) if quota else "no quota"
        return (
            f"set_quota: {asked} is over the ceiling of {format_size(ceiling)} that the "
            f"operator set for user {target.identity.user} (users config); ask for at most "
            f"{format_size(ceiling)}, or ask an admin"
        )

    def _on_reload_request(self, conn: Connection, who: Identity) -> None:
        if not who.admin:
            self._error(conn, ErrorCode.FORBIDDEN, f"{who.user} may not reload: admins only")
            return
        self.log.info("reload asked by %s", who.describe())

        async def run() -> None:
            ok = await self.reload()
            if ok:
                body = {"ok": True, "action": "reload"}
                self._send(conn, Message(MsgType.CONTROL_REPLY, {"body": body}))
            else:
                self._error(
                    conn,
                    ErrorCode.BAD_REQUEST,
                    "reload failed: the configuration did not load (see the scheduler's log); "
                    "the previous one is still in force",
                )

        task = asyncio.ensure_future(run())
        self._tasks.add(task)  # type: ignore[arg-type]
        task.add_done_callback(self._tasks.discard)  # type: ignore[arg-type]


def _mps_action(msg: Message) -> bool:
    body = msg.get("body")
    return (
        msg.type == MsgType.CONTROL
        and isinstance(body, dict)
        and body.get("action") in ("mps_env", "mps_terminate")
    )


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
