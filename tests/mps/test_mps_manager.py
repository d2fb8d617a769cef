"""The MPS manager (jupyter_gpushare/scheduler/features/mps.py) against the stand-in control binary:
daemons per GPU with their own directories and CUDA_VISIBLE_DEVICES, the client environment,
terminate_client, quitting, and clear errors when the binary is missing or the daemon fails."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from mps_helpers import command_names, commands, set_clients, sleeper, wait_gone, with_child

from jupyter_gpushare.scheduler.features.mps import (
    MPSError,
    MPSManager,
    find_control_binary,
    pinned_limit,
    thread_percentage,
)

GPU0 = "GPU-00000000-1111-2222-3333-444444444444"
GPU1 = "GPU-55555555-6666-7777-8888-999999999999"
MiB = 1 << 20
GiB = 1 << 30


def test_thread_percentage_follows_weight_or_an_explicit_share() -> None:
    assert thread_percentage(1.0, 100.0) is None  # the whole GPU: no variable at all
    assert thread_percentage(2.0, 100.0) is None
    assert thread_percentage(0.5, 100.0) == 50
    assert thread_percentage(1.0, 40.0) == 40
    assert thread_percentage(2.0, 40.0) == 80
    assert thread_percentage(3.0, 40.0) == 100  # capped, and said (the daemon default is 40)
    assert thread_percentage(0.001, 100.0) == 1  # never 0: MPS would refuse it
    assert thread_percentage(1.0, 100.0, compute_share=25) == 25
    assert thread_percentage(1.0, 100.0, compute_share=100) == 100
    assert thread_percentage(0.5, 100.0, compute_share=0) == 50  # 0 = from the weight
    with pytest.raises(ValueError):
        thread_percentage(0.0, 100.0)


def test_pinned_limit_rounds_up_to_whole_mib() -> None:
    assert pinned_limit(0) is None
    assert pinned_limit(8 * GiB) == "0=8192M"
    assert pinned_limit(8 * GiB + 1) == "0=8193M"
    assert pinned_limit(1) == "0=1M"


def test_find_control_binary(tmp_path: Path, stub_binary: Path) -> None:
    assert find_control_binary(str(stub_binary)) == str(stub_binary)
    assert find_control_binary(str(tmp_path / "nope")) is None
    assert find_control_binary(path=str(stub_binary.parent)) == str(stub_binary)
    # Not on PATH: the explicit name is looked up on PATH only.
    assert find_control_binary("nvidia-cuda-mps-control", path=str(tmp_path)) is None


async def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    manager = MPSManager(str(tmp_path), binary=str(tmp_path / "nvidia-cuda-mps-control"))
    with pytest.raises(MPSError, match="was not found"):
        await manager.start([GPU0])


async def test_daemon_per_gpu_env_terminate_and_quit(
    sock_dir: str, stub_binary: Path, children: list
) -> None:
    manager = MPSManager(sock_dir, binary=str(stub_binary), default_percentage=60)
    await manager.start([GPU0, GPU1])
    try:
        d0, d1 = manager.daemons[GPU0], manager.daemons[GPU1]
        # One daemon per GPU, each with its own pipe and log directories and only its GPU.
        assert d0.pipe_dir != d1.pipe_dir and d0.log_dir != d1.log_dir
        assert d0.pipe_dir.startswith(sock_dir) and os.path.isdir(d0.pipe_dir)
        assert d0.pid and d1.pid and d0.pid != d1.pid
        for d, uuid in ((d0, GPU0), (d1, GPU1)):
            start = commands(d.log_dir)[0]
            assert start["command"] == "-d" and start["visible"] == uuid
            # Every control command ran against this daemon's pipes with its GPU visible.
            assert {c["visible"] for c in commands(d.log_dir)} == {uuid}
            assert "set_default_active_thread_percentage" in command_names(d.log_dir)
            assert any(
                c["command"] == "set_default_active_thread_percentage 60"
                for c in commands(d.log_dir)
            )

        env = manager.client_env(GPU1, weight=1.0, quota_bytes=6 * GiB + 1)
        assert env == {
            "device": GPU1,
            "env": {
                "CUDA_MPS_PIPE_DIRECTORY": d1.pipe_dir,
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60",
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=6145M",
            },
            "unset": ["CUDA_VISIBLE_DEVICES"],
        }
        env = manager.client_env(GPU0, weight=1.0, compute_share=30)
        assert env["env"] == {
            "CUDA_MPS_PIPE_DIRECTORY": d0.pipe_dir,
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
        }
        with pytest.raises(MPSError, match="no MPS control daemon for device"):
            manager.client_env("GPU-unknown")

        # Clients: a kernel, its subprocess, and an unrelated process, all on GPU1's server.
        kernel = sleeper()
        children.append(kernel)
        other = sleeper()
        children.append(other)
        parent, grandchild = with_child()
        children.append(parent)
        set_clients(d1.pipe_dir, {4242: [kernel.pid, other.pid, parent.pid, grandchild]})
        assert await manager.server_pids(d1) == [4242]
        assert await manager.client_pids(d1, 4242) == [
            kernel.pid,
            other.pid,
            parent.pid,
            grandchild,
        ]

        results = await manager.terminate_process(parent.pid, tree=True)
        assert sorted(r["client"] for r in results) == sorted([parent.pid, grandchild])
        assert all(r["ok"] and r["server"] == 4242 for r in results), results
        done = [c for c in commands(d1.log_dir) if c["command"].startswith("terminate_client")]
        assert [c["command"] for c in done] == [
            f"terminate_client 4242 {parent.pid}",
            f"terminate_client 4242 {grandchild}",
        ]
        assert await manager.client_pids(d1, 4242) == [kernel.pid, other.pid]
        os.kill(grandchild, signal.SIGKILL)

        results = await manager.terminate_process(kernel.pid, tree=False)
        assert [r["client"] for r in results] == [kernel.pid] and results[0]["ok"]
        assert await manager.client_pids(d1, 4242) == [other.pid]
        # A process that is no client and has none below it: nothing to terminate.
        lone = sleeper()
        children.append(lone)
        assert await manager.terminate_process(lone.pid) == []
    finally:
        pids = [d.pid for d in manager.daemons.values()]
        logs = [d.log_dir for d in manager.daemons.values()]
        await manager.stop()
    assert manager.daemons == {}
    for pid, log in zip(pids, logs, strict=True):
        assert pid is not None and wait_gone(pid, 5)
        assert command_names(log)[-1] == "quit"


async def test_a_daemon_that_fails_to_start(
    sock_dir: str, stub_binary: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STUB_MPS_FAIL_START", "1")
    manager = MPSManager(sock_dir, binary=str(stub_binary))
    with pytest.raises(MPSError, match=r"did not start .*already running"):
        await manager.start([GPU0])
    assert manager.daemons == {}


async def test_a_daemon_left_running_is_replaced(sock_dir: str, stub_binary: Path) -> None:
    first = MPSManager(sock_dir, binary=str(stub_binary))
    await first.start([GPU0])
    old = first.daemons[GPU0].pid
    assert old is not None
    # The scheduler died without quitting: a new one takes over the same directories.
    second = MPSManager(sock_dir, binary=str(stub_binary))
    await second.start([GPU0])
    try:
        assert wait_gone(old, 5)
        assert second.daemons[GPU0].pid not in (None, old)
    finally:
        await second.stop()


async def test_failed_terminate_is_reported(
    sock_dir: str, stub_binary: Path, children: list
) -> None:
    manager = MPSManager(sock_dir, binary=str(stub_binary))
    await manager.start([GPU0])
    try:
        d = manager.daemons[GPU0]
        proc = sleeper()
        children.append(proc)
        # The stand-in answers an error for a pid that is not a client of that server.
        result = await manager.terminate_client(d, 4242, proc.pid)
        assert not result["ok"] and "not a client" in result["stdout"]
    finally:
        await manager.stop()
