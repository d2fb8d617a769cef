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
