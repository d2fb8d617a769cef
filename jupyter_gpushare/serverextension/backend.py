"""The server extension's handle on the scheduler: embedded in the server's loop, or node-wide.

* **embedded**: a :class:`~jupyter_gpushare.scheduler.shell.server.GPUShareScheduler` runs in
  the Jupyter server's own event loop, listening on a socket in the server's runtime directory.
  Status is read from it directly (no socket round trip, no frame size limit) and it tells the
  extension when its state changes, so pushes need no polling.
* **node**: a scheduler that someone else runs (``gpushare scheduler`` as a system service, shared
  by every user's server); the extension is one of its control peers and polls its status only
  while a sidebar listens.

Control actions (``kernel_state``, ``release``, ``evict``, ``set_quota``) always go through the
socket, so the scheduler authorises them from the server process's identity in both modes: its
kernel-verified uid, or, for a uid that many users share (JupyterHub, Kubernetes), the hub user
that ``GPUSHARE_USER`` and ``GPUSHARE_USER_TOKEN`` prove (:mod:`jupyter_gpushare.hub`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable
from typing import Any

from traitlets import default

from ..hub import server_user
from ..protocol import ErrorCode
from ..scheduler.features.checkpoint_agent import keep_agent
from ..scheduler.features.sleeping import EVICT_REPLY_SECONDS
from ..scheduler.shell.server import GPUShareScheduler
from ..scheduler_client import SchedulerClient, SchedulerError, SchedulerUnavailable

__all__ = [
    "NotifyingScheduler",
    "SchedulerBackend",
    "SchedulerError",
    "SchedulerUnavailable",
    "probe_socket",
]


class NotifyingScheduler(GPUShareScheduler):
    """The embedded scheduler: a :class:`GPUShareScheduler` that calls ``on_change`` whenever an
    event reaches its policy (join, leave, request, release, memory, tick, control), through the
    scheduler's public status listener hook."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.on_change: Callable[[], None] | None = None
        self.add_status_listener(self._notify)

    @default("metrics_in_process")
    def _metrics_in_process_default(self) -> bool:
        return True  # the Jupyter server's own /metrics serves them (SchedulerBackend)

    def _notify(self) -> None:
        if self.on_change is not None:
            self.on_change()


def probe_socket(path: str, timeout: float = 1.0) -> bool:
    """Does a scheduler accept connections on ``path``? (Blocking: run it in an executor.)"""
    if not path or len(os.fsencode(path)) > 107:
        return False
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
        return True
    except OSError:
        return False
    finally:
        sock.close()


