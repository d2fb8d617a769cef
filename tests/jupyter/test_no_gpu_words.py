"""Without a GPU, the server log says "no NVIDIA GPU found" in those words: once from the
provisioner (not a coded error per kernel start), and from the scheduler when NVML finds none."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from jupyter_client.kernelspec import KernelSpec

from jupyter_gpushare import provisioner as provisioner_module
from jupyter_gpushare.provisioner import PROVISIONER_NAME, GPUShareProvisioner


def _spec() -> KernelSpec:
    return KernelSpec(
        argv=["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        display_name="t",
        language="python",
        metadata={"kernel_provisioner": {"provisioner_name": PROVISIONER_NAME, "config": {}}},
    )


async def test_kernel_starts_say_no_gpu_once(
    harness: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    sched = harness.scheduler()  # no NVML, and no kernel has reported a GPU yet
    monkeypatch.setattr(provisioner_module, "_said_no_gpu", False)
    caplog.set_level(logging.DEBUG)
    log = logging.getLogger("test-prov")
    for kid in ("k1", "k2", "k3"):
        prov = GPUShareProvisioner(
            kernel_id=kid, kernel_spec=_spec(), socket=str(harness.socket_path)
        )
        prov.log = log
        env: dict[str, str] = {}
        await prov._place(env)
        assert env == {} and prov.placement is None
    said = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert [r.getMessage() for r in said] == [
        "gpushare: no NVIDIA GPU found (the scheduler knows none yet): kernels start without a "
        "GPU placement, and a GPU that a kernel finds is learnt from it"
    ]
    assert "not_found" not in caplog.text
    assert "gpushare: no NVIDIA GPU found through NVML (" in sched.log, sched.log


# ---------------------------------------------------------------------------------------------
# The magic's words before any GPU call, and without a GPU (issue 23, item 6)


def _libcuda_missing() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return True
    return False


def test_status_before_any_gpu_call_says_so() -> None:
    from jupyter_gpushare.magic import GPUShareReport

    status = {"state": "inactive", "used_bytes": 0, "client_id": "", "connected": False}
    text = repr(GPUShareReport(status, None, None, "no answer"))
    assert "all resident on the GPU" not in text
    assert "nothing allocated on the GPU" in text
    [kernel] = [line for line in text.splitlines() if line.strip().startswith("kernel")]
    assert kernel.split("kernel", 1)[1].strip(), f"an empty kernel row: {kernel!r}"


@pytest.mark.skipif(not _libcuda_missing(), reason="this machine has an NVIDIA driver")
def test_without_scheduler_or_driver_the_magic_says_no_gpu(tmp_path: Any) -> None:
    """As under `jupyter execute` on a machine without a GPU: no server, so no scheduler."""
    from jupyter_gpushare.scheduler_view import find_own_entry

    entry, device, note = find_own_entry({"socket_path": str(tmp_path / "none.sock")})
    assert entry is None and device is None
    assert note and note.startswith("no NVIDIA GPU found ("), note


def test_release_before_any_gpu_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from jupyter_gpushare import magic

    monkeypatch.setattr(magic.shim, "release", lambda: False)
    monkeypatch.setattr(magic.shim, "read_status", lambda: {"state": "inactive"})
    text = magic.gpushare_command("release")
    assert isinstance(text, str) and "not connected" not in text, text
    assert text.startswith("gpushare: nothing to release: "), text
    monkeypatch.setattr(magic.shim, "read_status", lambda: {"state": "idle"})
    assert "does not hold the GPU now" in str(magic.gpushare_command("release"))
