"""The ``%gpushare`` magic: what this kernel is doing with the shared GPU.

    %gpushare                  same as %gpushare status
    %gpushare status           state, memory vs quota, GPU time, waits, queue position, device
    %gpushare release          hand the GPU back now (outstanding work is finished first)
    %gpushare quota            show the memory quota
    %gpushare quota 8GiB       ask the scheduler for a new quota ("none" or 0: no quota)
    %gpushare --help

Kernels started by the gpushare provisioner load this extension by themselves; elsewhere
``%load_ext jupyter_gpushare.magic``. The kernel's own view comes from the shim in this process
(:func:`jupyter_gpushare.shim.read_status`, no scheduler round trip); the queue position and the
device line come from the scheduler, and are left out when it does not answer.
"""

from __future__ import annotations

import html
import shlex
from dataclasses import dataclass, field
from typing import Any

from . import shim, waitline
from .scheduler_client import SchedulerClient, SchedulerError, SchedulerUnavailable
from .scheduler_view import (
    NO_GPU_WORDS,
    SCHEDULER_TIMEOUT,
    find_own_entry,
    no_driver,
    socket_path,
)
from .units import format_size, parse_memory_size

__all__ = ["GPUShareReport", "gpushare_command", "load_ipython_extension"]

HELP = """\
%gpushare [status]        this kernel's GPU state: running / waiting / idle / evicted, memory
                          used vs quota, GPU time, waits, queue position, the device
%gpushare release         hand the GPU back now (outstanding work is finished first); the next
                          GPU call asks for it again
%gpushare quota           show this kernel's memory quota
%gpushare quota SIZE      ask the scheduler for a new quota, e.g. 8GiB, 512M; "none" or 0 removes
                          it (you may change your own kernels' quotas only)
%gpushare --help          this text"""

NOT_SHARED = (
    "This kernel does not run under gpushare (libgpushare.so is not preloaded): start it from a "
    '"(GPU shared)" kernel (`jupyter gpushare install-kernelspec`) or ask your administrator to '
    "enable the gpushare provisioner."
)


