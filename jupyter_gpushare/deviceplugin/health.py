"""GPU health from NVML's XID events, as NVIDIA's device plugin judges it: every GPU registers for
critical XID errors; an XID that is not an application's own fault marks the GPU unhealthy for
the rest of the plugin's life (its units turn Unhealthy and the kubelet places no new pod on
them); a restart of the plugin, after the GPU is reset, makes them Healthy again. An event
without a device marks every GPU unhealthy.

The application XIDs NVIDIA's plugin ignores by default (``XID_IGNORED``): 13 graphics engine
exception, 31 GPU memory page fault, 43 GPU stopped processing, 45 preemptive cleanup, 68 video
processor exception, 109 context switch timeout. They are a kernel's error, not the GPU's.

NVML's wait blocks, so it runs in a thread of its own and hands each verdict to the event loop.
``nvml`` is the pynvml module (nvidia-ml-py), or a stand-in with the same names in tests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["ALL_GPUS", "XID_IGNORED", "XidWatcher"]

XID_IGNORED = (13, 31, 43, 45, 68, 109)
#: The uuid given to the callback for an XID event that names no device.
ALL_GPUS = "*"
_WAIT_MS = 1000


class XidWatcher:
    """Calls ``on_xid(uuid, xid)`` on ``loop`` for each critical XID not in ``ignored``."""

    def __init__(
        self,
        log: logging.Logger | logging.LoggerAdapter,  # type: ignore[type-arg]
        on_xid: Callable[[str, int], None],
        ignored: Iterable[int] = XID_IGNORED,
        nvml: Any = None,
    ) -> None:
        self.log = log
        self.on_xid = on_xid
        self.ignored = frozenset(ignored)
        self.nvml = nvml
        self.watched: list[str] = []  # uuids registered for XID events
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._set: Any = None

    def start(self, loop: asyncio.AbstractEventLoop) -> str | None:
        """Register every GPU for XID events and start watching; None, or why it cannot
        (NVML absent, no GPU supports the events): then no GPU is marked by XIDs."""
        try:
            nvml = self.nvml
            if nvml is None:
                import pynvml as nvml  # nvidia-ml-py

                self.nvml = nvml
            nvml.nvmlInit()
        except Exception as exc:
            return f"NVML is not available here ({exc})"
        try:
            self._set = nvml.nvmlEventSetCreate()
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                try:
                    nvml.nvmlDeviceRegisterEvents(
                        handle, nvml.nvmlEventTypeXidCriticalError, self._set
                    )
                except nvml.NVMLError as exc:
                    self.log.warning(
                        "gpushare device plugin: %s cannot report XID errors (%s): its health "
                        "is the scheduler's alone",
                        uuid,
                        exc,
                    )
                    continue
                self.watched.append(uuid)
        except Exception as exc:
            return f"cannot register for NVML's XID events ({exc})"
        if not self.watched:
            return "no GPU reports XID errors through NVML"
        self._thread = threading.Thread(
            target=self._run, args=(loop,), name="gpushare-xid", daemon=True
        )
        self._thread.start()
        return None

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        nvml = self.nvml
        while not self._stop.is_set():
            try:
                data = nvml.nvmlEventSetWait(self._set, _WAIT_MS)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) != nvml.NVML_ERROR_TIMEOUT:
                    self.log.warning("gpushare device plugin: NVML event wait: %s", exc)
                    self._stop.wait(_WAIT_MS / 1000)
                continue
            if data.eventType != nvml.nvmlEventTypeXidCriticalError:
                continue
            xid = int(data.eventData)
            if xid in self.ignored:
                self.log.info("gpushare device plugin: XID %d (an application's error)", xid)
                continue
            uuid = ALL_GPUS
            if data.device:
                try:
                    uuid = _text(nvml.nvmlDeviceGetUUID(data.device))
                except nvml.NVMLError:
                    uuid = ALL_GPUS
            try:
                loop.call_soon_threadsafe(self.on_xid, uuid, xid)
            except RuntimeError:  # the loop is closed: the plugin is going
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * _WAIT_MS / 1000 + 1)
        if self._set is not None:
            try:
                self.nvml.nvmlEventSetFree(self._set)
                self.nvml.nvmlShutdown()
            except Exception:
                pass
            self._set = None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
