"""jupyter_gpushare.shim: finding the library, the environment of a shimmed process, status API."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jupyter_gpushare import shim
from jupyter_gpushare.shim import ShimNotFound, library_path, shim_environment

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def lib(tmp_path: Path) -> str:
    path = tmp_path / "libgpushare.so"
    path.write_bytes(b"")
    return str(path)


def test_ld_preload_is_appended_not_overwritten(lib: str) -> None:
    env = {"LD_PRELOAD": "/opt/libfirst.so", "PATH": "/bin"}
    out = shim_environment(env, socket="/tmp/s.sock", library=lib)
    assert out["LD_PRELOAD"] == f"/opt/libfirst.so:{lib}"
    assert out["GPUSHARE_SOCKET"] == "/tmp/s.sock"
    assert out["PATH"] == "/bin"
    assert env == {"LD_PRELOAD": "/opt/libfirst.so", "PATH": "/bin"}  # not mutated


def test_ld_preload_without_duplicates(lib: str) -> None:
    once = shim_environment({}, socket="/s", library=lib)
    assert once["LD_PRELOAD"] == lib
    twice = shim_environment(once, socket="/s", library=lib)
    assert twice["LD_PRELOAD"] == lib
    # Whitespace separators (ld.so accepts them) are normalised; an equivalent path is detected.
    mixed = {"LD_PRELOAD": f"/a.so  /b.so:{os.path.dirname(lib)}/./libgpushare.so"}
    assert shim_environment(mixed, library=lib)["LD_PRELOAD"] == (
        f"/a.so:/b.so:{os.path.dirname(lib)}/./libgpushare.so"
    )
    assert shim_environment({"LD_PRELOAD": ""}, library=lib)["LD_PRELOAD"] == lib


def test_gpushare_variables(lib: str) -> None:
    out = shim_environment(
        {"GPUSHARE_LABEL": "old"},
        socket="/run/gpushare/scheduler.sock",
        client_id="kernel-123",
        quota="8GiB",
        weight=2,
        user="alice",
        label="train.ipynb",
        library=lib,
    )
    assert out["GPUSHARE_CLIENT_ID"] == "kernel-123"
    assert out["GPUSHARE_MEMORY_LIMIT"] == str(8 << 30)
    assert out["GPUSHARE_WEIGHT"] == "2.0"
    assert out["GPUSHARE_USER"] == "alice"
    assert out["GPUSHARE_LABEL"] == "train.ipynb"
    # Unset keywords leave the environment alone.
    out = shim_environment({"GPUSHARE_SOCKET": "/keep"}, library=lib)
    assert out["GPUSHARE_SOCKET"] == "/keep" and "GPUSHARE_MEMORY_LIMIT" not in out


def test_bad_values(lib: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        shim_environment({}, quota="huge", library=lib)
    with pytest.raises(ValueError, match="positive"):
        shim_environment({}, weight=0, library=lib)


def test_library_path_override(lib: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSHARE_LIBRARY", lib)
    assert library_path() == str(Path(lib).resolve())
    assert shim_environment({})["LD_PRELOAD"] == str(Path(lib).resolve())
    monkeypatch.setenv("GPUSHARE_LIBRARY", lib + ".missing")
    with pytest.raises(ShimNotFound, match=r"GPUSHARE_LIBRARY=.*no such file"):
        library_path()


def test_library_path_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUSHARE_LIBRARY", raising=False)
    monkeypatch.setattr(shim, "__file__", str(tmp_path / "shim.py"))
    with pytest.raises(ShimNotFound) as info:
        library_path()
    assert "libgpushare.so is missing" in str(info.value)
    assert "native/build.py" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libgpushare.so").write_bytes(b"")
    assert library_path() == str(tmp_path / "lib" / "libgpushare.so")


def test_status_api_outside_the_shim() -> None:
    assert shim.read_status() is None
    assert shim.release() is None
    assert shim.shim_version() is None


def _normalise(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return " ".join(text.split())


def test_cdef_repeats_the_header() -> None:
    header = (ROOT / "native" / "include" / "gpushare.h").read_text()
    start = header.index("#define GPUSHARE_STATUS_VERSION")
    end = header.index("#ifdef __cplusplus", start)
    assert _normalise(header[start:end]) == _normalise(shim.CDEF)


def _built_shim() -> str | None:
    try:
        return library_path()
    except ShimNotFound:
        return None


@pytest.mark.skipif(_built_shim() is None, reason="libgpushare.so is not built")
def test_status_api_under_the_shim() -> None:
    code = (
        "import json; from jupyter_gpushare.shim import read_status; "
        "s = read_status(); print(json.dumps(s))"
    )
    env = shim_environment(os.environ, socket="/nonexistent/s.sock", client_id="probe")
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout.strip().splitlines()[-1])
    assert status is not None
    assert status["state"] in ("inactive", "unshared")
    assert status["version"] == 3
    assert status["staging_fallbacks"] == 0 and status["precopied_bytes"] == 0
