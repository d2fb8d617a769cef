"""The Python side of ``libgpushare.so``: where it is, how to run a process under it, its status.

* :func:`library_path` finds the shim (shipped in ``jupyter_gpushare/lib/``, or
  ``$GPUSHARE_LIBRARY``).
* :func:`shim_environment` makes the environment a process needs to run under the shim (the
  provisioner and ``gpushare run`` use it).
* :func:`read_status` asks the shim *in this process* what it is doing, through cffi in ABI mode
  (no compiler): the ``%gpushare`` magic runs inside the kernel, where the shim is preloaded.
* :func:`in_process` says whether the shim is there at all, without cffi: importing cffi and
  parsing :data:`CDEF` costs about 13 ms in a kernel (35 ms in a bare interpreter, 2 cores),
  which a kernel's start must not pay.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .units import BARE_NUMBER_FLOOR, parse_size

__all__ = [
    "CDEF",
    "STATES",
    "ShimNotFound",
    "in_process",
    "library_path",
    "read_status",
    "release",
    "shim_environment",
    "shim_version",
]

LIBRARY_NAME = "libgpushare.so"

#: The declarations of native/include/gpushare.h, as cffi's cdef() takes them
#: (tests/native/test_status_api.py checks that the two agree).
CDEF = """
#define GPUSHARE_STATUS_VERSION 3

enum gpushare_state {
    GPUSHARE_STATE_INACTIVE = 0,
    GPUSHARE_STATE_UNSHARED = 1,
    GPUSHARE_STATE_IDLE = 2,
    GPUSHARE_STATE_WAITING = 3,
    GPUSHARE_STATE_HOLDING = 4,
    GPUSHARE_STATE_RELEASING = 5,
    GPUSHARE_STATE_ASLEEP = 6
};

struct gpushare_status {
    uint32_t version;
    uint32_t state;
    uint32_t connected;
    uint32_t evicted;
    uint64_t used_bytes;
    uint64_t managed_bytes;
    uint64_t pinned_bytes;
    uint64_t evicted_bytes;
    uint64_t quota_bytes;
    uint64_t pool_bytes;
    uint64_t gated_calls;
    uint64_t waits;
    double wait_seconds;
    double current_wait_seconds;
    double holding_seconds;
    double idle_seconds;
    char client_id[128];
    char socket_path[108];
    char device_uuid[48];
    uint64_t precopied_bytes;
    uint64_t staging_pinned_bytes;
    uint64_t staging_pageable_bytes;
    uint64_t staging_fallbacks;
    uint64_t restores;
    uint64_t last_restore_bytes;
    double last_restore_seconds;
};

