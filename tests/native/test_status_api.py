"""The shim's public status API (native/include/gpushare.h), as a program under the shim sees it,
and its Python twin (jupyter_gpushare/shim.py's cffi declarations)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jupyter_gpushare import __version__
from jupyter_gpushare.shim import CDEF

MiB = 1 << 20
UUID = "GPU-01234567-89ab-cdef-0123-456789abcdef"
HEADER = Path(__file__).resolve().parents[2] / "native" / "include" / "gpushare.h"


def test_status_fields_without_a_scheduler(harness):
    run = harness.run(
        "status",
        MiB,
        context_bytes=64 * MiB,
        client_id="kernel-123",
        extra={"GPUSHARE_FAKE_UUID": UUID},
    ).ok()
    e = run.event("status")
    assert e["library_version"] == __version__
    assert e["small_rc"] == -1, "a too small buffer must be refused"
    assert e["null_rc"] == -1, "a NULL buffer must be refused"
    st = e["status"]
    assert st["rc"] == 0
    assert st["version"] == 3
    assert st["state"] == "unshared"
    assert st["connected"] == 0
    assert st["evicted"] == 0
    # The 1 MiB allocation is sub-allocated from a 2 MiB physical chunk: the card holds 2 MiB,
    # and that is what is counted.
    assert st["used_bytes"] == 66 * MiB
    assert st["managed_bytes"] == 2 * MiB
    assert st["pinned_bytes"] == 64 * MiB
    assert st["evicted_bytes"] == 0
    assert st["quota_bytes"] == 0
    assert st["gated_calls"] == 1
    assert st["waits"] == 0 and st["wait_seconds"] == 0 and st["current_wait_seconds"] == 0
    assert st["restores"] == 0 and st["last_restore_bytes"] == 0
    # Since its last gated call (the synchronise just before the status), so no longer than the
    # program has run: not a time since boot or since the epoch, nor a negative one.
    assert 0 <= st["idle_seconds"] <= e["t_mono"] - run.event("start")["t_mono"], (st, e)
    assert st["client_id"] == "kernel-123"
    assert st["socket_path"] == str(harness.socket_path)
    assert st["device_uuid"].lower() == UUID.lower()


def test_default_client_id_is_the_pid(harness):
    run = harness.run("status").ok()
    e = run.event("status")
    assert e["status"]["client_id"] == f"pid-{e['pid']}"


def test_quota_shows_in_status(harness):
    run = harness.run("status", memory_limit="2GiB").ok()
    assert run.event("status")["status"]["quota_bytes"] == 2 << 30


def _normalise(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r"\s+", " ", text).strip()


def _declarations(text: str) -> dict[str, str]:
    """The struct, the enum and the three prototypes of the status API, normalised."""
    t = _normalise(text)
    out = {}
    for name, pattern in {
        "struct": r"struct gpushare_status \{[^}]*\};",
        "enum": r"enum gpushare_state \{[^}]*\};",
        "get_status": r"int gpushare_get_status\([^)]*\);",
        "release": r"int gpushare_release\([^)]*\);",
        "version": r"const char \*gpushare_version\([^)]*\);",
        "status_version": r"#define GPUSHARE_STATUS_VERSION \d+",
    }.items():
        m = re.search(pattern, t)
        assert m, f"{name} not found"
        out[name] = re.sub(r"\s*([{};,()*])\s*", r"\1", m.group(0))
    return out


def test_python_declarations_match_the_header():
    assert _declarations(CDEF) == _declarations(HEADER.read_text())


@pytest.mark.parametrize("field", ["client_id", "socket_path", "device_uuid"])
def test_header_string_sizes(field):
    sizes = {"client_id": 128, "socket_path": 108, "device_uuid": 48}
    assert f"char {field}[{sizes[field]}];" in _normalise(HEADER.read_text())
