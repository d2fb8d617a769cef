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
import os
import time
from collections.abc import Callable
from typing import Any

from traitlets import observe

from .._version import __version__
from ..identity import KeyFileError
from ..protocol import CONTROL_MESSAGES, SHIM_MESSAGES, ErrorCode, Message, MsgType, encode
from ..units import format_size, parse_size
from . import events as ev
from . import translate as tr
from .access import Access, AccessFiles
from .config import SchedulerConfig
from .devices import Discovery, UtilizationSampler, discover_devices_async
from .mps import MPSError, MPSManager, process_uid
from .placement import PlacementError, choose_device, device_loads
from .policy import Policy
from .transport import (
    Connection,
    PeerCred,
    SchedulerConfigError,
    SchedulerStartError,
    SocketFile,
    read_peer_credentials,
    serve_frames,
)
from .users import Identity, Limits, UsersConfig, UsersConfigError, describe_limits
from .views import filter_status

__all__ = [
    "Connection",
    "GPUShareScheduler",
    "PeerCred",
    "SchedulerConfigError",
    "SchedulerStartError",
]

#: The longest device UUID and name a HELLO may carry (kept here for callers of the old names).
MAX_DEVICE_UUID = tr.MAX_DEVICE_UUID
MAX_DEVICE_NAME = tr.MAX_DEVICE_NAME


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _bytes(n: int) -> str:
    return f"bytes={n} ({format_size(n)})"


