"""This kernel as the scheduler sees it: its entry in the scheduler's STATUS, its device's, or
why there is none (no scheduler answers, no GPU, not registered yet).

Both kernel-side features ask it: the ``%gpushare`` magic (:mod:`jupyter_gpushare.magic`) for
``status`` and ``quota``, and the wait line's thread (:mod:`jupyter_gpushare.waitline`) for the
queue position of a waiting cell. It lives here, below both, so that neither imports the other
for it. The words for "no GPU" are here too: the server extension's panel says the same.
"""

from __future__ import annotations

import os
from typing import Any

from .paths import default_socket_path
from .scheduler_client import SchedulerClient, SchedulerError, SchedulerUnavailable

__all__ = [
    "NO_GPU",
    "NO_GPU_WORDS",
    "SCHEDULER_TIMEOUT",
    "find_own_entry",
    "no_driver",
    "socket_path",
]

#: How long the magic waits for the scheduler (the cell blocks meanwhile).
SCHEDULER_TIMEOUT = 2.0

#: What every user-facing part says when there is no GPU (docs/jupyter.md).
NO_GPU_WORDS = "no NVIDIA GPU found"
NO_GPU = f"{NO_GPU_WORDS} (the scheduler finds none through NVML, and no kernel has reported one)"


def socket_path(status: dict[str, Any] | None) -> str:
    """The scheduler's socket this kernel's shim talks to (its status says), else the default."""
    path = (status or {}).get("socket_path")
    return str(path) if path else default_socket_path()


def find_own_entry(
    status: dict[str, Any], timeout: float = SCHEDULER_TIMEOUT
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, str | None]:
    """(this kernel's entry, its device's entry, a note when the scheduler did not answer or
    does not list the kernel yet), from the scheduler's STATUS as this process's uid sees it."""
    client = SchedulerClient(socket_path(status), timeout=timeout)
    try:
        doc = client.status_sync()
    except (SchedulerUnavailable, SchedulerError) as exc:
        missing = no_driver()
        if missing:  # e.g. `jupyter execute` on a machine without a GPU: no server, no driver
            return None, None, f"{NO_GPU_WORDS} ({missing}; no scheduler answers either)"
        return None, None, f"no answer from the scheduler ({exc})"
    pid = os.getpid()
    want = status.get("client_id")
    found: tuple[dict[str, Any], dict[str, Any]] | None = None
    for device in doc.get("devices", []) or []:
        for entry in device.get("clients", []) or []:
            if entry.get("pid") == pid:
                return entry, device, None
            if found is None and want and entry.get("id") == want:
                found = (entry, device)
    if found is not None:
        return found[0], found[1], None
    devices = doc.get("devices", []) or []
    uuid = status.get("device_uuid")
    for device in devices:
        if uuid and device.get("uuid") == uuid:
            return None, device, None
    if not devices and doc.get("nvml") is not True:
        return None, None, NO_GPU
    note = "the scheduler does not list this kernel yet (it registers at its first GPU call)"
    return None, (devices[0] if len(devices) == 1 else None), note


def no_driver() -> str | None:
    """Why there is no NVIDIA driver here, or None. Only loads libcuda (the shim has it loaded
    already where it exists); never initialises it in the kernel's process."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "the NVIDIA driver's libcuda.so.1 is not installed"
    return None