class SchedulerBackend:
    """Where the scheduler is and how to talk to it; starts and stops an embedded one."""

    def __init__(
        self,
        mode: str,
        socket_path: str,
        *,
        make_scheduler: Callable[[str], NotifyingScheduler] | None = None,
        fallback_socket: Callable[[], str] | None = None,
        log: Any = None,
        timeout: float = 10.0,
    ) -> None:
        #: "embedded", "node" or "auto" as configured; ``mode`` is what it resolved to.
        self.requested = mode
        self.mode = mode
        self.socket_path = socket_path
        self._make_scheduler = make_scheduler
        self._collector: Any = None  # the embedded scheduler's metrics on prometheus' REGISTRY
        self._fallback_socket = fallback_socket
        self.log = log
        self.timeout = timeout
        self.scheduler: NotifyingScheduler | None = None
        #: Why the scheduler is not usable (start failure), or None.
        self.error: str | None = None
        self._listeners: list[Callable[[], None]] = []
        self._start_task: asyncio.Task[None] | None = None
        self._agent_task: asyncio.Task[None] | None = None  # deep idle's checkpoint agent
        self._started = False

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def embedded(self) -> bool:
        return self.mode == "embedded"

    @property
    def client(self) -> SchedulerClient:
        # The server speaks for its hub user (token from $GPUSHARE_USER_TOKEN, see hub.py).
        return SchedulerClient(self.socket_path, timeout=self.timeout, user=server_user() or "")

    async def ensure_started(self) -> None:
        """Start (once; concurrent callers wait for the same start). Never raises: a failure is
        kept in :attr:`error` and reported by every request."""
        if self._started:
            return
        if self._start_task is None:
            self._start_task = asyncio.ensure_future(self._start())
        await asyncio.shield(self._start_task)

    async def _start(self) -> None:
        try:
            if self.mode not in ("auto", "embedded", "node"):
                # A value that failed validation when jupyter_server linked the extension: it
                # logs that and loads the extension anyway. Run nothing; every request says why.
                raise ValueError(
                    f"invalid configuration: GPUShareExtension.scheduler = {self.mode!r} is not "
                    "one of embedded, node, auto or an absolute socket path"
                )
            if self.mode == "auto":
                loop = asyncio.get_running_loop()
                node = self.socket_path
                if await loop.run_in_executor(None, probe_socket, node):
                    self.mode = "node"
                else:
                    self.mode = "embedded"
                    if self._fallback_socket is not None:
                        self.socket_path = self._fallback_socket()
                    self._log("info", "gpushare: no node scheduler answers on %s", node)
            if self.mode == "embedded":
                await self._start_embedded()
            else:
                self._log("info", "gpushare: using the node scheduler at %s", self.socket_path)
                # The node scheduler may not checkpoint this user's kernels (deep idle, a forced
                # evict): this server, their parent and of their uid, makes the driver's calls.
                self._agent_task = asyncio.ensure_future(keep_agent(self.socket_path))
            if not self.error:
                os.environ["GPUSHARE_SOCKET"] = self.socket_path
        except Exception as exc:  # never let the server fail because of the GPU scheduler
            self.error = f"{exc.__class__.__name__}: {exc}"
            self._log("error", "gpushare: the scheduler did not start: %s", self.error)
        finally:
            self._started = True

    async def _start_embedded(self) -> None:
        assert self._make_scheduler is not None
        scheduler = self._make_scheduler(self.socket_path)
        scheduler.on_change = self._changed
        try:
            await scheduler.start()
        except Exception as exc:
            self.error = f"the embedded scheduler did not start on {self.socket_path}: {exc}"
            self._log("error", "gpushare: %s", self.error)
            return
        self.scheduler = scheduler
        self._expose_metrics(scheduler)
        self._log(
            "info",
            "gpushare: embedded scheduler on %s (NVML: %s)",
            self.socket_path,
            "yes" if scheduler.discovery.error is None else scheduler.discovery.error,
        )

    async def stop(self) -> None:
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()
            with contextlib.suppress(BaseException):
                await self._start_task
        if self._agent_task is not None:
            self._agent_task.cancel()
            self._agent_task = None
        scheduler, self.scheduler = self.scheduler, None
        self._hide_metrics()
        if scheduler is not None:
            scheduler.on_change = None
            await scheduler.stop()
            if os.environ.get("GPUSHARE_SOCKET") == self.socket_path:
                del os.environ["GPUSHARE_SOCKET"]
        self._listeners.clear()

    # -- metrics on the Jupyter server's /metrics ---------------------------------------------

    def _expose_metrics(self, scheduler: NotifyingScheduler) -> None:
        """jupyter_server serves prometheus_client's global registry on /metrics: the embedded
        scheduler's metrics join it through a collector, for as long as the scheduler runs."""
        if scheduler.metrics is None:
            return
        from prometheus_client import REGISTRY

        from ..scheduler.shell.metrics import DelegatingCollector

        self._collector = DelegatingCollector(scheduler.metrics.registry)
        REGISTRY.register(self._collector)

    def _hide_metrics(self) -> None:
        collector, self._collector = self._collector, None
        if collector is not None:
            from prometheus_client import REGISTRY

            with contextlib.suppress(KeyError):
                REGISTRY.unregister(collector)

    # -- change notification ------------------------------------------------------------------

    @property
    def notifies(self) -> bool:
        """True when status changes are announced (embedded), False when they must be polled."""
        return self.scheduler is not None

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def _changed(self) -> None:
        for listener in list(self._listeners):
            listener()

    # -- requests ----------------------------------------------------------------------------

    def _check(self) -> None:
        if self.error:
            raise SchedulerUnavailable(self.socket_path, self.error)
        if self.embedded and self.scheduler is None:
            raise SchedulerUnavailable(self.socket_path, "the embedded scheduler is not running")

    async def status(self) -> dict[str, Any]:
        """The scheduler's status document (docs/protocol.md), unchanged."""
        await self.ensure_started()
        self._check()
        if self.scheduler is not None:
            return self.scheduler.status_document()
        return await self.client.status()

    async def history(self) -> dict[str, Any]:
        """The scheduler's last hour per kernel, user and GPU (its ``history`` action)."""
        await self.ensure_started()
        self._check()
        if self.scheduler is not None:
            return self.scheduler.history_view()
        reply = await self.client.control("history")
        return dict(reply.get("history") or {})

    async def control(self, action: str, **kwargs: Any) -> dict[str, Any]:
        await self.ensure_started()
        self._check()
        client = self.client
        if action == "evict":  # answered after the holder's checkpoint (sleeping.py)
            client.timeout = max(client.timeout, EVICT_REPLY_SECONDS)
        return await client.control(action, **kwargs)

    def describe(self) -> dict[str, Any]:
        """What the status document's ``scheduler`` field says about the connection."""
        return {
            "mode": self.mode,
            "requested": self.requested,
            "socket": self.socket_path,
            "error": self.error,
        }

    def _log(self, level: str, msg: str, *args: Any) -> None:
        if self.log is not None:
            getattr(self.log, level)(msg, *args)


def is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, SchedulerError) and exc.code == int(ErrorCode.NOT_FOUND)
