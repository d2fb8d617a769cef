"""The provisioner in MPS mode, against a scheduler running the stand-in control binary: the
kernel's MPS environment at launch, and terminate_client before every SIGKILL (the kill waits for
it; the process is still alive when terminate_client runs)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from mps_helpers import commands, set_clients, sleeper, with_child
from test_mps_scheduler import GPU0, start

from jupyter_gpushare.provisioner import GPUShareProvisioner
from jupyter_gpushare.scheduler.shell.server import GPUShareScheduler

GiB = 1 << 30


def provisioner(sock: str, **traits: Any) -> GPUShareProvisioner:
    from jupyter_client.kernelspec import KernelSpec

    spec = KernelSpec(argv=["python", "-c", "pass"], display_name="t", language="python")
    return GPUShareProvisioner(kernel_id="k-mps", kernel_spec=spec, socket=sock, **traits)


@pytest.fixture
async def mps_scheduler(sock_dir: str, stub_binary: Path) -> Any:
    sched = await start(sock_dir, mps=True, mps_devices=[GPU0], mps_control_binary=str(stub_binary))
    try:
        yield sched
    finally:
        await sched.stop()


async def test_launch_environment(mps_scheduler: GPUShareScheduler) -> None:
    assert mps_scheduler._mps is not None
    pipe = mps_scheduler._mps.daemons[GPU0].pipe_dir
    prov = provisioner(mps_scheduler.socket_path, weight=0.5)
    env = {"CUDA_VISIBLE_DEVICES": "1", "GPUSHARE_MEMORY_LIMIT": str(2 * GiB), "HOME": "/h"}
    await prov._mps_environment(env, 2 * GiB)
    assert env == {
        "GPUSHARE_MEMORY_LIMIT": str(2 * GiB),
        "HOME": "/h",
        "CUDA_MPS_PIPE_DIRECTORY": pipe,
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M",
    }
    assert prov._mps_device == GPU0

    prov = provisioner(mps_scheduler.socket_path, compute_share=30.0)
    env = {}
    await prov._mps_environment(env, 0)
    assert env == {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}

    prov = provisioner(mps_scheduler.socket_path, mps=False)
    env = {"CUDA_VISIBLE_DEVICES": "1"}
    await prov._mps_environment(env, 0)
    assert env == {"CUDA_VISIBLE_DEVICES": "1"} and prov._mps_device is None


async def test_no_mps_without_scheduler_or_mps_mode(sock_dir: str) -> None:
    prov = provisioner(os.path.join(sock_dir, "none.sock"))
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    await prov._mps_environment(env, 0)
    assert env == {"CUDA_VISIBLE_DEVICES": "0"} and prov._mps_device is None
    sched = await start(sock_dir)
    try:
        prov = provisioner(sched.socket_path)
        await prov._mps_environment(env, 0)
        assert env == {"CUDA_VISIBLE_DEVICES": "0"} and prov._mps_device is None
    finally:
        await sched.stop()


async def test_terminate_client_before_sigkill(
    mps_scheduler: GPUShareScheduler, children: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert mps_scheduler._mps is not None
    daemon = mps_scheduler._mps.daemons[GPU0]
    # The kernel, and a subprocess of it (both MPS clients), in their own process group.
    kernel, child = with_child(start_new_session=True)
    children.append(kernel)
    bystander = sleeper()
    children.append(bystander)
    set_clients(daemon.pipe_dir, {900: [kernel.pid, child, bystander.pid]})
    # terminate_client takes a while: the SIGKILL must wait for it.
    monkeypatch.setenv("STUB_MPS_TERMINATE_SECONDS", "0.3")

    prov = provisioner(mps_scheduler.socket_path, kill_grace_seconds=0.0)
    await prov._mps_environment({}, 0)
    prov.process = kernel
    prov.pid = kernel.pid
    prov.pgid = os.getpgid(kernel.pid)
    t0 = time.time()
    await prov.kill()
    assert kernel.wait(10) == -signal.SIGKILL
    killed_at = time.time()

    terms = [c for c in commands(daemon.log_dir) if c["command"].startswith("terminate_client")]
    assert sorted(c["command"] for c in terms) == sorted(
        [f"terminate_client 900 {kernel.pid}", f"terminate_client 900 {child}"]
    )
    for c in terms:
        # Asked while the process was alive, after kill() began and before the SIGKILL ended it.
        assert all(c["alive"].values()), c
        assert t0 <= c["t"] < killed_at
    assert killed_at - t0 >= 0.6, "the SIGKILL did not wait for both terminate_client"
    assert bystander.poll() is None  # never touched: not the kernel's


async def test_sigkill_goes_ahead_when_the_scheduler_is_gone(
    sock_dir: str, stub_binary: Path, children: list
) -> None:
    sched = await start(sock_dir, mps=True, mps_devices=[GPU0], mps_control_binary=str(stub_binary))
    prov = provisioner(sched.socket_path, kill_grace_seconds=0.0)
    await prov._mps_environment({}, 0)
    assert prov._mps_device == GPU0
    await sched.stop()
    proc = sleeper()
    children.append(proc)
    prov.process = proc
    prov.pid = proc.pid
    prov.pgid = None
    await prov.kill()
    assert proc.wait(10) == -signal.SIGKILL


async def test_a_real_kernel_is_an_mps_client_and_terminated_before_its_kill(
    harness: Any, kernels: Any, stub_binary: Path
) -> None:
    """An ipykernel started by jupyter_client through the provisioner, the scheduler in MPS mode
    on the socket the server would use."""
    from provisioner_helpers import execute

    sched = await start(
        str(harness.sock_dir),
        socket_path=str(harness.socket_path),
        mps=True,
        mps_devices=[GPU0],
        mps_control_binary=str(stub_binary),
    )
    try:
        assert sched._mps is not None
        daemon = sched._mps.daemons[GPU0]
        env = kernels.kernel_env(CUDA_VISIBLE_DEVICES="0")
        km, kc = await kernels.start(
            {"compute_share": 40, "memory_limit": "1GiB", "kill_grace_seconds": 0}, env=env
        )
        cell = await execute(
            kc,
            "import os, json\nprint(json.dumps({k: v for k, v in os.environ.items()"
            " if k.startswith('CUDA_')}))",
        )
        assert cell.ok().json() == {
            "CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_dir,
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1024M",
        }
        pid = km.provisioner.process.pid
        set_clients(daemon.pipe_dir, {321: [pid]})
        await km.shutdown_kernel(now=True)
        terms = [c for c in commands(daemon.log_dir) if "terminate_client" in c["command"]]
        assert [c["command"] for c in terms] == [f"terminate_client 321 {pid}"]
        assert terms[0]["alive"] == {str(pid): True}
    finally:
        await sched.stop()
