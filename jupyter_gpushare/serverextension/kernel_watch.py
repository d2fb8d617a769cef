"""Busy/idle of every kernel the server runs, from its iopub ``status`` messages, told to the
scheduler as it happens.

Jupyter knows exactly when a cell starts and ends: the kernel publishes ``status: busy`` and
``status: idle`` on iopub around every request, with the request as the parent. For each kernel the
:class:`KernelWatcher` opens its own iopub subscription (a ``ZMQStream`` on the server's loop,
exactly as the server's activity tracking does; no polling) and sends ``CONTROL kernel_state``
``{"client": kernel_id, "state": "busy" | "idle"}`` on every transition. The scheduler gives a busy
kernel priority and revokes an idle holder's grant at once when someone waits.

What counts as busy: a kernel is busy while at least one request that runs user code is between
its ``busy`` and its ``idle`` (tracked per parent ``msg_id``, so a control-channel request that
starts and ends during a long cell, or concurrent subshells, never produce a false ``idle``).
Requests that run no user code (``kernel_info_request``, ``complete_request``, ... the server's
``untracked_message_types`` plus a few more) are ignored: their busy/idle blips would only cost
messages.

Kernel lifecycle comes from the server's own ``kernel_actions`` events (jupyter_events): ``start``
opens a watch, ``restart`` reopens it with a clean slate (the kernel process is new), ``shutdown``
closes it; a kernel that dies for good (the restarter's ``dead`` callback) is unwatched too.
Kernels that already run when the watcher starts are watched at once.

Transitions are sent in order by one sender task. The scheduler answers ``not_found`` for kernels
that never touched the GPU (the shim connects at the first CUDA call): those are ignored quietly.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.session import Session
from zmq.eventloop.zmqstream import ZMQStream

from ..protocol import ErrorCode
from ..scheduler_client import SchedulerError, SchedulerUnavailable

__all__ = ["KERNEL_ACTIONS_SCHEMA", "KernelWatcher", "Transition"]

KERNEL_ACTIONS_SCHEMA = "https://events.jupyter.org/jupyter_server/kernel_actions/v1"

#: Parents whose busy/idle does not run user code (besides the kernel manager's own
#: ``untracked_message_types``).
IGNORED_PARENTS = frozenset(
    {
        "kernel_info_request",
        "comm_info_request",
        "complete_request",
        "inspect_request",
        "is_complete_request",
        "history_request",
        "shutdown_request",
        "interrupt_request",
        "debug_request",
        "usage_request",
        "create_subshell_request",
        "delete_subshell_request",
        "list_subshell_request",
    }
)

#: A request whose ``idle`` was lost (iopub drops messages past its high-water mark) must not keep
#: a kernel busy forever: past this many open requests the oldest are forgotten.
MAX_OPEN_REQUESTS = 64

SendState = Callable[[str, str], Awaitable[Any]]


@dataclass
class Transition:
    """One busy/idle transition, as sent (kept for diagnostics and tests)."""

    kernel_id: str
    state: str
    at: float  # time.time() when the status message arrived
    outcome: str = "pending"  # "ok", "not_found", "unavailable", "error: ..."


@dataclass
class _Watch:
    kernel_id: str
    stream: ZMQStream
    session: Session
    manager: Any
    open_requests: collections.OrderedDict[str, None] = field(
        default_factory=collections.OrderedDict
    )
    state: str = "idle"
    heard_busy: bool = False  # any busy status seen since the subscription opened
    on_dead: Callable[[], None] | None = None


class KernelWatcher:
    """Watches the iopub of every kernel of a ``MappingKernelManager``."""

    def __init__(
        self,
        kernel_manager: Any,
        event_logger: Any,
        send_state: SendState,
        *,
        log: Any,
        history: int = 256,
        on_kernels_changed: Callable[[], None] | None = None,
    ) -> None:
        self.kernel_manager = kernel_manager
        self.event_logger = event_logger
        self.send_state = send_state
        #: Called when a kernel starts, restarts, shuts down or dies (the status push listens).
        self.on_kernels_changed = on_kernels_changed
        self.log = log
        self.watches: dict[str, _Watch] = {}
        self.transitions: collections.deque[Transition] = collections.deque(maxlen=history)
        self._queue: asyncio.Queue[Transition | None] | None = None
        self._sender: asyncio.Task[None] | None = None
        self._running = False
        self._warned_unavailable = False
        untracked = getattr(kernel_manager, "untracked_message_types", None) or []
        self.ignored_parents = IGNORED_PARENTS | {str(t) for t in untracked}

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Subscribe to kernel lifecycle events and watch the kernels that already run."""
        if self._running:
            return
        self._running = True
        if self.event_logger is not None:
            self.event_logger.add_listener(
                schema_id=KERNEL_ACTIONS_SCHEMA, listener=self._on_kernel_action
            )
        for kernel_id in list(self.kernel_manager.list_kernel_ids()):
            self.watch(kernel_id)

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        if self.event_logger is not None:
            with contextlib.suppress(Exception):
                self.event_logger.remove_listener(
                    schema_id=KERNEL_ACTIONS_SCHEMA, listener=self._on_kernel_action
                )
        for kernel_id in list(self.watches):
            self.unwatch(kernel_id)
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._sender
            self._sender = None
        self._queue = None

    async def _on_kernel_action(self, logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        if not self._running or data.get("status") != "success":
            return
        kernel_id = data.get("kernel_id")
        if not kernel_id:
            return
        action = data.get("action")
        if action == "start":
            self.watch(kernel_id)
        elif action == "restart":
            # A new kernel process: its old requests are gone. Reopen the subscription (the
            # ports may have changed) and say idle so the scheduler drops any priority.
            self.unwatch(kernel_id)
            self.watch(kernel_id)
            self._enqueue(kernel_id, "idle", time.time())
        elif action == "shutdown":
            self.unwatch(kernel_id)
        self._kernels_changed()

    def _kernels_changed(self) -> None:
        if self.on_kernels_changed is not None:
            try:
                self.on_kernels_changed()
            except Exception as exc:
                self.log.debug("gpushare: kernels-changed listener failed: %s", exc)

    # -- watching ----------------------------------------------------------------------------

    def watch(self, kernel_id: str) -> bool:
        """Open an iopub subscription for ``kernel_id`` (no-op when watched or unknown)."""
        if not self._running or kernel_id in self.watches:
            return False
        try:
            km = self.kernel_manager.get_kernel(kernel_id)
        except KeyError:
            return False
        try:
            stream = km.connect_iopub()
        except Exception as exc:
            self.log.warning("gpushare: cannot watch kernel %s: %s", kernel_id, exc)
            return False
        if not isinstance(stream, ZMQStream):  # a plain zmq socket (a custom kernel manager)
            stream = ZMQStream(stream)
        # A session of our own: a Session remembers the signatures it has seen, and the server's
        # activity tracking reads the same messages with the kernel's.
        session = Session(
            config=km.session.config,
            key=km.session.key,
            signature_scheme=km.session.signature_scheme,
        )
        w = _Watch(kernel_id, stream, session, km)
        stream.on_recv(lambda msg_list: self._on_iopub(w, msg_list))

        def on_dead() -> None:
            self.log.debug("gpushare: kernel %s died", kernel_id)
            self.unwatch(kernel_id)
            self._kernels_changed()

        w.on_dead = on_dead
        with contextlib.suppress(Exception):
            km.add_restart_callback(on_dead, "dead")
        self.watches[kernel_id] = w
        self.log.debug("gpushare: watching iopub of kernel %s", kernel_id)
        return True

    def unwatch(self, kernel_id: str) -> None:
        w = self.watches.pop(kernel_id, None)
        if w is None:
            return
        if w.on_dead is not None:
            with contextlib.suppress(Exception):
                w.manager.remove_restart_callback(w.on_dead, "dead")
        with contextlib.suppress(Exception):
            w.stream.on_recv(None)
        with contextlib.suppress(Exception):
            if not w.stream.closed():
                w.stream.close(linger=0)
        self.log.debug("gpushare: stopped watching kernel %s", kernel_id)

    def _on_iopub(self, w: _Watch, msg_list: list[Any]) -> None:
        try:
            _idents, fed = w.session.feed_identities(msg_list)
            msg = w.session.deserialize(fed, content=False)
            if msg["header"].get("msg_type") != "status":
                return
            msg = w.session.deserialize(fed, content=True)
        except Exception as exc:
            self.log.debug("gpushare: unreadable iopub message from %s: %s", w.kernel_id, exc)
            return
        execution_state = msg["content"].get("execution_state")
        parent = msg.get("parent_header") or {}
        parent_type = parent.get("msg_type")
        parent_id = parent.get("msg_id")
        if not parent_id or parent_type in self.ignored_parents:
            return
        opened = w.open_requests
        if execution_state == "idle" and parent_id not in opened and not w.heard_busy:
            # This request's busy came before the subscription was connected (ZMQ's slow
            # joiner: a cell run just after the kernel started). Its idle still says that a cell
            # ended, and that is what hands the GPU over at once: say it, once.
            w.heard_busy = True
            self._enqueue(w.kernel_id, "idle", time.time())
            return
        if execution_state == "busy":
            w.heard_busy = True
            opened[parent_id] = None
            while len(opened) > MAX_OPEN_REQUESTS:
                opened.popitem(last=False)
        elif execution_state == "idle":
            opened.pop(parent_id, None)
        else:  # "starting", "restarting", "dead"
            return
        state = "busy" if opened else "idle"
        if state != w.state:
            w.state = state
            self._enqueue(w.kernel_id, state, time.time())

    # -- sending -----------------------------------------------------------------------------

    def coming(self, kernel_id: str) -> None:
        """An execute request for ``kernel_id`` passed the server (.cell_hint): while the kernel
        runs another cell, the scheduler hears that one is coming (``kernel_state coming``: its
        evicted memory may move back before its turn). An idle kernel's ``busy`` follows at once
        and says the same."""
        w = self.watches.get(kernel_id)
        if w is not None and w.state == "busy":
            self._enqueue(kernel_id, "coming", time.time())

    def _enqueue(self, kernel_id: str, state: str, at: float) -> None:
        if not self._running:
            return
        if self._queue is None:
            self._queue = asyncio.Queue()
        if self._sender is None or self._sender.done():
            self._sender = asyncio.ensure_future(self._send_loop(self._queue))
        transition = Transition(kernel_id, state, at)
        self.transitions.append(transition)
        self._queue.put_nowait(transition)

    async def _send_loop(self, queue: asyncio.Queue[Transition | None]) -> None:
        while True:
            t = await queue.get()
            if t is None:
                return
            try:
                await self.send_state(t.kernel_id, t.state)
                t.outcome = "ok"
                self._warned_unavailable = False
                self.log.debug("gpushare: kernel %s is %s", t.kernel_id, t.state)
            except SchedulerError as exc:
                if exc.code == int(ErrorCode.NOT_FOUND):
                    t.outcome = "not_found"  # a kernel that has not touched the GPU
                else:
                    t.outcome = f"error: {exc}"
                    self.log.warning("gpushare: kernel_state %s: %s", t.kernel_id, exc)
            except SchedulerUnavailable as exc:
                t.outcome = "unavailable"
                if not self._warned_unavailable:
                    self._warned_unavailable = True
                    self.log.warning("gpushare: cannot report kernel states: %s", exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                t.outcome = f"error: {exc}"
                self.log.exception("gpushare: kernel_state %s failed", t.kernel_id)
