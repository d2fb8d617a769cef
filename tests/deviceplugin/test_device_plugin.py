"""`gpushare device-plugin` against a kubelet stand-in speaking the real v1beta1 protocol over
gRPC on Unix sockets: the stand-in serves Registration on kubelet.sock, and, once the plugin has
registered, calls its DevicePlugin service as the kubelet does (options, ListAndWatch,
GetPreferredAllocation, Allocate, PreStartContainer). The pools come from a real node scheduler
(`gpushare scheduler` with the stand-in NVML's GPUs); a shim started with Allocate's environment
reaches that scheduler on the allocation's socket and gets Allocate's memory as its quota."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from jupyter_gpushare.deviceplugin.config import GPUShareDevicePlugin
from jupyter_gpushare.deviceplugin.plugin import (
    DevicePluginServer,
    GpuPool,
    exact_size,
    preferred_units,
    unit_devices,
)
from jupyter_gpushare.deviceplugin.v1beta1 import api_pb2 as api
from jupyter_gpushare.units import parse_size
from tests.deviceplugin.kubelet_standin import KubeletStandIn, next_list, plugin_for

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30


def make_plugin(kubelet: KubeletStandIn, harness: Any, dev_root: Path) -> DevicePluginServer:
    return plugin_for(kubelet, harness, dev_root=str(dev_root))


async def test_register_list_allocate_against_a_kubelet_stand_in(
    kubelet: KubeletStandIn, harness: Any, tmp_path: Path
) -> None:
    sched = harness.scheduler(pool="20GiB", fake_devices=2)
    status = await asyncio.to_thread(sched.status)
    gpus = [(d["uuid"], d["index"], d["pool_bytes"]) for d in status["devices"]]
    assert len(gpus) == 2 and all(pool >= 8 * GiB for _, _, pool in gpus), gpus
    dev_root = tmp_path / "dev"
    dev_root.mkdir()
    for name in (f"nvidia{gpus[1][1]}", "nvidiactl", "nvidia-uvm"):
        (dev_root / name).touch()  # nvidia-uvm-tools is absent: it is not handed out

    plugin = make_plugin(kubelet, harness, dev_root)
    await plugin.start()
    try:
        request = await asyncio.wait_for(kubelet.requests.get(), 10)
        assert request.resource_name == "gpushare.io/gpu-memory"
        assert request.endpoint == "gpushare-gpu-memory.sock"
        assert request.options.get_preferred_allocation_available
        channel, stub = kubelet.plugin(request)
        async with channel:
            options = await stub.GetDevicePluginOptions(api.Empty())
            assert options.get_preferred_allocation_available and not options.pre_start_required

            # One unit per GiB of each GPU's pool, as the scheduler reports it.
            stream = stub.ListAndWatch(api.Empty())
            devices = await next_list(stream)
            expected = {f"{uuid}-{n}" for uuid, _, pool in gpus for n in range(pool // GiB)}
            assert {d.ID for d in devices} == expected
            assert {d.health for d in devices} == {"Healthy"}
            assert max(len(d.ID) for d in devices) <= 63  # the API's limit on IDs

            # 8 units, preferred on one GPU: the one with the fewest free units that still fit.
            (uuid0, _, _), (uuid1, index1, _) = gpus
            taken0 = [f"{uuid0}-{n}" for n in range(4, gpus[0][2] // GiB)]  # leaves 4 on GPU 0
            available = [d.ID for d in devices if d.ID not in taken0]
            pref = await stub.GetPreferredAllocation(
                api.PreferredAllocationRequest(
                    container_requests=[
                        api.ContainerPreferredAllocationRequest(
                            available_deviceIDs=available, allocation_size=8
                        )
                    ]
                )
            )
            [chosen] = pref.container_responses
            assert len(chosen.deviceIDs) == 8 and set(chosen.deviceIDs) <= set(available)
            assert {i.rsplit("-", 1)[0] for i in chosen.deviceIDs} == {uuid1}  # 4 do not fit

            alloc = await stub.Allocate(
                api.AllocateRequest(
                    container_requests=[api.ContainerAllocateRequest(devices_ids=chosen.deviceIDs)]
                )
            )
            [container] = alloc.container_responses
            envs = dict(container.envs)
            assert envs["GPUSHARE_MEMORY_LIMIT"] == "8GiB"
            assert parse_size(envs["GPUSHARE_MEMORY_LIMIT"]) == 8 * GiB
            assert envs["NVIDIA_VISIBLE_DEVICES"] == uuid1
            assert envs["GPUSHARE_SOCKET"] == str(harness.socket_path)
            assert envs["GPUSHARE_SCHEDULER"] == "node"
            [mount] = container.mounts  # the allocation's own socket directory (its ceiling)
            assert os.path.dirname(mount.host_path) == str(harness.sock_dir / "alloc")
            assert mount.container_path == str(harness.sock_dir) and mount.read_only
            nodes = {(d.container_path, d.host_path, d.permissions) for d in container.devices}
            assert nodes == {
                (f"/dev/{n}", str(dev_root / n), "rw")
                for n in (f"nvidia{index1}", "nvidiactl", "nvidia-uvm")
            }
            await stub.PreStartContainer(api.PreStartContainerRequest(devices_ids=chosen.deviceIDs))

            # A unit the plugin never advertised is refused, as the kubelet expects.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Allocate(
                    api.AllocateRequest(
                        container_requests=[api.ContainerAllocateRequest(devices_ids=["GPU-x-0"])]
                    )
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            # The container's shim: Allocate's environment and mount reach the node scheduler,
            # and the quota is the allocation's (test_allocation_ceiling.py: in a real mount).
            env = harness.env(extra=envs)
            env["GPUSHARE_SOCKET"] = os.path.join(mount.host_path, "scheduler.sock")
            run = await asyncio.to_thread(harness.run, "status", env=env)
            st = run.ok().event("status")["status"]
            assert st["quota_bytes"] == 8 * GiB
            assert st["connected"] == 1

            # The scheduler goes: every unit turns Unhealthy; it comes back: Healthy again.
            await asyncio.to_thread(sched.stop)
            devices = await next_list(stream)
            assert {d.health for d in devices} == {"Unhealthy"} and len(devices) == len(expected)
            await asyncio.to_thread(sched.start)
            devices = await next_list(stream)
            assert {d.health for d in devices} == {"Healthy"}

            # The kubelet restarts (it removes the plugins' sockets): the plugin registers again.
            os.unlink(kubelet.directory / request.endpoint)
            again = await asyncio.wait_for(kubelet.requests.get(), 10)
            assert again.resource_name == request.resource_name
        channel2, stub2 = kubelet.plugin(again)
        async with channel2:
            devices = await next_list(stub2.ListAndWatch(api.Empty()))
            assert {d.ID for d in devices} == expected
    finally:
        await plugin.stop()
    assert not (kubelet.directory / request.endpoint).exists()


def test_preferred_units_best_fit_and_must_include() -> None:
    a, b, c = (GpuPool(f"GPU-{x}", i, 10 * GiB) for i, x in enumerate("abc"))
    units = unit_devices([a, b, c], GiB)
    assert len(units) == 30
    free = [u for u in units if not u.startswith("GPU-a-") or u in ("GPU-a-0", "GPU-a-1")]
    free = [u for u in free if u not in ("GPU-b-0", "GPU-b-1", "GPU-b-2")]  # b has 7, c has 10
    got = preferred_units(free, [], 6, units)
    assert {units[u].uuid for u in got} == {"GPU-b"}  # the tightest GPU that fits 6
    got = preferred_units(free, ["GPU-c-9"], 3, units)
    assert got[0] == "GPU-c-9" and {units[u].uuid for u in got} == {"GPU-c"}
    got = preferred_units(free, [], 12, units)  # fits on no single GPU: the emptiest first
    assert len(got) == 12 and {units[u].uuid for u in got} == {"GPU-c", "GPU-b"}
    assert len(set(got)) == 12


def test_exact_size_is_read_back_by_parse_size() -> None:
    for nbytes in (GiB, 8 * GiB, 3 * (512 << 20), 40 * GiB, (1 << 40), 12345):
        text = exact_size(nbytes)
        assert parse_size(text) == nbytes, text
    assert exact_size(8 * GiB) == "8GiB" and exact_size(1536 << 20) == "1536MiB"


def test_cli_runs_the_device_plugin_app() -> None:
    """`gpushare device-plugin` is a subcommand whose options set GPUShareDevicePlugin."""
    out = subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare", "device-plugin", "--help-all"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    for option in ("--GPUShareDevicePlugin.unit", "--GPUShareDevicePlugin.resource_name"):
        assert option in out.stdout
    from jupyter_gpushare.deviceplugin.app import DevicePluginApp

    app = DevicePluginApp()
    app.parse_command_line(["--unit=512MiB", "--resource-name=example.com/gpu-mem"])
    config = GPUShareDevicePlugin(parent=app)
    assert config.unit_bytes == 512 << 20 and config.resource_name == "example.com/gpu-mem"
    with pytest.raises(Exception, match="unit"):
        GPUShareDevicePlugin(unit="0")


async def test_registers_again_once_a_restarted_kubelet_is_up(sock_dir: str) -> None:
    """A kubelet restart empties the directory; if the kubelet is not listening yet when the
    plugin notices, the plugin keeps serving and registers as soon as it is."""
    directory = Path(sock_dir) / "restart"
    directory.mkdir()
    first = KubeletStandIn(directory)
    await first.server.start()
    plugin = DevicePluginServer(
        GPUShareDevicePlugin(
            kubelet_dir=str(directory),
            scheduler_socket=str(Path(sock_dir) / "no-scheduler.sock"),
            refresh_interval=0.05,
        )
    )
    await plugin.start()
    second = None
    try:
        await asyncio.wait_for(first.requests.get(), 10)
        assert not plugin.healthy  # no scheduler answers: nothing is advertised as Healthy
        await first.server.stop(grace=None)
        for name in ("kubelet.sock", plugin.config.endpoint):  # the restart empties the dir
            (directory / name).unlink(missing_ok=True)
        for _ in range(100):
            if os.path.exists(plugin.socket_path):
                break
            await asyncio.sleep(0.05)
        assert os.path.exists(plugin.socket_path), "the plugin serves again at once"
        await asyncio.sleep(0.2)  # a few rounds with no kubelet to register with
        assert not plugin.registered and plugin.registrations == 1
        second = KubeletStandIn(directory)
        await second.server.start()
        again = await asyncio.wait_for(second.requests.get(), 10)
        assert again.resource_name == "gpushare.io/gpu-memory"
        for _ in range(100):  # the plugin counts it once the kubelet's answer is back
            if plugin.registered:
                break
            await asyncio.sleep(0.05)
        assert plugin.registered and plugin.registrations == 2
    finally:
        await plugin.stop()
        if second is not None:
            await second.server.stop(grace=None)


async def test_the_command_waits_for_the_kubelet_and_stops_cleanly(sock_dir: str) -> None:
    """`gpushare device-plugin` as the DaemonSet runs it: started before the kubelet listens, it
    registers once it does; SIGTERM ends it with status 0 and its socket removed."""
    directory = Path(sock_dir) / "cli"
    directory.mkdir()
    cmd = [sys.executable, "-m", "jupyter_gpushare", "device-plugin",
           f"--kubelet-dir={directory}", f"--scheduler-socket={Path(sock_dir) / 'none.sock'}",
           "--refresh-interval=0.1", "--unit=2GiB"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        *cmd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    kubelet = None
    try:
        endpoint = directory / "gpushare-gpu-memory.sock"
        for _ in range(200):  # serving, not registered: nobody listens on kubelet.sock yet
            if endpoint.exists():
                break
            await asyncio.sleep(0.05)
        assert endpoint.exists(), "the plugin does not serve"
        # The kubelet comes only after the plugin said it cannot register yet: started on a
        # timer instead, a loaded machine let the kubelet win the race and the plugin never
        # had to wait.
        early = b""
        while b"cannot register yet" not in early:
            line = await asyncio.wait_for(proc.stderr.readline(), 20)
            assert line, early.decode()
            early += line
        kubelet = KubeletStandIn(directory)
        await kubelet.server.start()
        request = await asyncio.wait_for(kubelet.requests.get(), 20)
        assert (request.resource_name, request.endpoint) == ("gpushare.io/gpu-memory",
                                                             endpoint.name)  # fmt: skip
        proc.terminate()
        _, stderr = await asyncio.wait_for(proc.communicate(), 20)
        assert proc.returncode == 0, (early + stderr).decode()
        assert not endpoint.exists()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if kubelet is not None:
            await kubelet.server.stop(grace=None)
