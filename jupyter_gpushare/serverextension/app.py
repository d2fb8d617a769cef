"""``GPUShareExtension``: the jupyter-server extension of jupyter-gpushare.

Enabled on install (``jupyter_server_config.d/jupyter_gpushare.json``). Configure it in
``jupyter_server_config.py``::

    c.GPUShareExtension.scheduler = "embedded"       # or "node", "auto", or a socket path
    c.GPUShareScheduler.pool_size = "24GiB"          # the embedded scheduler's own settings
    c.GPUShareExtension.admin_users = ["alice"]      # who may evict and set quotas (node mode)

What it does:

1. runs the GPU scheduler inside the server's event loop (``embedded``, the default) or connects
   to a node-wide one, and sets ``GPUSHARE_SOCKET`` in the server's environment so that the
   kernel provisioner starts kernels against it;
2. watches every kernel's iopub for busy/idle and tells the scheduler (:mod:`.kernel_watch`);
3. serves ``<base_url>gpushare/api/{status,events,kernels/<id>/...}`` (:mod:`.handlers`,
   docs/rest-api.yaml) and emits ``https://events.jupyter.org/jupyter_gpushare/status/v1``
   events (jupyter_events) when the scheduler's picture changes.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from jupyter_server.extension.application import ExtensionApp
from traitlets import Float, List, Unicode, Union, default, validate

from .._version import __version__
from ..adoption import adopt_kernels
from ..hub import SCHEDULER_ENV
from ..lab_runtime import remove_runtime_file, write_runtime_file
from ..paths import SYSTEM_SOCKET
from .backend import NotifyingScheduler, SchedulerBackend
from .cell_hint import install as install_cell_hint
from .handlers import default_handlers
from .kernel_watch import KernelWatcher
from .status import StatusBroadcaster, enrich

__all__ = ["STATUS_EVENT_SCHEMA", "GPUShareExtension"]

STATUS_EVENT_SCHEMA = "https://events.jupyter.org/jupyter_gpushare/status/v1"
_SCHEMA_PATH = Path(__file__).parent / "event_schemas" / "status" / "v1.yaml"
_MODES = ("embedded", "node", "auto")


def _check_scheduler(value: str) -> str:
    if value not in _MODES and not value.startswith("/"):
        raise ValueError(
            f"GPUShareExtension.scheduler (or ${SCHEDULER_ENV}): {value!r} is not one of "
            f"{', '.join(_MODES)} or an absolute socket path"
        )
    return value


class GPUShareExtension(ExtensionApp):
    """Share the GPU among this server's kernels (and, with a node scheduler, everyone's)."""

    name = "jupyter_gpushare"
    description = "jupyter-gpushare: many kernels share one GPU"
    version = __version__
    load_other_extensions = True

    scheduler = Unicode(
        "embedded",
        help="""Which scheduler the server's kernels use.

        'embedded': run one in this server's event loop, listening on `socket` (default: a socket
        in the server's runtime directory); it schedules this server's kernels only.
        'node': connect to a node-wide scheduler (`gpushare scheduler` run as a service) at
        `socket` (default: $GPUSHARE_SOCKET, else /run/gpushare/scheduler.sock).
        'auto': 'node' when a scheduler answers there, else 'embedded'.
        An absolute path: 'node' with that socket.
        Default: $GPUSHARE_SCHEDULER (what jupyter_gpushare.hub sets for a hub's servers), else
        'embedded'.""",
    ).tag(config=True)

    @default("scheduler")
    def _scheduler_default(self) -> str:
        # traitlets does not validate dynamic defaults: check the environment's value here.
        return _check_scheduler(os.environ.get(SCHEDULER_ENV) or "embedded")

    @validate("scheduler")
    def _validate_scheduler(self, proposal: Any) -> str:
        return _check_scheduler(str(proposal["value"]))

    socket = Unicode(
        "",
        help="""Socket path: where the embedded scheduler listens, or the node scheduler's socket
        (see `scheduler`). '' picks the default of the mode.""",
    ).tag(config=True)

    admin_users = Union(
        [List(Unicode()), Unicode()],
        default_value=None,
        allow_none=True,
        help="""Jupyter user names that are gpushare admins: they may evict kernels, set quotas,
        release any kernel, and see other users' notebook paths in the status. None (the default):
        every user of this server when the scheduler is embedded (it only schedules this
        server's kernels), nobody when it is node-wide. '*': every user of this server.""",
    ).tag(config=True)

    status_interval = Float(
        0.5,
        help="""Shortest time (seconds) between two status pushes on gpushare/api/events, and the
        polling period of a node scheduler's status while a websocket listens.""",
    ).tag(config=True)

    status_refresh = Float(
        5.0,
        help="""Time (seconds) after which counters that tick by themselves (gpu_seconds,
        wait_seconds) are pushed even when nothing else changed.""",
    ).tag(config=True)

    scheduler_timeout = Float(10.0, help="Timeout (seconds) of one request to the scheduler.").tag(
        config=True
    )

    # ----------------------------------------------------------------------------------------

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backend: SchedulerBackend = SchedulerBackend("embedded", "")
        self.watcher: KernelWatcher | None = None
        self.broadcaster = StatusBroadcaster(self.backend)  # replaced in initialize_settings
        self._started = False
        self._start_task: asyncio.Future[None] | None = None
        self._runtime_file: Path | None = None

    # -- setup -------------------------------------------------------------------------------

    def _node_socket(self) -> str:
        if self.socket:
            return self.socket
        if self.scheduler.startswith("/"):
            return self.scheduler
        return os.environ.get("GPUSHARE_SOCKET") or SYSTEM_SOCKET

    def _embedded_socket(self) -> str:
        if self.socket and self.scheduler == "embedded":
            return self.socket
        sched_cfg = (
            self.config.get("GPUShareScheduler") if "GPUShareScheduler" in self.config else None
        )
        if sched_cfg is not None and "socket_path" in sched_cfg and sched_cfg["socket_path"]:
            return str(sched_cfg["socket_path"])
        runtime = self.serverapp.runtime_dir if self.serverapp is not None else ""
        path = os.path.join(runtime, f"gpushare-{os.getpid()}.sock") if runtime else ""
        if not path or len(os.fsencode(path)) > 107:
            # Unix socket paths are limited to 107 bytes: use the per-user default directory.
            base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
            path = os.path.join(base, f"gpushare-{os.getuid()}", f"jupyter-{os.getpid()}.sock")
        return path

    def _make_scheduler(self, socket_path: str) -> NotifyingScheduler:
        # No recovery window: an embedded scheduler ends with its server, and so do the server's
        # kernels (docs/reliability.md), so there is never anyone to take back.
        return NotifyingScheduler(parent=self, socket_path=socket_path, recovery_seconds=0)

    def initialize_settings(self) -> None:
        mode = "node" if self.scheduler.startswith("/") else self.scheduler
        socket_path = self._embedded_socket() if mode == "embedded" else self._node_socket()
        self.backend = SchedulerBackend(
            mode,
            socket_path,
            make_scheduler=self._make_scheduler,
            fallback_socket=self._embedded_socket,
            log=self.log,
            timeout=self.scheduler_timeout,
        )
        if mode == "embedded":
            # Before any kernel starts: the provisioner reads it at launch (the scheduler itself
            # starts on the loop; shims retry until it listens).
            os.environ["GPUSHARE_SOCKET"] = socket_path
        self.broadcaster = StatusBroadcaster(
            self.backend,
            interval=self.status_interval,
            refresh=self.status_refresh,
            on_change=self._emit_status_event,
            log=self.log,
            local_kernels=self._local_kernel_ids,
        )
        event_logger = getattr(self.serverapp, "event_logger", None)
        if event_logger is not None:
            try:
                event_logger.register_event_schema(_SCHEMA_PATH)
            except Exception as exc:  # already registered (a second extension instance)
                self.log.debug("gpushare: event schema: %s", exc)
        self.log.info("gpushare: scheduler mode %s, socket %s", mode, socket_path)
        # Tests (and servers initialised inside a running loop) get started right away; a normal
        # server starts in _start_jupyter_server_extension once its loop runs.
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._start_task = asyncio.ensure_future(self.start_gpushare())

    def initialize_handlers(self) -> None:
        self.handlers.extend(default_handlers())

    async def _start_jupyter_server_extension(self, serverapp: Any) -> None:
        await self.start_gpushare()

    async def start_gpushare(self) -> None:
        """Start the scheduler (embedded) or find it (node), the kernel watcher and the
        broadcaster. Idempotent."""
        if self._started:
            return
        self._started = True
        await self.backend.ensure_started()
        assert self.serverapp is not None
        if self.backend.embedded:
            # So that `gpushare status` in another shell (or the lab's terminal) finds it.
            self._runtime_file = write_runtime_file(
                str(self.serverapp.runtime_dir),
                self.backend.socket_path,
                str(getattr(self.serverapp, "connection_url", "") or ""),
            )
        self.watcher = KernelWatcher(
            self.serverapp.kernel_manager,
            getattr(self.serverapp, "event_logger", None),
            self._send_kernel_state,
            log=self.log,
            on_kernels_changed=self.broadcaster.wake,
        )
        self.watcher.start()
        web_app = getattr(self.serverapp, "web_app", None)
        if web_app is not None:  # a cell queued behind another: its memory may come ahead
            install_cell_hint(web_app.settings, self.watcher.coming)
        self.broadcaster.start()
        await self._adopt_kernels()

    async def _adopt_kernels(self) -> None:
        """Take in the kernels that outlived an earlier server of this runtime directory
        (``GPUShareProvisioner.survive_server_restart``, :mod:`jupyter_gpushare.adoption`)."""
        assert self.serverapp is not None
        try:
            outcome = await adopt_kernels(
                self.serverapp.kernel_manager,
                str(getattr(self.serverapp, "runtime_dir", "") or ""),
                embedded=self.backend.embedded,
                scheduler_status=self.backend.status,
                log=self.log,
                session_manager=getattr(self.serverapp, "session_manager", None),
            )
        except Exception:  # never keep the server from starting
            self.log.exception("gpushare: adopting the kernels of a former server failed")
            return
        for kernel_id in outcome["adopted"]:
            if self.watcher is not None:
                self.watcher.watch(kernel_id)
        if any(outcome.values()):
            self.log.info(
                "gpushare: kernels of former servers: %s",
                ", ".join(f"{k} {len(v)}" for k, v in outcome.items()),
            )

    async def stop_extension(self) -> None:
        remove_runtime_file(self._runtime_file)
        self._runtime_file = None
        if self.watcher is not None:
            await self.watcher.stop()
        await self.broadcaster.stop()
        await self.backend.stop()

    # -- the pieces' glue --------------------------------------------------------------------

    async def _send_kernel_state(self, kernel_id: str, state: str) -> Any:
        return await self.backend.control("kernel_state", client=kernel_id, state=state)

    def _emit_status_event(self, doc: dict[str, Any] | None, error: str | None) -> None:
        event_logger = getattr(self.serverapp, "event_logger", None)
        if event_logger is None:
            return
        event_logger.emit(schema_id=STATUS_EVENT_SCHEMA, data=status_event(doc, error))

    # -- policy hooks (override in a subclass for other rules) --------------------------------

    def is_admin(self, user: Any) -> bool:
        """May ``user`` evict, set quotas, act on any kernel and see every notebook path?"""
        admins = self.admin_users
        if admins is None:
            return self.backend.embedded
        if admins == "*":
            return True
        name = getattr(user, "username", None)
        return name is not None and name in admins

    def _local_kernel_ids(self) -> list[str]:
        km = self.serverapp.kernel_manager if self.serverapp is not None else None
        return list(km.list_kernel_ids()) if km is not None else []

    def is_local_kernel(self, kernel_id: str) -> bool:
        """Is ``kernel_id`` a kernel of this server (so its user owns it)?"""
        assert self.serverapp is not None
        return kernel_id in self.serverapp.kernel_manager

    async def enrich(self, raw: dict[str, Any], user: Any) -> dict[str, Any]:
        assert self.serverapp is not None
        return await enrich(
            raw,
            kernel_manager=self.serverapp.kernel_manager,
            session_manager=getattr(self.serverapp, "session_manager", None),
            viewer=getattr(user, "username", None),
            admin=self.is_admin(user),
            backend=self.backend,
        )


def status_event(doc: dict[str, Any] | None, error: str | None) -> dict[str, Any]:
    """The payload of a status event: who holds and who waits, without labels or paths."""
    if doc is None:
        return {"available": False, "error": error or "unavailable", "devices": []}
    devices = []
    for dev in doc.get("devices", []):
        devices.append(
            {
                "uuid": str(dev.get("uuid", "")),
                "mode": str(dev.get("mode", "")),
                "holders": [str(h) for h in dev.get("holders", [])],
                "queue": [str(q) for q in dev.get("queue", [])],
                "clients": [
                    {
                        "id": str(c.get("id", "")),
                        "state": str(c.get("state", "")),
                        "user": str(c.get("user", "")),
                    }
                    for c in dev.get("clients", [])
                ],
            }
        )
    return {"available": True, "error": "", "devices": devices}