int gpushare_get_status(struct gpushare_status *out, size_t size);
int gpushare_release(void);
const char *gpushare_version(void);
"""

#: enum gpushare_state -> the name read_status() reports.
STATES = {
    0: "inactive",
    1: "unshared",
    2: "idle",
    3: "waiting",
    4: "holding",
    5: "releasing",
    6: "asleep",
}


class ShimNotFound(FileNotFoundError):
    """libgpushare.so is not where it should be."""


def library_path() -> str:
    """Absolute path of libgpushare.so: ``$GPUSHARE_LIBRARY``, else the one in the package."""
    override = os.environ.get("GPUSHARE_LIBRARY")
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise ShimNotFound(f"GPUSHARE_LIBRARY={override}: no such file")
        return str(path.resolve())
    path = Path(__file__).resolve().parent / "lib" / LIBRARY_NAME
    if not path.is_file():
        raise ShimNotFound(
            f"{LIBRARY_NAME} is missing from {path.parent}: reinstall jupyter-gpushare "
            "(`pip install .` compiles it), build it with "
            f"`python native/build.py shim {path}`, or point GPUSHARE_LIBRARY at a built copy"
        )
    return str(path)


def _preload_entries(value: str) -> list[str]:
    # ld.so separates LD_PRELOAD entries with colons and/or whitespace.
    return [entry for entry in re.split(r"[:\s]+", value) if entry]


def shim_environment(
    env: Mapping[str, str] | None = None,
    *,
    socket: str | None = None,
    client_id: str | None = None,
    quota: int | str | None = None,
    weight: float | None = None,
    user: str | None = None,
    label: str | None = None,
    library: str | None = None,
) -> dict[str, str]:
    """A copy of ``env`` (default: ``os.environ``) that runs a process under the shim.

    The shim is *appended* to ``LD_PRELOAD`` (libraries already preloaded stay first, and the shim
    is not added twice). Each keyword that is not None sets its ``GPUSHARE_*`` variable; ``quota``
    takes bytes or a size such as ``"8GiB"`` and is written in bytes.
    """
    out = dict(os.environ if env is None else env)
    lib = library or library_path()
    entries = _preload_entries(out.get("LD_PRELOAD", ""))
    resolved = {os.path.realpath(e) for e in entries if os.path.isabs(e)}
    if lib not in entries and os.path.realpath(lib) not in resolved:
        entries.append(lib)
    out["LD_PRELOAD"] = ":".join(entries)
    if socket is not None:
        out["GPUSHARE_SOCKET"] = str(socket)
    if client_id is not None:
        out["GPUSHARE_CLIENT_ID"] = str(client_id)
    if quota is not None:
        quota_bytes = parse_size(quota)
        # Bytes, with the unit spelt out below BARE_NUMBER_FLOOR, where the shim (as
        # parse_memory_size) takes a bare number for a forgotten unit.
        unit = "B" if 0 < quota_bytes < BARE_NUMBER_FLOOR else ""
        out["GPUSHARE_MEMORY_LIMIT"] = f"{quota_bytes}{unit}"
    if weight is not None:
        if not weight > 0:
            raise ValueError(f"weight must be positive, got {weight!r}")
        out["GPUSHARE_WEIGHT"] = repr(float(weight))
    if user is not None:
        out["GPUSHARE_USER"] = str(user)
    if label is not None:
        out["GPUSHARE_LABEL"] = str(label)
    return out


# --------------------------------------------------------------------------------------------
# The in-process status API (cffi ABI mode)

_ffi: Any = None
_lib: Any = None


def in_process() -> bool:
    """Whether this process has the shim loaded (its status API is in the global scope).

    A symbol lookup through ctypes (which ipykernel has imported already), not cffi: the wait
    line checks this while the kernel starts, and cffi's first ``cdef()`` (pycparser's import
    and parse) takes about 13 ms there; the first status read pays it instead. The cffi
    library is made only once this holds, so its symbols are there.
    """
    import ctypes

    return hasattr(ctypes.CDLL(None), "gpushare_get_status")


def _process_library() -> tuple[Any, Any] | None:
    """(ffi, lib) for the shim loaded in this process, or None when it is not."""
    global _ffi, _lib
    if _lib is None:
        if not in_process():
            return None
        from cffi import FFI

        ffi = FFI()
        ffi.cdef(CDEF)
        # dlopen(NULL): the global scope of this process, where an LD_PRELOADed shim lives.
        _ffi, _lib = ffi, ffi.dlopen(None)
    return _ffi, _lib


def read_status() -> dict[str, Any] | None:
    """What the shim in this process is doing, or None when the process is not under the shim."""
    loaded = _process_library()
    if loaded is None:
        return None
    ffi, lib = loaded
    status = ffi.new("struct gpushare_status *")
    if lib.gpushare_get_status(status, ffi.sizeof("struct gpushare_status")) != 0:
        return None
    return {
        "version": int(status.version),
        "state": STATES.get(int(status.state), str(int(status.state))),
        "connected": bool(status.connected),
        "evicted": bool(status.evicted),
        "used_bytes": int(status.used_bytes),
        "managed_bytes": int(status.managed_bytes),
        "pinned_bytes": int(status.pinned_bytes),
        "evicted_bytes": int(status.evicted_bytes),
        "quota_bytes": int(status.quota_bytes),
        "pool_bytes": int(status.pool_bytes),
        "gated_calls": int(status.gated_calls),
        "waits": int(status.waits),
        "wait_seconds": float(status.wait_seconds),
        "current_wait_seconds": float(status.current_wait_seconds),
        "holding_seconds": float(status.holding_seconds),
        "idle_seconds": float(status.idle_seconds),
        "client_id": ffi.string(status.client_id).decode("utf-8", "replace"),
        "socket_path": ffi.string(status.socket_path).decode("utf-8", "replace"),
        "device_uuid": ffi.string(status.device_uuid).decode("utf-8", "replace"),
        "precopied_bytes": int(status.precopied_bytes),
        "staging_pinned_bytes": int(status.staging_pinned_bytes),
        "staging_pageable_bytes": int(status.staging_pageable_bytes),
        "staging_fallbacks": int(status.staging_fallbacks),
        "restores": int(status.restores),
        "last_restore_bytes": int(status.last_restore_bytes),
        "last_restore_seconds": float(status.last_restore_seconds),
        "library_version": shim_version(),
    }


def release() -> bool | None:
    """Hand the device back now (``%gpushare release``): True when released, False when there is
    no scheduler connection, None when the process is not under the shim."""
    loaded = _process_library()
    if loaded is None:
        return None
    return bool(loaded[1].gpushare_release() == 0)


def shim_version() -> str | None:
    loaded = _process_library()
    if loaded is None:
        return None
    ffi, lib = loaded
    try:
        ptr = lib.gpushare_version()
    except AttributeError:
        return None
    return None if ptr == ffi.NULL else ffi.string(ptr).decode("utf-8", "replace")
