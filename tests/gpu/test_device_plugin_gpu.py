"""The device plugin on a real GPU: the node scheduler's NVML pool becomes gpushare.io/gpu-memory
units, and a PyTorch process started with what Allocate hands a container (its allocation's
socket, GPUSHARE_MEMORY_LIMIT removed) sees exactly the memory the pod asked for and cannot
allocate past it."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

from conftest import Scheduler, run_workload, shimmed_env

from jupyter_gpushare.deviceplugin.config import GPUShareDevicePlugin
from jupyter_gpushare.deviceplugin.plugin import DevicePluginServer
from jupyter_gpushare.deviceplugin.v1beta1 import api_pb2 as api
from tests.deviceplugin.kubelet_standin import KubeletStandIn, next_list

GiB = 1 << 30


async def test_allocated_units_are_the_processes_memory(scheduler: Scheduler) -> None:
    status = await asyncio.to_thread(scheduler.status)
    pools = {d["uuid"]: d["pool_bytes"] for d in status["devices"]}
    assert pools, "NVML found no GPU"
    # Unix socket paths are limited to 107 bytes: a short directory, not pytest's tmp_path.
    directory = Path(tempfile.mkdtemp(prefix="gs-dp-", dir="/tmp"))
    kubelet = KubeletStandIn(directory)
    await kubelet.server.start()
    socket_dir = str(Path(scheduler.socket).parent)
    plugin = DevicePluginServer(
        GPUShareDevicePlugin(
            kubelet_dir=str(directory),
            scheduler_socket=str(scheduler.socket),
            host_socket_dir=socket_dir,
            container_socket_dir=socket_dir,
            device_nodes=False,
        )
    )
    await plugin.start()
    try:
        request = await asyncio.wait_for(kubelet.requests.get(), 10)
        channel, stub = kubelet.plugin(request)
        async with channel:
            devices = await next_list(stub.ListAndWatch(api.Empty()))
            assert len(devices) == sum(pool // GiB for pool in pools.values())
            pref = await stub.GetPreferredAllocation(
                api.PreferredAllocationRequest(container_requests=[
                    api.ContainerPreferredAllocationRequest(
                        available_deviceIDs=[d.ID for d in devices], allocation_size=4)
                ])
            )  # fmt: skip
            ids = pref.container_responses[0].deviceIDs
            alloc = await stub.Allocate(
                api.AllocateRequest(
                    container_requests=[api.ContainerAllocateRequest(devices_ids=ids)]
                )
            )
            envs = dict(alloc.container_responses[0].envs)
            [mount] = alloc.container_responses[0].mounts
    finally:
        await plugin.stop()
        await kubelet.server.stop(grace=None)
        shutil.rmtree(directory, ignore_errors=True)
    assert envs["GPUSHARE_MEMORY_LIMIT"] == "4GiB"
    assert mount.read_only
    assert envs["NVIDIA_VISIBLE_DEVICES"] in pools
    # On a bare machine NVIDIA_VISIBLE_DEVICES selects nothing (the container runtime does that):
    # pick the allocated GPU for CUDA the way the runtime's single visible GPU would be seen. The
    # process reaches the scheduler on the allocation's socket (the container's mount, seen from
    # the node) and declares no limit at all: the socket's ceiling is what it gets.
    pod_socket = Path(mount.host_path) / Path(envs["GPUSHARE_SOCKET"]).name
    assert pod_socket.parent.parent == Path(socket_dir) / "alloc"
    del envs["GPUSHARE_MEMORY_LIMIT"]
    env = shimmed_env(pod_socket, {**envs, "CUDA_VISIBLE_DEVICES": envs["NVIDIA_VISIBLE_DEVICES"]})
    assert env["GPUSHARE_SOCKET"] == str(pod_socket) and "GPUSHARE_MEMORY_LIMIT" not in env
    r = await asyncio.to_thread(run_workload, "quota_violation.py", "5", env=env)
    assert r.returncode == 0, r.stderr
    rec = r.record
    assert rec["oom"], "allocating past the allocated units did not fail"
    assert rec["mem_get_info"][1] == 4 * GiB, rec  # total: what the pod asked for
    print(f"units={len(devices)} pools={pools} allocated={envs} record={rec}")


def test_xid_health_checks_register_every_gpu_with_real_nvml() -> None:
    """NVML's critical-XID events on the real driver: every GPU registers (as NVIDIA's plugin
    does), the watch thread waits on the event set, and stopping it takes at most one wait (1 s).
    No XID is provoked: tests/deviceplugin/test_plugin_health.py drives the verdicts."""
    import logging
    import time

    import pynvml

    from jupyter_gpushare.deviceplugin.health import XidWatcher

    seen: list[tuple[str, int]] = []
    watcher = XidWatcher(logging.getLogger("xid"), lambda uuid, xid: seen.append((uuid, xid)))
    loop = asyncio.new_event_loop()
    try:
        assert watcher.start(loop) is None
        pynvml.nvmlInit()
        uuids = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            uuids.append(uuid.decode() if isinstance(uuid, bytes) else uuid)
        assert watcher.watched == uuids
        time.sleep(2.5)  # a few waits time out quietly
        t0 = time.monotonic()
        watcher.stop()
        assert time.monotonic() - t0 < 3.0
        assert seen == []  # a healthy GPU reports no critical XID
    finally:
        loop.close()