class GPUShareScheduler(SchedulerConfig):
    """The node's GPU scheduler: one policy, one Unix socket, many shim clients."""

    #: At most this many kernels may be placed and not connected yet (oldest dropped first).
    MAX_PLACEMENTS = 4096

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
        self._devices: dict[str, str] = {}  # lower-case uuid -> uuid as registered
        self._serial = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_deadline: float | None = None
        self._stopping = False
        self._stop_requested: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._utilization: dict[str, int] = {}  # device uuid -> percent, from the sampler task
        self._sampler: asyncio.Future[None] | None = None
        # client id -> (device uuid, need in bytes, monotonic expiry): see place()
        self._placements: dict[str, tuple[str, int, float]] = {}
        self._status_listeners: list[Callable[[], None]] = []
        self.metrics: Any = None  # a .metrics.SchedulerMetrics when metrics_port is set
        self._metrics_task: asyncio.Future[None] | None = None
        self._mps: MPSManager | None = None

    # ----------------------------------------------------------------------------------------
    # The public surface besides start/stop: status listeners and the access rules

    def add_status_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (on the loop) after every event that reaches the policy: join,
        leave, request, release, memory, tick, control. A failing listener is logged."""
        self._status_listeners.append(listener)

    def remove_status_listener(self, listener: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._status_listeners.remove(listener)

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
        if isinstance(found, str) and peer.uid in self.access.token_uids:
            self.log.warning("forbidden: uid %d: %s", peer.uid, found)
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
            raise SchedulerStartError(self._access_error)
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
        left_clients = await self._listen()
        if self.metrics_port:
            try:
                await self._start_metrics()
            except BaseException:
                await self.stop()  # no half-started scheduler: the socket goes too
                raise
        if self.mps:
            await self._start_mps()
        if left_clients and self.recovery_seconds > 0:
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

    async def _listen(self) -> bool:
        """Bind and publish the socket; whether the last scheduler here left clients behind."""
        loop = asyncio.get_running_loop()
        sock_file = self.socket_file
        sock_file.check_length()
        path = sock_file.path
        try:
            left_clients = await loop.run_in_executor(None, sock_file.prepare_directory, self.log)
            sock, tmp = await loop.run_in_executor(None, sock_file.bind)
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
            await loop.run_in_executor(None, sock_file.publish, tmp)
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
        return left_clients

    async def stop(self) -> None:
        """Stop accepting, drop every connection, remove the socket file."""
        if self._server is None:
            return
        loop = asyncio.get_running_loop()
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
        if self._stop_requested is not None:
            self._stop_requested.set()
        self.log.info("gpushare scheduler stopped")

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
        self.log.info(
            "device %s (%s): total %s, pool %s",
            uuid,
            name or "?",
            format_size(total),
            format_size(pool),
        )
        return uuid

    def _device_for_hello(self, hello: tr.Hello) -> str:
        known = self._devices.get(hello.device_uuid.lower())
        if known is not None:
            return known
        uuid = hello.device_uuid
        if not uuid:
            if len(self._devices) == 1:
                return next(iter(self._devices.values()))
            uuid = "GPU-unknown"
        if not hello.device_total:
            self.log.warning("device %s: HELLO did not say its memory size", uuid)
        return self._register_device(uuid, hello.device_name, hello.device_total)

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
            conn.identity = ident = await self.access.identity(ident.user, conn.peer, ident.token)
            if conn.closed:
                continue
            weight = self.limits_for(ident).effective_weight(conn.requested_weight)
            self._decide(ev.SetWeight(now, conn.client_id, weight))
            quota = self.access.effective_quota(ident, conn.requested_quota, conn.quota_by_admin)
            if quota != conn.quota:
                self._set_quota(conn, quota, now)
        self.log.info("reloaded: %d client(s) re-checked", len(self._shims))
        return True

    def request_reload(self) -> None:
        """Reload from a signal handler on the loop (SIGHUP)."""
        self._spawn(self.reload())

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
        for conn in self._shims.values():
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
        try:
            await serve_frames(conn, reader, self._dispatch, self.log)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.log.exception("internal error on %s; closing it", conn.name)
        finally:
            self._shim_gone(conn, "connection closed")
            conn.closed = True
            self._connections.pop(conn.serial, None)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    def _shim_gone(self, conn: Connection, why: str) -> None:
        """The shim's connection is done: Leave at once (its grant and memory go)."""
        if conn.kind != "shim" or conn.left or conn.client_id is None:
            return
        conn.left = True
        now = time.monotonic()
        self._account_gpu_time(conn, now)
        if self._shims.get(conn.client_id) is conn:
            del self._shims[conn.client_id]
        if self._stopping:
            return
        held = None if conn.granted_at is None else now - conn.granted_at
        self.log.info(
            "leave client=%s (%s) %s held_ms=%s",
            conn.client_id,
            why,
            _bytes(conn.memory["used"]),
            _ms(held),
        )
        self._handle(ev.Leave(now, conn.client_id))

    def _send(self, conn: Connection, msg: Message) -> bool:
        return conn.send(msg, self.log)

    def _refuse(self, conn: Connection, refusal: tr.Refusal) -> None:
        conn.error(refusal.code, refusal.text, self.log)

    def _reply(self, conn: Connection, body: dict[str, Any]) -> None:
        self._send(conn, Message(MsgType.CONTROL_REPLY, {"body": body}))

    async def _dispatch(self, conn: Connection, msg: Message) -> None:
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
    # Shim messages

    def _assign_client_id(self, requested: str, conn: Connection) -> str:
        existing = self._shims.get(requested)
        if existing is None:
            return requested
        if existing.peer.pid > 0 and existing.peer == conn.peer:
            self.log.info("client %s reconnected: the old connection leaves", requested)
            self._shim_gone(existing, "replaced by a reconnection")
            if existing.writer is not None:
                existing.writer.close()
            return requested
        client_id = tr.free_client_id(requested, conn.peer.pid, self._shims)
        self.log.info(
            "client id %s is taken by %s: the new client (pid %d) is %s",
            requested,
            existing.name,
            conn.peer.pid,
            client_id,
        )
        return client_id

    async def _on_hello(self, conn: Connection, msg: Message) -> None:
        assert self.policy is not None
        hello = tr.check_hello(msg, conn.peer.pid)
        if isinstance(hello, tr.Refusal):
            self._refuse(conn, hello)
            return
        ident = await self.identify(conn.peer, msg)
        if conn.closed or self._stopping:
            return
        if isinstance(ident, str):
            self.log.warning("refused HELLO of %s: %s", conn.name, ident)
            conn.error(ErrorCode.FORBIDDEN, ident, self.log)
            conn.closed = True  # the reader loop ends and closes the socket after the ERROR
            return
        conn.identity = ident
        client_id = self._assign_client_id(hello.requested_id, conn)
        device = self._device_for_hello(hello)
        conn.kind, conn.client_id, conn.device = "shim", client_id, device
        self._shims[client_id] = conn
        limits = self.limits_for(ident)
        conn.requested_quota, conn.requested_weight = hello.quota, hello.weight
        quota = conn.quota = limits.effective_quota(hello.quota)
        if quota != hello.quota:
            self.log.info(
                "quota of client=%s user=%s clamped to its ceiling %s (asked %s)",
                client_id,
                ident.user,
                format_size(quota),
                format_size(hello.quota) if hello.quota else "none",
            )
        weight = round(limits.effective_weight(hello.weight) * 1000) / 1000.0
        conn.memory.update(hello.memory)
        join = hello.join(
            time.monotonic(), client_id, device, ident.user, conn.peer.uid, weight, quota
        )
        self.log.info(
            "join client=%s device=%s user=%s uid=%d pid=%d quota=%s weight=%.3g label=%r shim=%s",
            client_id,
            device,
            ident.user,
            conn.peer.uid,
            hello.pid,
            format_size(quota) if quota else "none",
            weight,
            hello.label,
            hello.version,
        )
        if hello.resume:
            self.log.info("resume client=%s %s", client_id, hello.resume)
        rest: list[ev.Decision] = []
        resumed = 0
        for decision in self._decide(join):
            if isinstance(decision, ev.Grant) and decision.client == client_id:
                # A resumed grant: the WELCOME says so (resume = 1); no GRANT follows.
                resumed = 1
                conn.granted_at = time.monotonic()
                self.log.info("grant client=%s resumed", client_id)
            else:
                rest.append(decision)
        dev = self._device_snapshot(device)
        base_ms = int(self.base_quantum * 1000)
        quantum_ms = int(dev.get("quantum_ms", base_ms)) if dev else 0
        welcome = {
            "pool_bytes": int(dev.get("pool_bytes", 0)) if dev else 0,
            "quota": quota,
            "quantum_ms": quantum_ms or base_ms,
            "version": __version__,
        }
        if "resume" in hello.resume:
            welcome["resume"] = resumed
        self._send(conn, Message(MsgType.WELCOME, welcome))
        self._execute(rest)
        self._reschedule()

    def _on_shim_message(self, conn: Connection, client_id: str, msg: Message) -> None:
        now = time.monotonic()
        event = tr.shim_event(msg, client_id, now, conn.memory)
        if isinstance(event, ev.Leave):
            self.log.debug("goodbye client=%s", client_id)
            self._shim_gone(conn, "goodbye")
            return
        conn.memory.update(tr.memory_after(conn.memory, msg))
        if isinstance(event, ev.Request):
            if conn.requested_at is None:
                conn.requested_at = now
            self.log.debug("request client=%s %s", client_id, _bytes(event.used))
        elif isinstance(event, ev.Released):
            moved, ms = event.bytes_moved, event.micros / 1000.0
            held = None if conn.granted_at is None else now - conn.granted_at
            self.log.info(
                "release client=%s evicted=%d %s ms=%.1f held_ms=%s",
                client_id,
                int(event.evicted),
                _bytes(moved),
                ms,
                _ms(held),
            )
            if event.evicted:
                self.log.info(
                    "evicted client=%s %s ms=%.1f (on release)", client_id, _bytes(moved), ms
                )
            self._account_gpu_time(conn, now)
            if self.metrics is not None:
                self.metrics.released(
                    conn.device or "", conn.revoking, moved if event.evicted else 0
                )
            conn.granted_at = conn.accounted_at = conn.revoked_at = None
            conn.revoking = False
        elif isinstance(event, ev.Idle):
            self.log.debug("idle client=%s idle_ms=%s", client_id, msg.get("idle_ms", 0))
        elif isinstance(event, ev.Evicted):
            self.log.info(
                "evicted client=%s %s ms=%.1f",
                client_id,
                _bytes(event.bytes_moved),
                event.micros / 1000.0,
            )
            if self.metrics is not None:
                self.metrics.moved(conn.device or "", "evict", event.bytes_moved)
        elif isinstance(event, ev.Restored):
            conn.memory["evicted"] = 0
            self.log.info(
                "restored client=%s %s ms=%.1f",
                client_id,
                _bytes(event.bytes_moved),
                event.micros / 1000.0,
            )
            if self.metrics is not None:
                self.metrics.moved(conn.device or "", "restore", event.bytes_moved)
        self._handle(event)

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
        for listener in list(self._status_listeners):
            try:
                listener()
            except Exception:  # a listener must never break the scheduler
                self.log.exception("gpushare: status change listener failed")
        return decisions

    def _handle(self, event: ev.Event) -> None:
        if self.policy is None:
            return
        self._execute(self._decide(event))
        self._reschedule()

    def _set_quota(self, conn: Connection, quota: int, now: float) -> None:
        """Tell the shim and the policy a client's effective quota."""
        if conn.client_id is None:
            return
        conn.quota = quota
        self.log.info(
            "quota client=%s quota=%s", conn.client_id, format_size(quota) if quota else "none"
        )
        self._send(conn, Message(MsgType.SET_QUOTA, {"quota": quota}))
        self._handle(ev.SetQuota(now, conn.client_id, quota))

    def _execute(self, decisions: list[ev.Decision]) -> None:
        now = time.monotonic()
        for decision in decisions:
            conn = self._shims.get(decision.client)
            if conn is None or conn.closed:
                self.log.debug("decision %r for a client that is gone", decision)
                continue
            mem = conn.memory
            if isinstance(decision, ev.Grant):
                waited = None if conn.requested_at is None else now - conn.requested_at
                moving = mem["evicted"] if decision.restore else mem["used"]
                self.log.info(
                    "grant client=%s restore=%d %s waited_ms=%s",
                    decision.client,
                    int(decision.restore),
                    _bytes(moving),
                    _ms(waited),
                )
                conn.requested_at = None
                conn.granted_at = conn.accounted_at = now
                if self.metrics is not None:
                    self.metrics.granted(conn.device or "", waited)
                self._send(conn, Message(MsgType.GRANT, {"flag": int(decision.restore)}))
            elif isinstance(decision, ev.Revoke):
                held = None if conn.granted_at is None else now - conn.granted_at
                self.log.info(
                    "revoke client=%s evict=%d %s held_ms=%s reason=%r",
                    decision.client,
                    int(decision.evict),
                    _bytes(mem["managed"] if decision.evict else mem["used"]),
                    _ms(held),
                    decision.reason,
                )
                conn.revoking = True
                fields = {"flag": int(decision.evict), "reason": decision.reason}
                self._send(conn, Message(MsgType.REVOKE, fields))
                self._watch_revoke(conn, now)
            elif isinstance(decision, ev.Evict):
                self.log.info(
                    "evict client=%s %s reason=%r",
                    decision.client,
                    _bytes(mem["managed"]),
                    decision.reason,
                )
                self._send(conn, Message(MsgType.EVICT, {"reason": decision.reason}))
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
                conn.client_id,
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

    async def _on_control_message(self, conn: Connection, msg: Message) -> None:
        if conn.kind == "new":
            conn.kind = "control"
        if conn.kind == "control":
            # Each control message is identified on its own (it may carry user and token); a
            # shim asking on its own connection is who its HELLO proved.
            ident = await self.identify(conn.peer, msg)
            if conn.closed:
                return
            if isinstance(ident, str):
                conn.error(ErrorCode.FORBIDDEN, ident, self.log)
                return
            conn.identity = ident
        ident = conn.identity
        if ident is None:  # pragma: no cover - a shim has its HELLO's identity
            conn.error(ErrorCode.FORBIDDEN, "unidentified peer", self.log)
            return
        action = tr.control_action(msg)
        body = msg.get("body")
        if isinstance(action, tr.Refusal):
            self._refuse(conn, action)
        elif action == "status":
            self._on_status_request(conn, msg, ident)
        elif action in tr.MPS_ACTIONS:
            await self._on_mps_control(conn, action, body)
        elif action == "reload":
            self._on_reload_request(conn, ident)
        elif action == "place":
            self._on_place(conn, body)
        else:
            self._on_client_action(conn, ident, action, body)

    def _on_status_request(self, conn: Connection, msg: Message, viewer: Identity) -> None:
        device = tr.check_status_request(msg)
        if isinstance(device, tr.Refusal):
            self._refuse(conn, device)
            return
        doc = self.status_document(device, viewer)
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
        conn.write_frame(frame, self.log)

    def _on_client_action(
        self, conn: Connection, who: Identity, action: str, body: dict[str, Any]
    ) -> None:
        request = tr.check_client_action(action, body)
        if isinstance(request, tr.Refusal):
            self._refuse(conn, request)
            return
        client_id = request.client_id
        target = self._shims.get(client_id)
        if target is None or self.policy is None or not self.policy.has_client(client_id):
            conn.error(ErrorCode.NOT_FOUND, f"no client {client_id!r}", self.log)
            return
        if not self.access.may_act(who, target.identity):
            owner = target.identity.user if target.identity is not None else "?"
            self.log.warning(
                "forbidden: %s asked %s on %s (user %s)", who.describe(), action, client_id, owner
            )
            text = (
                f"{who.user} may not {action} client {client_id!r}: it belongs to another user "
                "(only its owner or an admin may)"
            )
            conn.error(ErrorCode.FORBIDDEN, text, self.log)
            return
        log = self.log.debug if action == "kernel_state" else self.log.info
        log("control %s client=%s by %s %s", action, client_id, who.describe(), body)
        now = time.monotonic()
        if action == "set_quota":
            refusal = self.access.quota_refusal(who, target.identity, request.quota)
            if refusal:
                self.log.warning("forbidden: %s: %s", who.describe(), refusal)
                conn.error(ErrorCode.FORBIDDEN, refusal, self.log)
                return
            target.requested_quota = request.quota
            target.quota_by_admin = who.admin
            self._set_quota(target, request.quota, now)
        else:
            self._handle(request.event(now))
        self._reply(conn, request.reply())

    def _on_reload_request(self, conn: Connection, who: Identity) -> None:
        if not who.admin:
            conn.error(ErrorCode.FORBIDDEN, f"{who.user} may not reload: admins only", self.log)
            return
        self.log.info("reload asked by %s", who.describe())

        async def run() -> None:
            if await self.reload():
                self._reply(conn, {"ok": True, "action": "reload"})
            else:
                text = (
                    "reload failed: the configuration did not load (see the scheduler's log); "
                    "the previous one is still in force"
                )
                conn.error(ErrorCode.BAD_REQUEST, text, self.log)

        self._spawn(run())

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

    async def _on_mps_control(self, conn: Connection, action: str, body: dict[str, Any]) -> None:
        """The ``mps_env`` and ``mps_terminate`` control actions (docs/protocol.md)."""
        reply: dict[str, Any] = {"ok": True, "action": action, "enabled": self._mps is not None}
        if action == "mps_env":
            refusal = self._mps_env(body, reply)
        else:
            refusal = await self._mps_terminate(conn, body, reply)
        if refusal is not None:
            self._refuse(conn, refusal)
        else:
            self._reply(conn, reply)

    def _mps_env(self, body: dict[str, Any], reply: dict[str, Any]) -> tr.Refusal | None:
        request = tr.check_mps_env(body)
        if isinstance(request, tr.Refusal) or self._mps is None:
            return request if isinstance(request, tr.Refusal) else None
        device = request.device or self._least_loaded_mps_device()
        try:
            env = self._mps.client_env(
                device,
                weight=request.weight,
                compute_share=request.compute_share,
                quota_bytes=request.quota,
            )
        except MPSError as exc:
            return tr.Refusal(ErrorCode.NOT_FOUND, f"mps_env: {exc}")
        reply.update(env)
        self.log.info(
            "mps_env client=%s device=%s env=%s", request.client_id, reply["device"], reply["env"]
        )
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
    ) -> tr.Refusal | None:
        request = tr.check_mps_terminate(body)
        if isinstance(request, tr.Refusal):
            return request
        pid, tree = request
        reply["pid"] = pid
        reply["terminated"] = []
        if self._mps is None:
            return None
        owner = await asyncio.get_running_loop().run_in_executor(None, process_uid, pid)
        if owner is None:
            return tr.Refusal(ErrorCode.NOT_FOUND, f"mps_terminate: no process {pid}")
        kernel_users = [
            c.identity.user for c in self._shims.values() if c.peer.pid == pid and c.identity
        ]
        if not self.access.may_terminate(conn.identity, conn.peer.uid, owner, kernel_users):
            self.log.warning(
                "forbidden: uid %d asked mps_terminate of pid %d (uid %d)",
                conn.peer.uid,
                pid,
                owner,
            )
            text = f"mps_terminate: uid {conn.peer.uid} may not terminate pid {pid}"
            return tr.Refusal(ErrorCode.FORBIDDEN, text)
        reply["terminated"] = await self._mps.terminate_process(pid, tree=tree)
        reply["ok"] = all(r["ok"] for r in reply["terminated"])
        return None

    # ----------------------------------------------------------------------------------------
    # Placement (several GPUs): see placement.py for the rule

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
        """CONTROL ``place`` (docs/protocol.md) -> the chosen device's uuid and index."""
        request = tr.check_place(body)
        if isinstance(request, tr.Refusal):
            self._refuse(conn, request)
            return
        try:
            answer = self.place(request.client_id, request.need, request.device, request.reachable)
        except PlacementError as exc:
            # No device at all (no NVML, nothing connected yet): not_found, the caller goes on
            # without placement. A pin naming no device: bad_request, the caller's mistake.
            code = ErrorCode.BAD_REQUEST if self._devices else ErrorCode.NOT_FOUND
            conn.error(code, f"place: {exc}", self.log)
            return
        self.log.info(
            "place client=%s device=%s index=%s need=%s fits=%s reason=%r by uid %d",
            request.client_id,
            answer["device"],
            answer["index"],
            format_size(answer["need"]),
            answer["fits"],
            answer["reason"],
            conn.peer.uid,
        )
        self._reply(conn, {"ok": True, "action": "place", "client": request.client_id, **answer})
