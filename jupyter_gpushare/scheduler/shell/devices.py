"""GPU discovery through NVML (pynvml, from the ``nvidia-ml-py`` package).

NVML calls block (``nvmlInit`` can take a second on a cold driver), so the scheduler runs
:func:`discover_devices` in an executor through :func:`discover_devices_async`. A node without
NVML, without a driver or without a GPU yields an empty list and an error text, never a traceback:
the scheduler then learns its devices from the shims' HELLO messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..features.nvml_check import ProcessMemory, pids_comparable

__all__ = [
    "DeviceInfo",
    "Discovery",
    "UtilizationSampler",
    "discover_devices",
    "discover_devices_async",
    "discovery_warning",
    "find_devices",
    "nvml_pids_comparable",
    "probe_cuda_devices",
]

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


#: Run in a child (``python -I -c``): the CUDA driver's own list of GPUs, one JSON line each.
#: A child, so that the scheduler never initialises the driver itself.
_CUDA_PROBE = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
if lib.cuInit(0) != 0:
    sys.exit(0)
count = ctypes.c_int(0)
lib.cuDeviceGetCount(ctypes.byref(count))
for i in range(count.value):
    dev = ctypes.c_int(0)
    if lib.cuDeviceGet(ctypes.byref(dev), i) != 0:
        continue
    name = ctypes.create_string_buffer(256)
    lib.cuDeviceGetName(name, 256, dev)
    raw = (ctypes.c_ubyte * 16)()
    get_uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
    if get_uuid(raw, dev) != 0:
        continue
    h = bytes(raw).hex()
    uuid = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    total = ctypes.c_size_t(0)
    if lib.cuDeviceTotalMem_v2(ctypes.byref(total), dev) != 0:
        continue
    print(json.dumps([i, uuid, name.value.decode("utf-8", "replace"), total.value]))
"""


def probe_cuda_devices(library: str | None = None, timeout: float = 30.0) -> Discovery:
    """The GPUs the CUDA driver lists (index in PCI order, uuid, name, total memory), asked in
    a child process, for a node without NVML: the scheduler's own sizes of its devices, never
    a client's word (issue 22, A13b). ``library``: ``$GPUSHARE_REAL_LIBCUDA``, else
    ``libcuda.so.1``. Blocking; never raises."""
    lib = library or os.environ.get("GPUSHARE_REAL_LIBCUDA") or "libcuda.so.1"
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES")}
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # nvidia-smi's numbering, as NVML's
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", _CUDA_PROBE, lib],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return Discovery([], f"the CUDA driver could not be asked ({exc})")
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["?"])[-1]
        return Discovery([], f"the CUDA driver could not be asked ({why})")
    devices = []
    for line in done.stdout.splitlines():
        with contextlib.suppress(ValueError, TypeError):
            index, uuid, name, total = json.loads(line)
            devices.append(DeviceInfo(int(index), str(uuid), str(name), int(total)))
    return Discovery(devices)


async def find_devices(
    use_nvml: bool, discover: Callable[[], Awaitable[Discovery]] | None = None
) -> Discovery:
    """The node's GPUs: NVML's (``discover``, default :func:`discover_devices_async`); without
    NVML, the CUDA driver's own list (a HELLO then neither adds nor sizes a GPU, A13b);
    ``use_nvml`` False: none (learnt from the kernels)."""
    if not use_nvml:
        return Discovery([], "disabled (use_nvml = False)")
    found = await (discover or discover_devices_async)()
    if found.error is not None:
        probed = await asyncio.get_running_loop().run_in_executor(None, probe_cuda_devices)
        if probed.devices:
            return Discovery(probed.devices, found.error)
    return found


def discovery_warning(found: Discovery) -> str | None:
    """What the scheduler warns about its devices at start, or None."""
    if found.error is not None and found.devices:
        return (
            f"no NVML ({found.error}): {len(found.devices)} GPU(s) and their sizes from the "
            "CUDA driver; memory claims are not cross-checked"
        )
    if found.error is not None:
        return (
            f"no NVIDIA GPU found through NVML ({found.error}): GPUs are learnt from the "
            "kernels that use one"
        )
    if not found.devices:
        return "no NVIDIA GPU found (NVML sees none): GPUs are learnt from the kernels that use one"
    return None


def nvml_pids_comparable() -> bool:
    """Whether NVML's pids are this process's (:func:`.nvml_check.pids_comparable`). Blocking."""
    try:
        with open("/proc/self/status", encoding="utf-8", errors="replace") as status:
            return pids_comparable(status.read())
    except OSError:
        return False


class UtilizationSampler:
    """Reads each GPU's utilisation (percent of time a kernel ran, over NVML's last sample).

    Device-wide utilisation says how busy the card is, for people to read; the scheduler never
    decides anything from it (it knows exactly who holds the device). NVML stays initialised
    between samples so a sample costs one query per device. Every method blocks: call them in an
    executor. ``sample`` never raises; a device NVML cannot read is left out.
    """

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: dict[str, Any] = {}

    def open(self) -> str | None:
        """Initialise NVML; returns why it cannot be used, or None."""
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:
            return f"NVML unavailable ({exc})"
        self._nvml = pynvml
        return None

    def _handle(self, uuid: str) -> Any:
        handle = self._handles.get(uuid)
        if handle is None:
            handle = self._handles[uuid] = self._nvml.nvmlDeviceGetHandleByUUID(uuid.encode())
        return handle

    def sample(self, uuids: list[str]) -> dict[str, int]:
        if self._nvml is None:
            return {}
        out: dict[str, int] = {}
        for uuid in uuids:
            try:
                out[uuid] = int(self._nvml.nvmlDeviceGetUtilizationRates(self._handle(uuid)).gpu)
            except Exception as exc:  # a device NVML does not know (e.g. learnt from a shim)
                log.debug("no utilisation for %s: %s", uuid, exc)
        return out

    def processes(self, uuids: list[str]) -> list[ProcessMemory]:
        """The compute processes NVML lists on each device with their memory there (for
        :mod:`.nvml_check`), each with the uid owning its pid in this ``/proc``. Never raises;
        a device NVML cannot read, or a process whose memory NVML does not give, is left out."""
        if self._nvml is None:
            return []
        out: list[ProcessMemory] = []
        for uuid in uuids:
            try:
                listed = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle(uuid))
            except Exception as exc:
                log.debug("no processes for %s: %s", uuid, exc)
                continue
            for proc in listed:
                used = getattr(proc, "usedGpuMemory", None)
                if not isinstance(used, int) or used < 0:
                    continue  # NVML_VALUE_NOT_AVAILABLE (None), e.g. without the permission
                try:
                    uid = os.stat(f"/proc/{int(proc.pid)}").st_uid
                except OSError:
                    uid = -1  # gone, or not in this pid namespace
                out.append(ProcessMemory(uuid.lower(), int(proc.pid), used, uid))
        return out

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
        self._nvml = None
        self._handles.clear()
