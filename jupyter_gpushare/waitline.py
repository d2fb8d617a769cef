"""The wait, in the cell: one live line while a cell's GPU call waits for the device.

A cell whose GPU call blocks at the shim's gate shows ``[*]`` like any slow computation, and
ipykernel runs one cell at a time, so ``%gpushare status`` cannot answer until the wait is over.
This module runs in the kernel (the ``%gpushare`` extension, which the provisioner loads, starts
it) and says what is happening *in the waiting cell itself*::

    Waiting for the GPU: 2nd in line, behind alice's kernel (turn ends in ~12 s)
    Waiting for the GPU: moving another kernel's memory to host memory
    Waiting for the GPU: waking from sleep
    Waiting for the GPU: this kernel's turn ended; its GPU work is finishing and its memory ...
    Got the GPU after 14.2 s (restored 6.00 GiB in 0.2 s)

How: the main thread is blocked inside the CUDA call, so a daemon thread polls the shim's status
(:func:`jupyter_gpushare.shim.read_status`: a copy under a short lock, it never blocks), asks the
scheduler why it waits (its STATUS reply, as the kernel's own uid: the access rules of
docs/protocol.md apply), and publishes a ``display_data`` with a ``display_id`` on iopub under the
parent header of the executing cell, then ``update_display_data`` as the wait goes on. Cells that
do not wait longer than :data:`THRESHOLD_SECONDS` get nothing. Interrupt is the shim's (it ends a
wait on SIGINT); this thread never touches signals.

:func:`wait_text` and :func:`got_text` are pure (tests feed them documents); :class:`WaitLine`
takes its status reader, scheduler view, publisher and clock as arguments.
"""

from __future__ import annotations

import html
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .scheduler_view import find_own_entry, socket_path
from .units import format_size

__all__ = [
    "RELEASING_TEXT",
    "THRESHOLD_SECONDS",
    "WaitLine",
    "got_text",
    "ordinal",
    "set_pending_quota",
    "start_in_kernel",
    "wait_text",
]

#: A wait shorter than this shows nothing: most grants take milliseconds.
THRESHOLD_SECONDS = 1.0
#: How often the thread reads the shim's status (a copy under a lock: cheap).
POLL_SECONDS = 0.1
#: ... and while no cell waits (a kernel's idle cost: one short status copy four times a second).
IDLE_POLL_SECONDS = 0.25
#: How often, at most, it asks the scheduler why the kernel waits (one socket round trip).
SCHEDULER_EVERY_SECONDS = 1.0
#: The line while a call waits for this kernel's own release to end: the shim says "releasing"
#: (revoked, it lets its queued GPU work finish, then may move its memory to the host) and a call
#: that came meanwhile is blocked at the gate. Its wait counts from then.
RELEASING_TEXT = (
    "Waiting for the GPU: this kernel's turn ended; its GPU work is finishing and its memory "
    "may move to host memory"
)
#: The mime type the JupyterLab extension recognises (it raises the "your turn came" toast).
MIME_TYPE = "application/vnd.gpushare.wait+json"

log = logging.getLogger(__name__)

StatusReader = Callable[[], "dict[str, Any] | None"]
#: (this kernel's client entry, its device's entry), either None when unknown.
SchedulerView = Callable[["dict[str, Any]"], "tuple[dict[str, Any] | None, dict[str, Any] | None]"]
#: publish(content of display_data, update?)
Publisher = Callable[["dict[str, Any]", bool], None]


_pending_quota: int | None = None


def set_pending_quota(quota: int) -> None:
    """``%gpushare quota SIZE`` before the kernel has registered: apply it at registration."""
    global _pending_quota
    _pending_quota = quota


