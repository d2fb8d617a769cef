"""The scheduler's asyncio shell: a thin composition of pure layers around the policy.

The policy (:mod:`.policy`) decides; the layers around it each do one thing:

* :mod:`.transport`: the socket (its directory's owner and mode, a stale one removed), peer
  credentials (``SO_PEERCRED``), connections, frames in and out, limits;
* :mod:`.translate`: frames and control messages in, checked requests and policy events out,
  no I/O and no clock of its own;
* :mod:`.access`: who a peer is (its kernel-verified uid's user, or the user a token proves for
  the ``token_uids`` that many users share) and what it may do, quota ceilings included;
* :mod:`.config`: the ``c.GPUShareScheduler.*`` traits.

This module wires them to the event loop: each accepted connection's first message decides what
it is (``HELLO``: a shim; ``STATUS_REQUEST``/``CONTROL``: a control peer); shim messages become
policy events stamped with ``time.monotonic()``; the policy's decisions become ``GRANT``/
``REVOKE``/``EVICT`` frames; one timer fires :class:`~.events.Tick` at
``policy.next_deadline()``; a connection that closes, for any reason, is a
:class:`~.events.Leave` at once. Listeners added with
:meth:`GPUShareScheduler.add_status_listener` hear of every event the policy takes.

Socket permissions, the users config and duplicate client ids are described in
docs/architecture.md and docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

from traitlets import Float, observe

from ..._version import __version__
from ...identity import KeyFileError, token_name_refusal
from ...protocol import CONTROL_MESSAGES, SHIM_MESSAGES, ErrorCode, Message, MsgType
from ...units import format_size
from ..core import events as ev
from ..core.policy import Policy
from ..features.allocations import AllocationControl, cap_quota, confined
from ..features.history import History
from ..features.mps import MPSError, MPSManager
from ..features.reservations import Reservations
from ..features.sleeping import DeepIdleShell
from . import translate as tr
from .access import Access, AccessFiles
from .config import SchedulerConfig
from .control import ControlActions
from .devices import (
    Discovery,
    UtilizationSampler,
    discover_devices_async,
    discovery_warning,
    find_devices,
    nvml_pids_comparable,
)
from .keep import KeptStateShell
from .kernel_ids import IdOwners, KernelIds
from .logs import escape_log
from .metrics_feed import MetricsFeed
from .resume import KeptState, ResumeKey
from .shims import ShimSessions
from .transport import (
    Connection,
    EventBudget,
    LogLimiter,
    PeerCred,
    SchedulerConfigError,
    SchedulerStartError,
    SocketFile,
    listen,
    read_peer_credentials,
    serve_frames,
)
from .users import Identity, Limits, UsersConfig, UsersConfigError, describe_limits

__all__ = [
    "Connection",
    "GPUShareScheduler",
    "PeerCred",
    "SchedulerConfigError",
    "SchedulerStartError",
]


class GPUShareScheduler(
    DeepIdleShell, ShimSessions, KeptStateShell, ControlActions, AllocationControl, SchedulerConfig
):
    """The node's GPU scheduler: one policy, one Unix socket, many shim clients."""

    history_resolution = Float(
        5.0, help="Seconds between two points of the last hour's history (per kernel, user, GPU)."
    ).tag(config=True)

    frames_per_second = Float(
        500.0,
        help="""Frames of one peer the scheduler reads per second, on all its connections
        together (a peer: a uid, or each user a token proves on one of token_uids); bursts of
        twice as many pass at once. Past it, its connections are read more slowly (their
        writes block), so a peer writing frames as fast as it can never delays the others'
        status, HELLOs or the liveness probe. A shim sends a few a second (it spaces its
        MEMORY reports itself). 0: no limit.""",
    ).tag(config=True)

    #: The history and the kept state (.resume.KeptState) take the status at most this often
    #: (seconds): a burst of events costs one status document, not one each (a history point
    #: closer than its resolution replaces the one before anyway).
    HISTORY_DELAY = 0.25

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.access = Access(os.getuid(), frozenset(self.admin_uids))
        self.policy: Policy | None = None
        self.discovery = Discovery([], "not started")
        self._server: asyncio.AbstractServer | None = None
        self._socket: SocketFile | None = None
        self._connections: dict[int, Connection] = {}
        #: client id -> the shim's connection (each shim client the policy knows by this id)
        self._shims: dict[str, Connection] = {}
        self._id_owners = IdOwners()  # who each id belongs to (.kernel_ids)
        self._kernel_ids = KernelIds()  # ids bound to a kernel secret (.kernel_ids)
        self._devices: dict[str, str] = {}  # lower-case uuid -> uuid as registered
        self._learnt_devices: dict[str, int] = {}  # lower-case uuid -> uid of the HELLO
        self._device_totals: dict[str, int] = {}  # lower-case uuid -> bytes (0: unknown)
        self._serial = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_deadline: float | None = None
        self._stopping = False
        self._stop_requested: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._utilization: dict[str, int] = {}  # device uuid -> percent, from the sampler task
        self._sampler: asyncio.Future[None] | None = None
        self._reservations = Reservations()
        self._status_listeners: list[Callable[[], None]] = []
        self._metrics_feed = MetricsFeed(self.log)
        self._log_limit = LogLimiter(self.log)
        escape_log(self.log)  # peers' text never forges a log line (A17)
        #: The last hour per kernel, user and GPU, recorded at every status change.
        self.history = History(resolution=self.history_resolution)
        self._history_timer: asyncio.TimerHandle | None = None
        self._history_at = -1e9  # when the history last took the status (monotonic)
        self.add_status_listener(self._history_changed)
        #: Set once start() has armed the recovery window: no message is handled before.
        self._accepting = asyncio.Event()
        self._kept: KeptState | None = None  # what the last scheduler kept (.resume)
        self._keeping: asyncio.Future[None] | None = None  # a save of our state under way
        self._keep_again = False
        self._budget = EventBudget(self.frames_per_second, 2 * self.frames_per_second)
        self._mps: MPSManager | None = None
        self._access_error = ""  # why the last load of the access configuration failed
        # Replaced at start by the key kept beside the socket (see .resume).
        self._resume_key = ResumeKey.generate()
        self._init_deep_idle()

    # ----------------------------------------------------------------------------------------
    # The public surface besides start/stop: status listeners and the access rules

    def add_status_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (on the loop) after every event that reaches the policy: join,
        leave, request, release, memory, tick, control. A failing listener is logged."""
        self._status_listeners.append(listener)

    def remove_status_listener(self, listener: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._status_listeners.remove(listener)

    def history_view(self, viewer: Identity | None = None) -> dict[str, Any]:
        """The history as ``viewer`` may see it: every GPU and every user's sums (as the status
        shows them), the kernels of their own only unless they are an admin (None: all). Thinned
        until it fits a control reply's frame (64 KiB) with room to spare."""
        if self._history_timer is not None:
            self._record_history()  # the changes since it last took the status
        now = time.time()
        own = None
        if viewer is not None and not viewer.admin:
            own = [k for k, s in self.history.kernels.items() if s.meta.get("user") == viewer.user]
        points = 60
        while True:
            view = self.history.view(now, kernels=own, max_points=points)
            if points <= 2 or len(json.dumps(view)) < 48_000:
                return view
            points //= 2

    def _history_changed(self) -> None:
        """A status change: the history takes the status now, or once HISTORY_DELAY has passed
        since it last did (later changes until then are in that one)."""
        if self._history_timer is not None:
            return
        wait = self._history_at + self.HISTORY_DELAY - time.monotonic()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            wait = 0.0
        if wait <= 0:
            self._record_history()
        else:
            self._history_timer = loop.call_later(wait, self._record_history)

    def _record_history(self) -> None:
        if self._history_timer is not None:
            self._history_timer.cancel()
            self._history_timer = None
        self._history_at = time.monotonic()
        self.history.record(time.time(), self.status_document())
        self._keep_state()

    async def _pace(self, conn: Connection, frames: int) -> None:
        """Pause ``conn`` while its peer is past frames_per_second (.transport.EventBudget)."""
        peer = conn.peer.uid
        if peer in (0, self.own_uid):
            return  # root's and the scheduler's own account's tools (the liveness probe)
        user = conn.identity.user if conn.identity is not None else ""
        key = (peer, user if peer in self.access.token_uids else "")
        end = time.monotonic() + self._budget.debt(key, frames, time.monotonic())
        while not (self._stopping or conn.closed) and (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 0.5))  # a scheduler that stops does not wait for it

    @observe("frames_per_second")
    def _frames_per_second_changed(self, change: Any) -> None:
        if hasattr(self, "_budget"):
            self._budget.rate, self._budget.burst = change["new"], 2 * change["new"]

    @property
    def own_uid(self) -> int:
        """The scheduler's own uid: an admin (a service account may run it)."""
        return self.access.own_uid

    @own_uid.setter
    def own_uid(self, uid: int) -> None:
        self.access.own_uid = uid

    @observe("admin_uids")
    def _admin_uids_changed(self, change: Any) -> None:
        if hasattr(self, "access"):
            self.access.admin_uids = frozenset(change["new"])

    @property
    def users(self) -> UsersConfig:
        return self.access.users

    def is_admin(self, uid: int) -> bool:
        return self.access.is_admin(uid)

    def authorize(self, peer_uid: int, client_uid: int) -> bool:
        return self.access.authorize(peer_uid, client_uid)

    def limits_for(self, ident: Identity) -> Limits:
        return self.access.limits_for(ident)

    async def identify(self, peer: PeerCred, msg: Message) -> Identity | str:
        """The peer's identity for ``msg`` (a HELLO or a control message), or why it is refused."""
        found = await self.access.identify(
            peer, str(msg.get("user") or ""), str(msg.get("token") or "")
        )
        if isinstance(found, Identity) and found.token:
            # Token users and local accounts are kept apart (issue 22, item 11).
            clash = await asyncio.get_running_loop().run_in_executor(
                None, token_name_refusal, found.user, self.access.token_uids
            )
            found = clash or found
        if not isinstance(found, str) and self._over_identity_limit(peer.uid, found.user):
            found = (
                f"user {found.user!r} has too many connections open to the scheduler "
                "(max_connections_per_uid, per user on a shared uid)"
            )
        if isinstance(found, str) and peer.uid in self.access.token_uids:
            self._log_limit.warning(peer.uid, "forbidden: uid %d: %s", peer.uid, found)
        return found

    def peer_credentials(self, sock: Any) -> PeerCred:
        """The peer's pid, uid and gid from ``SO_PEERCRED`` (tests override this)."""
        return read_peer_credentials(sock)

    # ----------------------------------------------------------------------------------------
    # Lifecycle

    @property
    def started(self) -> bool:
        return self._server is not None

    @property
    def socket_file(self) -> SocketFile:
        if self._socket is None or self._socket.path != self.socket_path:
            self._socket = SocketFile(
                self.socket_path, self.socket_mode, self.socket_dir_mode, self.socket_group
            )
        return self._socket

    async def start(self) -> None:
        """Discover devices, bind the socket and start serving."""
        if self._server is not None:
            return
        self._stopping = False
        self._stop_requested = asyncio.Event()
        if not await self._load_access():
            # A users config or key file that does not load: the operator must fix it (exit 2).
            raise SchedulerConfigError(self._access_error)
        self.policy = Policy(self.policy_config())
        if self.max_quantum < self.base_quantum:
            self.log.warning(
                "gpushare: max_quantum %.1f s is below base_quantum %.1f s: using %.1f s for both",
                self.max_quantum,
                self.base_quantum,
                self.base_quantum,
            )
        self.discovery = await find_devices(self.use_nvml, discover_devices_async)
        if (why := discovery_warning(self.discovery)) is not None:
            self.log.warning("gpushare: %s", why)
        for dev in self.discovery.devices:
            self._register_device(dev.uuid, dev.name, dev.total_bytes)
        self._accepting.clear()  # until the recovery window is armed (see the end)
        self._server, left_clients = await listen(self.socket_file, self._on_connection, self.log)
        await self._load_resume_key()
        await self.allocation_sockets.start(self._on_connection)  # before any pod reconnects
        self.log.info(
            "gpushare scheduler %s listening on %s (%d device(s), policy: quantum %.1fs)",
            __version__,
            self.socket_path,
            len(self._devices),
            self.base_quantum,
        )
        if self.metrics_port or self.metrics_in_process:
            try:
                await self._start_metrics()
            except BaseException:
                await self.stop()  # no half-started scheduler: the socket goes too
                raise
        if self.mps:
            await self._start_mps()
        await self._start_deep_idle()
        if left_clients and self.recovery_seconds > 0:
            self.policy.recover_until(time.monotonic() + self.recovery_seconds)
            self.log.info(
                "gpushare: the last scheduler on %s had clients; holding grants back for %.1f s "
                "while they reconnect",
                self.socket_path,
                self.recovery_seconds,
            )
            self._reschedule()
        self._forget_kept_after(self.recovery_seconds if left_clients else 0.0)
        self._accepting.set()
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
        # NVML's per-process memory checks the shims' claims (.nvml_check), where its pids are ours.
        check = await loop.run_in_executor(None, nvml_pids_comparable)
        if not check:
            self.log.warning(
                "gpushare: memory claims are not cross-checked with NVML: the scheduler runs in "
                "a pid namespace of its own, and NVML names processes by their host pids"
            )
        try:
            while not self._stopping:
                self._utilization = await loop.run_in_executor(None, sampler.sample, uuids)
                if check:
                    taken = time.monotonic()
                    processes = await loop.run_in_executor(None, sampler.processes, uuids)
                    if not self._stopping:
                        self._cross_check_memory(processes, taken)
                await asyncio.sleep(self.utilization_interval)
        finally:
            await loop.run_in_executor(None, sampler.close)

    async def stop(self) -> None:
        """Stop accepting, drop every connection, remove the socket file."""
        if self._server is None:
            return
        loop = asyncio.get_running_loop()
        self._stopping = True
        server, self._server = self._server, None
        server.close()
        await self.allocation_sockets.stop()
        self._cancel_timer()
        if self._history_timer is not None:
            self._history_timer.cancel()
            self._history_timer = None
        self._stop_deep_idle()
        await self._metrics_feed.stop()
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
            self._sampler = None
        shims = any(c.kind == "shim" and not c.left for c in self._connections.values())
        await self._keep_state_now()
        if shims and self.recovery_seconds > 0:
            # The shims keep running and will reconnect to the next scheduler on this socket:
            # tell it to take them back (a restart by the service manager, not only a crash).
            await loop.run_in_executor(None, self.socket_file.write_resume_marker)
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
        await loop.run_in_executor(None, self.socket_file.remove)
        self._connections.clear()
        self._shims.clear()
        self._accepting.set()  # messages that waited for a start that failed: their conns closed
        if self._stop_requested is not None:
            self._stop_requested.set()
        self.log.info("gpushare scheduler stopped")

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

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
        self._device_totals[key] = total
        self.log.info(
            "device %s (%s): total %s, pool %s",
            uuid,
            name or "?",
            format_size(total),
            format_size(pool),
        )
        return uuid

    #: Devices a uid may make the scheduler learn from its HELLOs (without NVML), and in all:
    #: each is kept forever and shown to everyone, so one user must not be able to add many.
    MAX_LEARNT_DEVICES_PER_UID = 16
    MAX_LEARNT_DEVICES = 64

    def _device_for_hello(self, hello: tr.Hello, uid: int) -> str | tr.Refusal:
        """The device a HELLO names: a known one, or one learnt from it when NVML knows none."""
        known = self._devices.get(hello.device_uuid.lower())
        if known is not None:
            return known
        uuid = hello.device_uuid
        if not uuid:
            if len(self._devices) == 1:
                return next(iter(self._devices.values()))
            uuid = "GPU-unknown"
        if self.discovery.devices:
            # NVML knows this node's GPUs: a HELLO does not add one (nor say its size).
            text = f"HELLO: device {uuid!r} is not one of this node's GPUs (NVML)"
            return tr.Refusal(ErrorCode.NOT_FOUND, text)
        mine = sum(1 for owner in self._learnt_devices.values() if owner == uid)
        if len(self._learnt_devices) >= self.MAX_LEARNT_DEVICES or (
            mine >= self.MAX_LEARNT_DEVICES_PER_UID and uid not in (0, self.own_uid)
        ):
            text = f"HELLO: too many devices learnt from shims; {uuid!r} is not added"
            return tr.Refusal(ErrorCode.BAD_REQUEST, text)
        if not hello.device_total:
            self._log_limit.warning(uid, "device %s: HELLO did not say its memory size", uuid)
        self._learnt_devices[uuid.lower()] = uid
        return self._register_device(uuid, hello.device_name, hello.device_total)

    @property
    def _placements(self) -> dict[str, tuple[str, int, float]]:
        """Placed kernels that have not connected yet (see :mod:`.reservations`)."""
        return self._reservations.held

    def _device_index(self, uuid: str) -> int | None:
        """NVML's index of a device (what nvidia-smi shows), None for one learnt from a shim."""
        for dev in self.discovery.devices:
            if dev.uuid.lower() == uuid.lower():
                return dev.index
        return None

    # ----------------------------------------------------------------------------------------
    # Users config, key, reload

    async def _load_access(self) -> bool:
        loop = asyncio.get_running_loop()
        read = AccessFiles.read
        try:
            files = await loop.run_in_executor(
                None, read, self.users_config, list(self.token_uids), self.user_key_file
            )
        except (UsersConfigError, KeyFileError) as exc:
            self._access_error = str(exc)
            return False
        except Exception as exc:  # a reload must always answer, whatever the file holds
            self.log.exception("gpushare: reading the access configuration failed")
            self._access_error = f"{type(exc).__name__}: {exc}"
            return False
        self.access.load(files)
        self.log.info(
            "access: users config %s (%d user(s), %d group(s); default %s), token uids %s",
            files.users.path or "none",
            len(files.users.users),
            len(files.users.groups),
            describe_limits(files.users.limits("", frozenset())),
            sorted(files.token_uids) or "none",
        )
        return True

    async def reload(self) -> bool:
        """Re-read the users config and the user key; apply new ceilings and weights to the
        clients already connected. A file that does not load is logged and changes nothing."""
        if not await self._load_access():
            self.log.error(
                "reload failed, keeping the previous configuration: %s", self._access_error
            )
            return False
        now = time.monotonic()
        for conn in list(self._shims.values()):
            ident = conn.identity
            if conn.closed or ident is None or conn.client_id is None:
                continue
            # Identities of connected clients keep their user; admin status and groups follow
            # the new file.
            ident = await self.access.identity(ident.user, conn.peer, ident.token)
            conn.identity = ident = confined(ident, conn)
            if conn.closed:
                continue
            weight = self.limits_for(ident).effective_weight(conn.requested_weight)
            self._decide(ev.SetWeight(now, conn.client_id, weight))
            quota = self.access.effective_quota(ident, conn.requested_quota, conn.quota_by_admin)
            quota = cap_quota(quota, conn.ceiling)
            if quota != conn.quota:
                self._set_quota(conn, quota, now)
        self.log.info("reloaded: %d client(s) re-checked", len(self._shims))
        return True

    def request_reload(self) -> None:
        """Reload from a signal handler on the loop (SIGHUP)."""
        self._spawn(self.reload())

    # ----------------------------------------------------------------------------------------
    # Metrics

    @property
    def metrics(self) -> Any:
        """The Prometheus metrics (a .metrics.SchedulerMetrics) while metrics_port serves them
        (or metrics_in_process keeps them for the host process)."""
        return self._metrics_feed.metrics

    def refresh_metrics(self) -> None:
        self._metrics_feed.refresh()

    async def _start_metrics(self) -> None:
        def snapshot(now: float) -> tuple[list[dict[str, Any]], int]:
            assert self.policy is not None
            return self.policy.snapshot(now), len(self._connections)

        try:
            await self._metrics_feed.start(
                self.metrics_address,
                self.metrics_port,
                self.metrics_interval,
                snapshot,
                self._shims.values,
                gpus=self.discovery.devices,
                utilization=lambda: self._utilization,
            )
        except OSError as exc:
            raise SchedulerStartError(
                f"cannot serve metrics on {self.metrics_address}:{self.metrics_port}: {exc}"
            ) from exc
        if self.metrics is not None and self.policy is not None:  # the node's host budget
            self.metrics.set_host_budget(self.policy.config.host_budget)

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
        conn.peer_log = self._log_limit.log_for(peer.uid)
        if self._over_connection_limit(peer.uid):
            self._log_limit.warning(
                peer.uid,
                "refused a connection of uid %d: it holds %d already (max_connections_per_uid)",
                peer.uid,
                self.max_connections_per_uid,
            )
            text = f"uid {peer.uid} has too many connections open to the scheduler"
            conn.error(ErrorCode.FORBIDDEN, text, self.log)
            writer.close()
            return
        conn.allocation, conn.ceiling = self.accepted_on(writer.get_extra_info("sockname"))
        self._connections[conn.serial] = conn
        self.log.debug("connection %d from pid %d uid %d", conn.serial, peer.pid, peer.uid)
        deadline = asyncio.get_running_loop().call_later(
            self.handshake_seconds, self._handshake_expired, conn
        )
        try:
            await serve_frames(
                conn, reader, self._dispatch, self._log_limit.log_for(peer.uid), self._pace
            )
        except asyncio.CancelledError:
            raise
        except Exception:
            self._log_limit.exception(peer.uid, "internal error on %s; closing it", conn.name)
        finally:
            deadline.cancel()
            self._shim_gone(conn, "connection closed")
            conn.closed = True
            self._connections.pop(conn.serial, None)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    def _over_connection_limit(self, uid: int) -> bool:
        """Is a new connection of ``uid`` one too many? On a uid many users share
        (token_uids) the limit is per user, once a message proved who (:meth:`identify`):
        there, a new connection is never refused; the oldest of the uid's connections that
        have not proved anyone yet is closed instead, so that no user of the uid can keep the
        others out with half-open connections."""
        limit = self.max_connections_per_uid
        if limit <= 0 or uid in (0, self.own_uid):
            return False
        if uid not in self.access.token_uids:
            return sum(1 for c in self._connections.values() if c.peer.uid == uid) >= limit
        unproven = [
            c for c in self._connections.values() if c.peer.uid == uid and c.identity is None
        ]
        if len(unproven) >= limit:
            oldest = min(unproven, key=lambda c: c.serial)
            self._log_limit.warning(
                uid,
                "closing %s: uid %d has %d connections that proved no user",
                oldest.name,
                uid,
                len(unproven),
            )
            oldest.closed = True
            if oldest.writer is not None:
                oldest.writer.transport.abort()
        return False

    def _over_identity_limit(self, uid: int, user: str) -> bool:
        """Does ``user`` of the shared ``uid`` hold max_connections_per_uid connections already?"""
        limit = self.max_connections_per_uid
        if limit <= 0 or uid not in self.access.token_uids:
            return False
        mine = sum(
            1
            for c in self._connections.values()
            if c.peer.uid == uid and c.identity is not None and c.identity.user == user
        )
        return mine >= limit

    def _handshake_expired(self, conn: Connection) -> None:
        """A connection that has not finished its first message in time is closed."""
        if conn.kind == "new" and not conn.closed and conn.writer is not None:
            self._log_limit.warning(
                conn.peer.uid,
                "closing %s: no whole message in %.0f s (handshake_seconds)",
                conn.name,
                self.handshake_seconds,
            )
            conn.closed = True
            conn.writer.transport.abort()

    async def _dispatch(self, conn: Connection, msg: Message) -> None:
        if not self._accepting.is_set():
            await self._accepting.wait()  # a restart's recovery window is not armed yet
            if conn.closed or self._stopping:
                return
        mtype = msg.type
        if mtype in CONTROL_MESSAGES:
            await self._on_control_message(conn, msg)
        elif mtype == MsgType.HELLO:
            if conn.kind != "new":
                text = f"HELLO on a {conn.kind} connection (one per client)"
                conn.error(ErrorCode.UNEXPECTED, text, self.log)
                return
            await self._on_hello(conn, msg)
        elif mtype not in SHIM_MESSAGES:
            text = f"message type {msg.type_name} is not accepted"
            conn.error(ErrorCode.UNEXPECTED, text, self.log)
        elif conn.kind != "shim" or conn.client_id is None:
            conn.error(ErrorCode.UNEXPECTED, f"{msg.type_name} before HELLO", self.log)
        elif conn.left:
            conn.error(ErrorCode.UNEXPECTED, f"{msg.type_name} after GOODBYE", self.log)
        else:
            self._on_shim_message(conn, conn.client_id, msg)

    # ----------------------------------------------------------------------------------------
    # Policy

    def _decide(self, event: ev.Event) -> list[ev.Decision]:
        """The policy's decisions on ``event``; then the status listeners hear of it."""
        assert self.policy is not None
        try:
            decisions = list(self.policy.handle(event))
        except Exception:
            self.log.exception("policy failed on %r", event)
            decisions = []
        self._notify_status()
        return decisions

    def _notify_status(self) -> None:
        for listener in list(self._status_listeners):
            try:
                listener()
            except Exception:  # a listener must never break the scheduler
                self.log.exception("gpushare: status change listener failed")

    def _handle(self, event: ev.Event) -> None:
        if self.policy is None:
            return
        self._deep_idle_event(event)  # a sleeper's REQUEST or busy starts its wake
        self._execute(self._decide(event))
        self._reschedule()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_deadline = None

    def _reschedule(self, after_tick: float | None = None) -> None:
        if self.policy is None or self._stopping:
            return
        self._deep_idle_pass()
        deadline = self.policy.next_deadline()
        if deadline is not None and deadline == self._timer_deadline and self._timer is not None:
            return
        self._cancel_timer()
        if deadline is None:
            return
        delay = max(0.0, deadline - time.monotonic())
        if after_tick is not None and deadline <= after_tick:
            # The policy asked again for a moment it was just told about: do not spin.
            delay = max(delay, 0.01)
        self._timer_deadline = deadline
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_deadline = None
        if self.policy is None or self._stopping:
            return
        now = time.monotonic()
        self._execute(self._decide(ev.Tick(now)))
        self._reschedule(after_tick=now)
