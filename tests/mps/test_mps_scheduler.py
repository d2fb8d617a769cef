"""The scheduler in MPS mode (c.GPUShareScheduler.mps = True) with the stand-in control binary:
daemons started and quit with the scheduler, the mps_env and mps_terminate control actions, their
authorisation, MPS mode off, and a clear start error without the binary."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from mps_helpers import command_names, commands, set_clients, sleeper, wait_gone

from jupyter_gpushare.scheduler.shell.server import GPUShareScheduler, PeerCred, SchedulerStartError
from jupyter_gpushare.scheduler_client import SchedulerClient, SchedulerError

GPU0 = "GPU-00000000-1111-2222-3333-444444444444"
GPU1 = "GPU-55555555-6666-7777-8888-999999999999"
GiB = 1 << 30


class UidScheduler(GPUShareScheduler):
    """Every peer gets ``peer_uid`` when it is set (authorisation without a second account)."""

    peer_uid: int | None = None

    def peer_credentials(self, sock: Any) -> PeerCred:
        real = super().peer_credentials(sock)
        return real if self.peer_uid is None else PeerCred(real.pid, self.peer_uid, real.gid)


async def start(sock_dir: str, **kwargs: Any) -> UidScheduler:
    kwargs.setdefault("socket_path", os.path.join(sock_dir, "s.sock"))
    kwargs.setdefault("use_nvml", False)
    kwargs.setdefault("pool_size", "1GiB")
    sched = UidScheduler(**kwargs)
    await sched.start()
    return sched


async def test_mps_mode_env_terminate_and_stop(
    sock_dir: str, stub_binary: Path, children: list
) -> None:
    sched = await start(
        sock_dir,
        mps=True,
        mps_devices=[GPU0, GPU1],
        mps_control_binary=str(stub_binary),
        mps_default_thread_percentage=50,
    )
    client = SchedulerClient(sched.socket_path)
    try:
        assert sched._mps is not None
        daemons = dict(sched._mps.daemons)
        doc = await client.status()
        assert [d["device"] for d in doc["mps"]["daemons"]] == [GPU0, GPU1]
        for d in daemons.values():
            assert os.path.dirname(d.pipe_dir).startswith(sock_dir)

        reply = await client.control("mps_env", client="k1", weight=2.0, quota="3GiB", device=GPU1)
        assert reply == {
            "ok": True,
            "action": "mps_env",
            "enabled": True,
            "device": GPU1,
            "env": {
                "CUDA_MPS_PIPE_DIRECTORY": daemons[GPU1].pipe_dir,
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3072M",
            },
            "unset": ["CUDA_VISIBLE_DEVICES"],
        }
        # A huge weight is simply the whole GPU.
        reply = await client.control("mps_env", weight=1e300)
        assert reply["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
        reply = await client.control("mps_env", weight=1.0, compute_share=25)
        assert reply["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in reply["env"]
        for bad in ({"weight": 0}, {"weight": "x"}, {"weight": 1e999}, {"weight": True},
                    {"compute_share": 150}, {"compute_share": "x"}, {"quota": "lots"},
                    {"device": 3}):  # fmt: skip
            with pytest.raises(SchedulerError) as exc:
                await client.control("mps_env", **bad)
            assert exc.value.name == "bad_request", bad
        with pytest.raises(SchedulerError) as exc:
            await client.control("mps_env", device="GPU-nope")
        assert exc.value.name == "not_found"

        kernel = sleeper()
        children.append(kernel)
        set_clients(daemons[GPU0].pipe_dir, {777: [kernel.pid]})
        reply = await client.control("mps_terminate", pid=kernel.pid)
        assert reply["ok"] and reply["enabled"]
        assert [(r["server"], r["client"], r["ok"]) for r in reply["terminated"]] == [
            (777, kernel.pid, True)
        ]
        term = [c for c in commands(daemons[GPU0].log_dir) if "terminate_client" in c["command"]]
        assert [c["command"] for c in term] == [f"terminate_client 777 {kernel.pid}"]
        # Not a client (any more): nothing to do, still ok.
        reply = await client.control("mps_terminate", pid=kernel.pid)
        assert reply == {
            "ok": True, "action": "mps_terminate", "enabled": True, "pid": kernel.pid,
            "terminated": [],
        }  # fmt: skip
        for bad in ({}, {"pid": "12"}, {"pid": 1}, {"pid": True}):
            with pytest.raises(SchedulerError) as exc:
                await client.control("mps_terminate", **bad)
            assert exc.value.name == "bad_request", bad
        kernel.kill()
        kernel.wait(10)
        with pytest.raises(SchedulerError) as exc:
            await client.control("mps_terminate", pid=kernel.pid)
        assert exc.value.name == "not_found"
    finally:
        pids = {k: d.pid for k, d in (sched._mps.daemons.items() if sched._mps else [])}
        logs = {k: d.log_dir for k, d in (sched._mps.daemons.items() if sched._mps else [])}
        await sched.stop()
    # Stopping the scheduler quits every daemon.
    assert sched._mps is None
    for key, pid in pids.items():
        assert pid is not None and wait_gone(pid, 5), key
        assert command_names(logs[key])[-1] == "quit"


async def test_mps_terminate_is_authorised_by_the_peer_uid(
    sock_dir: str, stub_binary: Path, children: list
) -> None:
    sched = await start(sock_dir, mps=True, mps_devices=[GPU0], mps_control_binary=str(stub_binary))
    try:
        assert sched._mps is not None
        daemon = sched._mps.daemons[GPU0]
        kernel = sleeper()
        children.append(kernel)
        set_clients(daemon.pipe_dir, {777: [kernel.pid]})
        # The scheduler runs as someone else (no admin peer), and the peer does not own the pid.
        sched.own_uid = -5
        sched.peer_uid = os.getuid() + 1
        client = SchedulerClient(sched.socket_path)
        with pytest.raises(SchedulerError) as exc:
            await client.control("mps_terminate", pid=kernel.pid)
        assert exc.value.name == "forbidden"
        assert not [c for c in commands(daemon.log_dir) if "terminate" in c["command"]]
        sched.peer_uid = os.getuid()  # the kernel's own user
        reply = await client.control("mps_terminate", pid=kernel.pid)
        assert reply["ok"] and len(reply["terminated"]) == 1
    finally:
        await sched.stop()


async def test_mps_off_answers_disabled(sock_dir: str, children: list) -> None:
    sched = await start(sock_dir)
    try:
        client = SchedulerClient(sched.socket_path)
        assert await client.control("mps_env", client="k", weight=1.0) == {
            "ok": True,
            "action": "mps_env",
            "enabled": False,
        }
        proc = sleeper()
        children.append(proc)
        reply = await client.control("mps_terminate", pid=proc.pid)
        assert reply == {
            "ok": True, "action": "mps_terminate", "enabled": False, "pid": proc.pid,
            "terminated": [],
        }  # fmt: skip
        assert "mps" not in await client.status()
    finally:
        await sched.stop()


async def test_missing_binary_is_a_clear_start_error(sock_dir: str, tmp_path: Path) -> None:
    sched = UidScheduler(
        socket_path=os.path.join(sock_dir, "s.sock"),
        use_nvml=False,
        mps=True,
        mps_devices=[GPU0],
        mps_control_binary=str(tmp_path / "nvidia-cuda-mps-control"),
    )
    with pytest.raises(SchedulerStartError, match=r"MPS mode: .*was not found"):
        await sched.start()
    # Nothing is left listening.
    assert not sched.started and not os.path.exists(sched.socket_path)


async def test_mps_needs_known_devices(sock_dir: str, stub_binary: Path) -> None:
    sched = UidScheduler(
        socket_path=os.path.join(sock_dir, "s.sock"),
        use_nvml=False,
        mps=True,
        mps_control_binary=str(stub_binary),
    )
    with pytest.raises(SchedulerStartError, match="mps_devices"):
        await sched.start()


def test_cli_flag_turns_mps_on() -> None:
    from jupyter_gpushare.cli import SchedulerApp

    app = SchedulerApp()
    app.parse_command_line(["--mps", "--GPUShareScheduler.mps_devices=GPU-x"])
    sched = GPUShareScheduler(parent=app)
    assert sched.mps is True and sched.mps_devices == ["GPU-x"]
