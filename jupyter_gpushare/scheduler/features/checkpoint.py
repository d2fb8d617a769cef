"""The driver's process checkpoint API (CUDA 12.8+), called from the scheduler on a kernel's pid.

``cuCheckpointProcessLock`` blocks the target's CUDA calls and waits for its work to finish;
``cuCheckpointProcessCheckpoint`` copies its device memory to host memory and releases every
device resource, its context included (the process then holds 0 bytes of the GPU);
``cuCheckpointProcessRestore`` brings them back at the same addresses and
``cuCheckpointProcessUnlock`` lets its CUDA calls run again. Each takes the pid and a pointer to a
64-byte argument struct (reserved fields zero; the lock's first field is a timeout in ms).

Every call blocks (seconds for gigabytes): the scheduler runs them in a thread executor, never on
its event loop (:mod:`.sleeping`). The driver checks permissions as ptrace does, and then opens
what the target holds: the scheduler calls it itself only as the kernel's own user or with both
CAP_SYS_PTRACE and CAP_DAC_OVERRIDE (root's; on an H200, driver 580.159.04, either one alone was
refused with 304, docs/gpu-verification.md 2026-12-02 (d)) (:func:`may_checkpoint`); otherwise a
process of the kernel's user makes the calls for it (:mod:`.checkpoint_agent`).
The library is ``c.GPUShareScheduler.checkpoint_library`` (``libcuda.so.1``; CI points it at the
stand-in driver, which models the API, see native/tests/fake_checkpoint.c).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from dataclasses import dataclass

__all__ = [
    "CUDA_ERROR_NOT_SUPPORTED",
    "CheckpointAPI",
    "CheckpointError",
    "ProcessState",
    "may_checkpoint",
]

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_SUPPORTED = 801
_SYMBOLS = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
)


class ProcessState:
    """CUprocessState."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class _LockArgs(ctypes.Structure):
    # CUcheckpointLockArgs: timeoutMs (0: none), reserved0, reserved1[7]
    _fields_ = [
        ("timeoutMs", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class _Reserved64(ctypes.Structure):
    # CUcheckpointCheckpointArgs / RestoreArgs (no GPU remapping) / UnlockArgs: all zero.
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


#: What the driver's refusals mean, in the words a log reader needs.
_MEANINGS = {
    800: "CUDA_ERROR_NOT_PERMITTED: EPERM, the driver checks the caller as ptrace does: "
    "root or the process's own user",
    801: "CUDA_ERROR_NOT_SUPPORTED",
}


class CheckpointError(Exception):
    """A checkpoint call failed; ``code`` is its CUresult (801: the driver does not support it)."""

    def __init__(self, call: str, code: int) -> None:
        why = _MEANINGS.get(code, "")
        super().__init__(f"{call} failed: CUDA error {code}" + (f" ({why})" if why else ""))
        self.call = call
        self.code = code


#: The bits in /proc/self/status's CapEff of the two capabilities that checkpointing another
#: user's process needs (measured: check_sandbox.py --bisect, docs/gpu-verification.md).
CAP_DAC_OVERRIDE = 1
CAP_SYS_PTRACE = 19
CHECKPOINT_OTHERS = (1 << CAP_SYS_PTRACE) | (1 << CAP_DAC_OVERRIDE)


@functools.cache
def effective_capabilities() -> int:
    """This process's effective capability mask (0 where /proc cannot tell); read once, since
    deep idle asks after every event and a running scheduler's capabilities do not change."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


def may_checkpoint(
    target_uid: int, own_euid: int | None = None, own_caps: int | None = None
) -> bool:
    """Whether the driver will let this process checkpoint one of ``target_uid``: the same user,
    or CAP_SYS_PTRACE and CAP_DAC_OVERRIDE together (the module says where that was measured).
    Root counts through its capabilities: a container's root with every capability dropped (the
    chart's, unless deep idle adds these two) may not. ``own_caps`` defaults to this process's
    effective set, or, with ``own_euid`` given, to that of an ordinary process of that uid (all
    for root, none otherwise)."""
    euid = os.geteuid() if own_euid is None else own_euid
    if target_uid >= 0 and euid == target_uid:
        return True
    if own_caps is None:
        own_caps = effective_capabilities() if own_euid is None else (-1 if euid == 0 else 0)
    return own_caps & CHECKPOINT_OTHERS == CHECKPOINT_OTHERS


@dataclass
class CheckpointAPI:
    """The four calls on one loaded driver library. :meth:`load` says why it cannot be had."""

    lib: ctypes.CDLL
    lock_timeout_ms: int = 10_000

    @classmethod
    def load(cls, path: str, lock_timeout_ms: int = 10_000) -> CheckpointAPI | str:
        """The API from ``path``, or why not (no library, a driver before 12.8, no cuInit)."""
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            return f"cannot load {path}: {exc}"
        missing = [name for name in _SYMBOLS if not hasattr(lib, name)]
        if missing:
            return f"{path} has no {', '.join(missing)} (a driver before CUDA 12.8)"
        for name in _SYMBOLS:
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p]
        init = getattr(lib, "cuInit", None)
        if init is not None:
            code = int(init(0))
            if code != CUDA_SUCCESS:
                return f"cuInit failed in the scheduler: CUDA error {code}"
        return cls(lib, lock_timeout_ms)

    def _call(self, name: str, pid: int, args: ctypes.Structure) -> None:
        code = int(getattr(self.lib, name)(int(pid), ctypes.byref(args)))
        if code != CUDA_SUCCESS:
            raise CheckpointError(name, code)

    def state(self, pid: int) -> int:
        out = ctypes.c_int(-1)
        self._call("cuCheckpointProcessGetState", pid, out)  # type: ignore[arg-type]
        return out.value

    def sleep(self, pid: int) -> None:
        """Lock, then checkpoint ``pid``. On failure the process is unlocked again (running)."""
        self._call("cuCheckpointProcessLock", pid, _LockArgs(timeoutMs=self.lock_timeout_ms))
        try:
            self._call("cuCheckpointProcessCheckpoint", pid, _Reserved64())
        except CheckpointError:
            # If even the unlock fails it stays locked: a wake's unlock is the next try.
            with contextlib.suppress(CheckpointError):
                self._call("cuCheckpointProcessUnlock", pid, _Reserved64())
            raise

    def wake(self, pid: int) -> None:
        """Restore (if checkpointed), then unlock ``pid`` (if locked): a wake after a sleep
        whose outcome is unknown (its agent was lost mid-call) puts back whatever was done."""
        state = self.state(pid)
        if state == ProcessState.RUNNING:
            return
        if state == ProcessState.CHECKPOINTED:
            self._call("cuCheckpointProcessRestore", pid, _Reserved64())
        self._call("cuCheckpointProcessUnlock", pid, _Reserved64())


#: One load per library path per process: the driver's library is loaded once anyway.
_loaded: dict[str, CheckpointAPI | str] = {}
_loaded_lock = threading.Lock()


def load_cached(path: str, lock_timeout_ms: int = 10_000) -> CheckpointAPI | str:
    """:meth:`CheckpointAPI.load`, once per ``path`` (blocking: call it in an executor)."""
    with _loaded_lock:
        if path not in _loaded:
            _loaded[path] = CheckpointAPI.load(path, lock_timeout_ms)
        return _loaded[path]
