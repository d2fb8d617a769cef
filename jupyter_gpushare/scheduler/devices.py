"""GPU discovery through NVML (pynvml, from the ``nvidia-ml-py`` package).

NVML calls block (``nvmlInit`` can take a second on a cold driver), so the scheduler runs
:func:`discover_devices` in an executor through :func:`discover_devices_async`. A node without
NVML, without a driver or without a GPU yields an empty list and an error text, never a traceback:
the scheduler then learns its devices from the shims' HELLO messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

__all__ = ["DeviceInfo", "Discovery", "discover_devices", "discover_devices_async"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    uuid: str
    name: str
    total_bytes: int


@dataclass(frozen=True)
class Discovery:
    devices: list[DeviceInfo]
    error: str | None = None  # None: NVML answered (possibly with zero devices)

    @property
    def ok(self) -> bool:
        return self.error is None


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def discover_devices() -> Discovery:
    """Ask NVML for every GPU: index, UUID, name, total memory. Blocking; never raises."""
    try:
        import pynvml
    except Exception as exc:  # ImportError, or a broken install
        return Discovery([], f"NVML bindings unavailable ({exc.__class__.__name__}: {exc})")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return Discovery([], f"NVML unavailable ({exc})")
    try:
        devices: list[DeviceInfo] = []
        count = pynvml.nvmlDeviceGetCount()
        for index in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            name = _text(pynvml.nvmlDeviceGetName(handle))
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            devices.append(DeviceInfo(index, uuid, name, int(memory.total)))
        return Discovery(devices)
    except Exception as exc:
        return Discovery([], f"NVML query failed ({exc})")
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


async def discover_devices_async() -> Discovery:
    """:func:`discover_devices` in the default executor, so the event loop never blocks on NVML."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, discover_devices)