def take_pending_quota() -> int | None:
    global _pending_quota
    quota, _pending_quota = _pending_quota, None
    return quota


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, 11th, 12th, 13th, 21st ..."""
    if 10 <= n % 100 <= 20:
        return f"{n}th"
    return f"{n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th') }"


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 60 else f"{int(value) // 60} min {int(value) % 60:02d} s"


def _about(holder_id: str, user: str, device: dict[str, Any] | None, me: str | None) -> str:
    """A holder as a person reads it: "alice's kernel", or with its label where the access
    rules let this kernel see it (the viewer's own kernels, or everything for an admin)."""
    label = ""
    owner = user
    for entry in (device or {}).get("clients", []) or []:
        if entry.get("id") == holder_id:
            label = os.path.basename(str(entry.get("label") or "").rstrip("/"))
            owner = str(entry.get("user") or user)
    whose = "your" if me and owner == me else (f"{owner}'s" if owner else "another user's")
    return f"{whose} {label}" if label else f"{whose} kernel"


def wait_text(
    status: dict[str, Any],
    entry: dict[str, Any] | None,
    device: dict[str, Any] | None,
    me: str | None = None,
) -> str:
    """The live line for a waiting kernel, from its shim ``status`` and, when the scheduler
    answered, its own client ``entry`` and ``device`` entry (``me``: the viewer's user name)."""
    state = str(status.get("state", ""))
    if state in ("asleep", "6"):
        return "Waiting for the GPU: waking from sleep"
    if state == "releasing":
        return RELEASING_TEXT
    entry = entry or {}
    if entry.get("state") in ("running", "revoking"):
        # The scheduler granted the device; the shim is moving this kernel's memory back.
        evicted = int(status.get("evicted_bytes", 0))
        if evicted:
            return f"Got the GPU: restoring {format_size(evicted)} of this kernel's memory"
        return "Got the GPU: starting"
    wait = entry.get("wait")
    if not isinstance(wait, dict):
        return "Waiting for the GPU"
    reason = wait.get("reason")
    holders = [h for h in wait.get("holders") or [] if isinstance(h, dict)]
    first = holders[0] if holders else None
    behind = _about(str(first.get("id")), str(first.get("user") or ""), device, me) if first else ""
    position = entry.get("queue_position")
    place = f"{ordinal(position)} in line" if isinstance(position, int) else "in line"
    if reason == "recovering":
        return "Waiting for the GPU: the scheduler restarted, waiting for kernels to reconnect"
    if reason == "shorter_first":
        return "Waiting for the GPU: paused while shorter cells run (your memory stays on the GPU)"
    if reason == "host_memory":  # the node's host budget is full (docs/architecture.md)
        text = wait.get("text") or "the node's host memory is full"
        return f"Waiting for the GPU: {text}"
    if reason == "memory" or not first:
        moving = wait.get("moving_bytes")
        amount = f"{format_size(int(moving))} of " if isinstance(moving, int) and moving else ""
        return f"Waiting for the GPU: moving {amount}another kernel's memory to host memory"
    if reason == "releasing":
        asked = float(first.get("revoking_seconds") or 0.0)
        return (
            f"Waiting for the GPU: {place}, behind {behind}, which is finishing its GPU work "
            f"(asked to release {asked:.0f} s ago)"
        )
    left = float(first.get("quantum_seconds") or 0.0) - float(first.get("held_seconds") or 0.0)
    if left > 0:
        return f"Waiting for the GPU: {place}, behind {behind} (turn ends in ~{left:.0f} s)"
    return f"Waiting for the GPU: {place}, behind {behind} (its turn is over)"


def got_text(waited: float, restored_bytes: int, restore_seconds: float | None) -> str:
    """The line a wait ends with."""
    text = f"Got the GPU after {waited:.1f} s"
    if restored_bytes > 0:
        text += f" (restored {format_size(restored_bytes)}"
        if restore_seconds is not None:
            text += f" in {restore_seconds:.1f} s"
        text += ")"
    return text


def _waits(status: dict[str, Any]) -> bool:
    """Whether a GPU call of this kernel waits: the shim says so, or it is releasing the device
    while a call that came meanwhile is blocked at the gate (its wait has begun: the shim counts
    it, and the line's figure includes it)."""
    state = str(status.get("state"))
    if state == "releasing":
        return float(status.get("current_wait_seconds") or 0.0) > 0
    return state in ("waiting", "asleep", "6")


def _content(text: str, display_id: str, phase: str, seconds: float) -> dict[str, Any]:
    colour = {
        "waiting": "var(--jp-warn-color1)",
        "granted": "var(--jp-success-color1)",
    }.get(phase, "var(--jp-ui-font-color2)")
    markup = (
        f'<div class="gpushare-wait" data-phase="{phase}" '
        f'style="color:{colour};font-family:var(--jp-ui-font-family)">'
        f"{html.escape(text)}</div>"
    )
    return {
        "data": {
            "text/plain": text,
            "text/html": markup,
            MIME_TYPE: {"phase": phase, "text": text, "seconds": round(seconds, 3)},
        },
        "metadata": {},
        "transient": {"display_id": display_id},
    }


def _notice(text: str) -> dict[str, Any]:
    return {"data": {"text/plain": text}, "metadata": {}, "transient": {}}


@dataclass
class WaitLine:
    """Follows one kernel's waits; :meth:`poll` is one step (the thread calls it in a loop)."""

    read_status: StatusReader
    scheduler_view: SchedulerView
    publish: Publisher
    clock: Callable[[], float] = time.monotonic
    threshold: float = THRESHOLD_SECONDS
    scheduler_every: float = SCHEDULER_EVERY_SECONDS
    me: str | None = None
    #: Whether a cell is executing (the publisher has a parent to send under).
    in_cell: Callable[[], bool] = lambda: True

    _display_id: str | None = None
    _shown: str = ""
    _asked_at: float = field(default=float("-inf"))
    _asked_state: str = ""
    _entry: dict[str, Any] | None = None
    _device: dict[str, Any] | None = None
    _waited: float = 0.0
    _held_at_start: float | None = None
    #: The shim's count of RESTOREDs at the last poll that did not wait: before this wait.
    _restores_before: int = 0
    _ids: Any = field(default_factory=itertools.count)
    # The thread polls; the main thread polls once more as a cell ends (see _KernelPublisher).
    _lock: Any = field(default_factory=threading.Lock)

    #: set_quota(client id, bytes) -> None, or an error text; called once a pending quota
    #: (``%gpushare quota`` before the first GPU call) can be applied.
    apply_quota: Callable[[dict[str, Any], int], str | None] | None = None

    def poll(self) -> None:
        with self._lock:
            self._poll()

    def _poll(self) -> None:
        status = self.read_status()
        if status is None:
            return
        if self.apply_quota is not None and status.get("connected") and status.get("client_id"):
            quota = take_pending_quota()
            if quota is not None:
                error = self.apply_quota(status, quota)
                if error:
                    self.publish(_notice(f"gpushare: cannot set the quota: {error}"), False)
        state = str(status.get("state"))
        waiting = _waits(status)
        now = self.clock()
        if waiting:
            waited = float(status.get("current_wait_seconds") or 0.0)
            self._waited = waited
            if self._display_id is None:
                if self._held_at_start is None:
                    self._held_at_start = float(status.get("holding_seconds") or 0.0)
                if waited < self.threshold or not self.in_cell():
                    return
                self._display_id = f"gpushare-wait-{uuid.uuid4().hex}-{next(self._ids)}"
                self._shown = ""
            # Asked again at once when the shim's state changes (its release ends): the entry
            # the scheduler gave while this kernel released says "revoking", not why it waits.
            if now - self._asked_at >= self.scheduler_every or state != self._asked_state:
                self._asked_at, self._asked_state = now, state
                self._entry, self._device = self.scheduler_view(status)
            text = wait_text(status, self._entry, self._device, self.me)
            if text != self._shown:
                self.publish(_content(text, self._display_id, "waiting", waited), bool(self._shown))
                self._shown = text
            return
        if self._display_id is not None and not self._was_granted(status):
            # Interrupted (the shim ends a wait on SIGINT), or the scheduler went away.
            text = f"Stopped waiting for the GPU after {self._waited:.1f} s"
            self.publish(_content(text, self._display_id, "stopped", self._waited), True)
        elif self._display_id is not None:
            # The shim counts its RESTORED before it says it holds the device: once this poll
            # sees the wait over, the figures of this grant's restore are final.
            restored, restore_seconds = self._restore_of_this_grant(status)
            text = got_text(self._waited, restored, restore_seconds)
            self.publish(_content(text, self._display_id, "granted", self._waited), True)
        self._reset()
        self._restores_before = int(status.get("restores") or 0)

    def _restore_of_this_grant(self, status: dict[str, Any]) -> tuple[int, float | None]:
        """(bytes, seconds) this grant copied back to the device, as the shim reported them to
        the scheduler (its RESTORED, which the shim's status repeats). Memory the kernel
        allocated while it waited had no physical memory until the grant backed it: it counts as
        on the host meanwhile (``evicted_bytes``), but nothing of it was restored."""
        if int(status.get("restores") or 0) == self._restores_before:
            return 0, None  # granted with nothing to move back: no RESTORED
        return int(status.get("last_restore_bytes") or 0), float(
            status.get("last_restore_seconds") or 0.0
        )

    def _reset(self) -> None:
        self._display_id = None
        self._shown = ""
        self._asked_at = float("-inf")
        self._asked_state = ""
        self._entry = self._device = None
        self._waited = 0.0
        self._held_at_start = None

    def _was_granted(self, status: dict[str, Any]) -> bool:
        """Whether the wait ended with the GPU: the shim holds it, or has held it since (a short
        turn may be over, or being released, by the time of this poll); an interrupted wait held
        nothing (also one interrupted while its kernel was still releasing)."""
        if status.get("state") == "holding":
            return True
        held = float(status.get("holding_seconds") or 0.0)
        return self._held_at_start is not None and held > self._held_at_start

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(POLL_SECONDS if self._display_id else IDLE_POLL_SECONDS):
            try:
                self.poll()
            except Exception:  # never let the thread die silently mid-session
                log.debug("gpushare wait line: poll failed", exc_info=True)


# ---------------------------------------------------------------------------------------------
# In an ipykernel


def _set_quota(status: dict[str, Any], quota: int) -> str | None:
    """Apply a pending quota; None when done, else why not."""
    from .scheduler_client import SchedulerClient, SchedulerError, SchedulerUnavailable

    client_id = str(status["client_id"])
    client = SchedulerClient(socket_path(status), timeout=SCHEDULER_EVERY_SECONDS * 5)
    error = "the scheduler does not know this kernel"
    for _ in range(50):  # the HELLO may still be on its way: the id is not known yet
        try:
            client.control_sync("set_quota", client=client_id, quota=quota)
            return None
        except SchedulerError as exc:
            if "no client" not in str(exc):
                return str(exc)
            error = str(exc)
        except SchedulerUnavailable as exc:
            return str(exc)
        time.sleep(0.02)
    return error


def _scheduler_view(status: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    return find_own_entry(status, timeout=SCHEDULER_EVERY_SECONDS)[:2]


class _KernelPublisher:
    """Sends display messages on iopub under the executing cell's parent header, from any
    thread: the parent is captured in the main thread (IPython's ``pre_run_cell`` event, where
    ipykernel's context holds it) and cleared at ``post_run_cell``."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.kernel = shell.kernel
        self.parent: dict[str, Any] | None = None
        #: Called in the main thread as a cell ends, before its parent is forgotten: the last
        #: poll, so that "Got the GPU" reaches the cell before it goes idle.
        self.at_cell_end: Callable[[], None] | None = None
        shell.events.register("pre_run_cell", self._pre)
        shell.events.register("post_run_cell", self._post)

    def _pre(self, *_: Any) -> None:
        self.parent = self.kernel.get_parent("shell") or None

    def _post(self, *_: Any) -> None:
        if self.at_cell_end is not None:
            try:
                self.at_cell_end()
            except Exception:
                log.debug("gpushare wait line: the last poll failed", exc_info=True)
        self.parent = None

    def in_cell(self) -> bool:
        return self.parent is not None

    def __call__(self, content: dict[str, Any], update: bool) -> None:
        parent = self.parent
        if parent is None:
            return
        self.kernel.session.send(
            self.kernel.iopub_socket,
            "update_display_data" if update else "display_data",
            content,
            parent=parent,
            ident=self.shell.display_pub.topic,
        )


_started: threading.Event | None = None


def start_in_kernel(shell: Any) -> bool:
    """Start the wait line's thread in this ipykernel (once); False outside a kernel or the
    shim (nothing to follow)."""
    global _started
    from . import shim

    if _started is not None or getattr(shell, "kernel", None) is None:
        return False
    # Not read_status(): its first call loads cffi, which would add ~13 ms to every kernel's
    # start; the thread's first poll pays that instead, after the kernel is ready.
    if not shim.in_process():
        return False
    publisher = _KernelPublisher(shell)
    line = WaitLine(
        read_status=shim.read_status,
        scheduler_view=_scheduler_view,
        publish=publisher,
        in_cell=publisher.in_cell,
        apply_quota=_set_quota,
        me=os.environ.get("GPUSHARE_USER") or _login_name(),
    )
    publisher.at_cell_end = line.poll
    _started = threading.Event()
    thread = threading.Thread(
        target=line.run, args=(_started,), name="gpushare-wait-line", daemon=True
    )
    thread.start()
    return True


def _login_name() -> str | None:
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())
