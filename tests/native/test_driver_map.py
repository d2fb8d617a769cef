"""The stand-in driver answers cuGetProcAddress the way the real one does.

tests/data/driver580_procaddr.txt was read off a real driver (see its header). The CI layer is only
worth as much as the stand-in's fidelity: if the stand-in handed out, say, cuCtxCreate_v3 where
the real driver hands out cuCtxCreate_v4, the shim's pointer-identity mapping would be tested
against the wrong variant. Every answer the real driver gave for a name the shim hooks must be the
stand-in's answer too.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data" / "driver580_procaddr.txt"


def real_driver_answers() -> list[tuple[str, int, int, str]]:
    rows = []
    for line in DATA.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        base, version, flags, symbol = line.split()
        rows.append((base, int(version), int(flags), symbol))
    return rows


def test_the_recorded_map_is_complete() -> None:
    rows = real_driver_answers()
    assert len(rows) > 200
    # Every answer matched one exported symbol on the real driver; "-" would mean none did.
    assert all(symbol != "-" for *_, symbol in rows)


def test_stand_in_gives_the_real_drivers_variant(native_build, hooked_exports) -> None:
    lib = ctypes.CDLL(str(native_build.fake_dir / "libcuda.so.1"))
    get = lib.cuGetProcAddress_v2
    get.restype = ctypes.c_int
    get.argtypes = [
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_int,
        ctypes.c_uint64,
        ctypes.POINTER(ctypes.c_int),
    ]
    checked, mismatches = 0, []
    for base, version, flags, symbol in real_driver_answers():
        if symbol not in hooked_exports:
            continue  # the stand-in implements what the shim hooks, not the whole driver
        pfn, status = ctypes.c_void_p(), ctypes.c_int(-1)
        rc = get(base.encode(), ctypes.byref(pfn), version, flags, ctypes.byref(status))
        if rc != 0 and not hasattr(lib, symbol):
            continue  # a hooked path the stand-in does not implement at all (e.g. 2D copies)
        expected = (
            ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
            if hasattr(lib, symbol)
            else None
        )
        if rc != 0 or status.value != 0 or expected is None or pfn.value != expected:
            mismatches.append(f"{base} v{version} flags={flags}: want {symbol}")
        checked += 1
    assert checked > 100, f"only {checked} recorded answers concern hooked names"
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.parametrize("base", ["cuMemAlloc", "cuLaunchKernel", "cuMemcpyHtoDAsync"])
def test_hooked_bases_are_in_the_recorded_map(base: str) -> None:
    assert any(row[0] == base for row in real_driver_answers())