def _seconds(value: float) -> str:
    if value < 60:
        return f"{value:.1f} s"
    minutes, secs = divmod(int(value), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


@dataclass
class GPUShareReport:
    """``%gpushare status``'s answer: plain text in terminals, HTML in notebooks."""

    status: dict[str, Any] | None
    scheduler_client: dict[str, Any] | None = None
    device: dict[str, Any] | None = None
    scheduler_note: str | None = None
    lines: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.status is not None and not self.lines:
            self.lines = self._build()

    # -- content -------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """One of running, waiting, idle, evicted, releasing, unshared, inactive."""
        s = self.status or {}
        state = str(s.get("state", "inactive"))
        if state == "holding":
            return "running"
        if state == "idle" and (s.get("evicted") or s.get("evicted_bytes")):
            return "evicted"
        return state

    def _state_text(self) -> str:
        s = self.status or {}
        state = self.state
        if state == "waiting":
            text = f"waiting for the GPU ({_seconds(float(s.get('current_wait_seconds', 0.0)))}"
            pos = (self.scheduler_client or {}).get("queue_position")
            if isinstance(pos, int):
                text += f", position {pos} in the queue"
            return text + ")"
        return {
            "running": "running (holds the GPU)",
            "idle": "idle (does not hold the GPU)",
            "evicted": "idle, memory evicted to the host",
            "releasing": "releasing the GPU",
            "asleep": "asleep (memory and context on the host; the next GPU call wakes it)",
            "unshared": "unshared (no scheduler reachable: running alone, retrying)",
            "inactive": "inactive (no CUDA context yet)",
        }.get(state, state)

    def _build(self) -> list[tuple[str, str]]:
        s = self.status or {}
        lines: list[tuple[str, str]] = [("state", self._state_text())]
        quota = int(s.get("quota_bytes", 0))
        pool = int(s.get("pool_bytes", 0))
        used = int(s.get("used_bytes", 0))
        memory = f"{format_size(used)} used of "
        memory += f"{format_size(quota)} quota" if quota else "no quota"
        if pool:
            memory += f" (pool {format_size(pool)})"
        lines.append(("memory", memory))
        evicted = int(s.get("evicted_bytes", 0))
        managed = int(s.get("managed_bytes", 0))
        pinned = int(s.get("pinned_bytes", 0))
        if evicted:
            where = f"{format_size(evicted)} evicted to the host, "
            where += f"{format_size(max(used - evicted, 0))} resident"
        elif used:
            where = "all resident on the GPU"
        else:
            where = "nothing allocated on the GPU"
        if used or evicted:
            where += f" ({format_size(managed)} evictable, {format_size(pinned)} pinned)"
        lines.append(("residency", where))
        gpu = f"{_seconds(float(s.get('holding_seconds', 0.0)))} held"
        sched_gpu = (self.scheduler_client or {}).get("gpu_seconds")
        if isinstance(sched_gpu, (int, float)):
            gpu += f" (scheduler: {_seconds(float(sched_gpu))})"
        lines.append(("GPU time", gpu))
        waits = int(s.get("waits", 0))
        waited = f"{waits} wait{'s' if waits != 1 else ''}, "
        waited += f"{_seconds(float(s.get('wait_seconds', 0.0)))} in total"
        lines.append(("waits", waited))
        lines.append(("device", self._device_text()))
        client = str(s.get("client_id", ""))
        sched_id = (self.scheduler_client or {}).get("id")
        ident = client
        if sched_id and sched_id != client:
            ident += f" (the scheduler calls it {sched_id})"
        label = (self.scheduler_client or {}).get("label")
        if label:
            ident += f", {label}"
        lines.append(("kernel", ident or "not registered yet (at its first GPU call)"))
        return lines

    def _device_text(self) -> str:
        d = self.device
        if d is None:
            return self.scheduler_note or "the scheduler did not answer"
        # A node scheduler shows a non-admin only their own clients, and the rest summed per
        # user in "others" (docs/protocol.md, "Who sees what"): count those too.
        others = d.get("others", []) or []
        kernels = len(d.get("clients", []) or []) + sum(int(o.get("clients", 0)) for o in others)
        waiting = len(d.get("queue_users", d.get("queue", [])) or [])
        index = d.get("index")  # on a node with several GPUs: which one (nvidia-smi's number)
        gpu = f"GPU {index}: " if isinstance(index, int) else ""
        parts = [
            f"{gpu}{d.get('name', '?')} ({d.get('uuid', '?')})",
            f"{d.get('mode', '?')} mode",
            f"{kernels} kernel{'s' if kernels != 1 else ''}",
            f"{waiting} waiting",
            f"{format_size(int(d.get('resident_bytes', 0)))} of "
            f"{format_size(int(d.get('pool_bytes', 0)))} pool resident",
        ]
        quantum = d.get("quantum_ms")
        if isinstance(quantum, (int, float)):
            parts.append(f"quantum {quantum / 1000:g} s")
        return ", ".join(parts)

    # -- representations ------------------------------------------------------------------------

    def __repr__(self) -> str:
        if self.status is None:
            return NOT_SHARED
        width = max(len(k) for k, _ in self.lines)
        out = ["gpushare status"]
        out += [f"  {k.ljust(width)}  {v}" for k, v in self.lines]
        return "\n".join(out)

    __str__ = __repr__

    def _repr_html_(self) -> str:
        if self.status is None:
            return f'<div class="gpushare-status"><b>gpushare</b>: {html.escape(NOT_SHARED)}</div>'
        # JupyterLab's theme variables (light and dark themes), with plain fallbacks elsewhere.
        colour = {
            "running": "var(--jp-success-color1, green)",
            "waiting": "var(--jp-warn-color1, orange)",
            "evicted": "var(--jp-info-color1, purple)",
            "unshared": "var(--jp-error-color1, red)",
        }.get(self.state, "var(--jp-ui-font-color2, gray)")
        s = self.status
        quota = int(s.get("quota_bytes", 0)) or int(s.get("pool_bytes", 0))
        bar = ""
        if quota:
            pct = min(100.0, 100.0 * int(s.get("used_bytes", 0)) / quota)
            bar = (
                '<div style="width:16em;height:0.6em;border-radius:3px;margin-top:2px;'
                'background:var(--jp-layout-color3, lightgray)">'
                '<div style="height:100%;border-radius:3px;'
                f'background:{colour};width:{pct:.1f}%"></div></div>'
            )
        rows = []
        for key, value in self.lines:
            cell = html.escape(value)
            if key == "state":
                cell = f'<b style="color:{colour}">{cell}</b>'
            if key == "memory":
                cell += bar
            rows.append(
                f'<tr><th style="text-align:left;padding-right:1em;vertical-align:top">'
                f'{html.escape(key)}</th><td style="text-align:left">{cell}</td></tr>'
            )
        return (
            '<div class="gpushare-status"><b>gpushare status</b>'
            f"<table>{''.join(rows)}</table></div>"
        )


def status_report() -> GPUShareReport:
    status = shim.read_status()
    if status is None:
        return GPUShareReport(None)
    entry, device, note = find_own_entry(status)
    return GPUShareReport(status, entry, device, note)


def _release() -> str:
    result = shim.release()
    if result is None:
        return NOT_SHARED
    if result:
        return "gpushare: released the GPU (the next GPU call asks the scheduler for it again)"
    # The shim talks to the scheduler from its first GPU call on: before it, or with no GPU,
    # it holds nothing (while the panel may well show the scheduler live).
    status = shim.read_status() or {}
    if status.get("state") in (None, "inactive"):
        missing = no_driver()
        why = f"{NO_GPU_WORDS} ({missing})" if missing else "this kernel has made no GPU call yet"
        return f"gpushare: nothing to release: {why}, so it holds no GPU"
    if status.get("state") == "unshared":
        return "gpushare: not connected to a scheduler (running unshared): nothing to release"
    return "gpushare: nothing to release: this kernel does not hold the GPU now"


def _quota(args: list[str]) -> str:
    status = shim.read_status()
    if status is None:
        return NOT_SHARED
    current = int(status.get("quota_bytes", 0))
    current_text = format_size(current) if current else "none"
    if not args:
        pool = int(status.get("pool_bytes", 0))
        text = f"gpushare: memory quota {current_text}"
        if pool:
            text += f" (pool {format_size(pool)})"
        return text + f"; {format_size(int(status.get('used_bytes', 0)))} used"
    if len(args) > 1:
        raise ValueError("usage: %gpushare quota [SIZE]")
    raw = args[0]
    quota = 0 if raw.lower() in ("none", "off", "unlimited") else parse_memory_size(raw)
    entry, _, note = find_own_entry(status)
    client_id = (entry or {}).get("id") or status.get("client_id")
    if entry is None and note and note.startswith("no answer"):
        return f"gpushare: cannot set the quota: {note}"
    new = format_size(quota) if quota else "none"
    if entry is None and status.get("state") == "inactive":
        # Not registered yet (no GPU call so far): the wait line's thread applies it the moment
        # the kernel registers, before its first allocation is checked against the scheduler.
        waitline.set_pending_quota(quota)
        return (
            f"gpushare: memory quota {current_text} -> {new}: applied when this kernel makes its "
            "first GPU call (it registers with the scheduler then)"
        )
    if not client_id:
        return "gpushare: cannot set the quota: this kernel has no client id"
    client = SchedulerClient(socket_path(status), timeout=SCHEDULER_TIMEOUT)
    try:
        client.control_sync("set_quota", client=client_id, quota=quota)
    except (SchedulerUnavailable, SchedulerError) as exc:
        return f"gpushare: cannot set the quota: {exc}"
    return f"gpushare: memory quota {current_text} -> {new} (asked the scheduler)"


def gpushare_command(line: str) -> GPUShareReport | str:
    """What ``%gpushare LINE`` answers: a report to display, or a line of text."""
    try:
        args = shlex.split(line)
    except ValueError as exc:
        return f"gpushare: {exc}\n\n{HELP}"
    if not args or args[0] == "status":
        if len(args) > 1:
            return f"gpushare: status takes no arguments\n\n{HELP}"
        return status_report()
    command, rest = args[0], args[1:]
    if command in ("-h", "--help", "help"):
        return HELP
    if command == "release":
        return _release()
    if command == "quota":
        try:
            return _quota(rest)
        except ValueError as exc:
            return f"gpushare: {exc}"
    return f"gpushare: unknown command {command!r}\n\n{HELP}"


# ---------------------------------------------------------------------------------------------
# IPython


def _make_magics_class() -> Any:
    from IPython.core.magic import Magics, line_magic, magics_class

    @magics_class
    class GPUShareMagics(Magics):  # type: ignore[misc]
        @line_magic  # type: ignore[misc]
        def gpushare(self, line: str) -> GPUShareReport | None:
            """%gpushare [status | release | quota [SIZE] | --help]: this kernel and the shared
            GPU (run %gpushare --help for details)."""
            result = gpushare_command(line)
            if isinstance(result, GPUShareReport):
                return result
            print(result)
            return None

    return GPUShareMagics


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%gpushare`` (``%load_ext jupyter_gpushare.magic``) and, in a kernel under the
    shim, start the wait line (:mod:`jupyter_gpushare.waitline`)."""
    ipython.register_magics(_make_magics_class())
    waitline.start_in_kernel(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """Nothing to undo: IPython keeps the magic until the kernel ends."""
