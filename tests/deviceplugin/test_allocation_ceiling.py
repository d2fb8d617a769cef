"""The ceiling Allocate gives a pod is one the pod cannot change (issue #17).

A kubelet stand-in allocates units over real gRPC; the device plugin asks the node scheduler for
an allocation, whose own socket directory is what the container mounts. A shim in a "container"
(a mount namespace, as root, where that directory is bind-mounted read-only at the container
path, as the runtime does) gets the allocation's quota with GPUSHARE_MEMORY_LIMIT unset or
raised, keeps it across scheduler restarts, and the allocation goes when its units are given to
another pod."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import stat
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from jupyter_gpushare.deviceplugin.config import GPUShareDevicePlugin
from jupyter_gpushare.deviceplugin.plugin import DevicePluginServer
from jupyter_gpushare.deviceplugin.v1beta1 import api_pb2 as api
from jupyter_gpushare.scheduler_client import SchedulerClient, SchedulerError
from tests.conftest import Run
from tests.deviceplugin.kubelet_standin import KubeletStandIn, PodResourcesStandIn, next_list

GiB = 1 << 30
#: Mount a directory read-only at the container path in a new mount namespace, then run.
_CONTAINER = 'mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" && shift 2 && exec "$@"'


@functools.cache
def can_mount() -> bool:
    """Root with the right to make a mount namespace (CI; not every container grants it)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


def in_container(host_dir: str, container_dir: str, argv: list[str]) -> list[str]:
    """``argv`` as a container with the allocation's mount would run it: a real read-only bind
    mount in a private mount namespace where :func:`can_mount`; elsewhere ``argv`` unchanged
    (the test then points GPUSHARE_SOCKET at the host directory, the same socket)."""
    if not can_mount():
        return argv
    return ["unshare", "--mount", "sh", "-c", _CONTAINER, "sh", host_dir, container_dir, *argv]


@contextlib.asynccontextmanager
async def plugin_stub(
    kubelet: KubeletStandIn, **config: Any
) -> AsyncIterator[tuple[Any, list[str]]]:
    """A started plugin registered with ``kubelet``: a stub to it and the unit IDs it lists."""
    plugin = DevicePluginServer(
        GPUShareDevicePlugin(kubelet_dir=str(kubelet.directory), device_nodes=False, **config)
    )
    await plugin.start()
    try:
        request = await asyncio.wait_for(kubelet.requests.get(), 10)
        channel, stub = kubelet.plugin(request)
        async with channel:
            yield stub, [d.ID for d in await next_list(stub.ListAndWatch(api.Empty()))]
    finally:
        await plugin.stop()


async def allocate(stub: Any, ids: list[str]) -> api.ContainerAllocateResponse:
    alloc = await stub.Allocate(
        api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(devices_ids=ids)])
    )
    [container] = alloc.container_responses
    return container


async def test_the_allocation_socket_sets_the_quota_the_pod_cannot_change(
    kubelet: KubeletStandIn, harness: Any, sock_dir: str
) -> None:
    sched = harness.scheduler(pool="20GiB", fake_devices=1)
    namespaced = can_mount()
    container_dir = Path(sock_dir) / "container-run"  # where the container sees its socket
    container_dir.mkdir()
    async with plugin_stub(
        kubelet,
        scheduler_socket=str(harness.socket_path),
        host_socket_dir=str(harness.sock_dir),
        container_socket_dir=str(container_dir),
    ) as (stub, devices):
        first = await allocate(stub, devices[:4])
        [mount] = first.mounts
        envs = dict(first.envs)
        alloc_root = Path(sock_dir) / "alloc"
        assert Path(mount.host_path).parent == alloc_root  # its own directory, not /run's
        assert mount.container_path == str(container_dir) and mount.read_only
        assert sorted(os.listdir(mount.host_path)) == ["scheduler.sock"]
        assert envs["GPUSHARE_SOCKET"] == str(container_dir / "scheduler.sock")
        assert envs["GPUSHARE_MEMORY_LIMIT"] == "4GiB"

        def shim_quota(**override: str | None) -> int:
            env = harness.env(extra=envs)
            if not namespaced:  # no mount: the container path is the host's
                env["GPUSHARE_SOCKET"] = os.path.join(mount.host_path, "scheduler.sock")
            for key, value in override.items():
                if value is None:
                    env.pop(key, None)
                else:
                    env[key] = value
            argv = in_container(
                mount.host_path, mount.container_path, [harness.program(), "status"]
            )
            out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
            run = Run(argv, out.returncode, out.stdout, out.stderr).ok()
            return int(run.event("status")["status"]["quota_bytes"])

        # The pod's environment cannot lift the ceiling; it may only lower it.
        assert shim_quota(GPUSHARE_MEMORY_LIMIT=None) == 4 * GiB
        assert shim_quota(GPUSHARE_MEMORY_LIMIT="64GiB") == 4 * GiB
        assert shim_quota(GPUSHARE_MEMORY_LIMIT="2GiB") == 2 * GiB
        # The same shim on the node's shared socket (which pods no longer mount) has no
        # ceiling but its own claim: the socket is what sets it.
        shared = str(harness.socket_path)
        assert shim_quota(GPUSHARE_MEMORY_LIMIT="64GiB", GPUSHARE_SOCKET=shared) == 64 * GiB

        # A peer on an allocation's socket is never an admin (this test runs as the
        # scheduler's own uid): it may not open allocations of its own.
        pod_side = SchedulerClient(os.path.join(mount.host_path, "scheduler.sock"))
        with pytest.raises(SchedulerError, match="may not allocate"):
            await pod_side.control("allocate", ceiling=64 * GiB, units=[devices[10]])

        # The ceilings are in the scheduler's private state, 0700/0600.
        state = Path(sock_dir) / "state"
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert stat.S_IMODE((state / "allocations.json").stat().st_mode) == 0o600

        # A restart (clean, then a crash) keeps the ceiling, on the same mounted directory.
        await asyncio.to_thread(sched.stop)
        await asyncio.to_thread(sched.start)
        assert shim_quota(GPUSHARE_MEMORY_LIMIT=None) == 4 * GiB
        await asyncio.to_thread(sched.kill)
        await asyncio.to_thread(sched.start)
        assert shim_quota(GPUSHARE_MEMORY_LIMIT="64GiB") == 4 * GiB
        assert "allocations: 1 reopened" in sched.log

        # Units of a gone pod go to a new one: the old allocation is retired, a disjoint
        # one stays.
        other = await allocate(stub, devices[4:6])
        again = await allocate(stub, devices[2:5])  # 2 of the first, 1 of the other
        assert not os.path.exists(mount.host_path)
        assert not os.path.exists(other.mounts[0].host_path)
        assert sorted(os.listdir(alloc_root)) == [Path(again.mounts[0].host_path).name]
        kept = await allocate(stub, devices[8:9])
        assert sorted(os.listdir(alloc_root)) == sorted(
            Path(c.mounts[0].host_path).name for c in (again, kept)
        )
        assert dict(again.envs)["GPUSHARE_MEMORY_LIMIT"] == "3GiB"


async def test_allocate_fails_without_the_scheduler(kubelet: KubeletStandIn, harness: Any) -> None:
    """No scheduler, no ceiling: Allocate is refused rather than a pod let in unbounded."""
    sched = harness.scheduler(pool="8GiB", fake_devices=1)
    async with plugin_stub(
        kubelet,
        scheduler_socket=str(harness.socket_path),
        host_socket_dir=str(harness.sock_dir),
        refresh_interval=30,  # the plugin still lists the units it saw
    ) as (stub, devices):
        await asyncio.to_thread(sched.stop)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await allocate(stub, devices[:2])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def wait_gone(path: str, timeout: float = 15.0) -> float:
    """Seconds until ``path`` disappears (AssertionError past ``timeout``)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while os.path.exists(path):
        assert loop.time() - start < timeout, f"{path} is still there"
        await asyncio.sleep(0.05)
    return loop.time() - start


async def test_allocations_of_gone_pods_are_pruned(
    kubelet: KubeletStandIn, harness: Any, sock_dir: str
) -> None:
    """The plugin reports the units live pods hold (the kubelet's pod-resources API); an
    allocation no live pod holds and no client uses, for the whole grace period, is retired;
    one a pod holds, or a client still uses, is not."""
    harness.scheduler(pool="20GiB", fake_devices=1)
    pods = PodResourcesStandIn(Path(sock_dir) / "pod-resources.sock")
    await pods.server.start()
    grace = 1.5
    try:
        async with plugin_stub(
            kubelet,
            scheduler_socket=str(harness.socket_path),
            host_socket_dir=str(harness.sock_dir),
            pod_resources_socket=str(pods.path),
            refresh_interval=0.05,
            prune_interval=0.1,
            prune_grace=grace,
        ) as (stub, devices):
            resource = "gpushare.io/gpu-memory"
            held, gone, used = [
                (await allocate(stub, ids)).mounts[0].host_path
                for ids in (devices[:2], devices[2:4], devices[4:5])
            ]
            pods.pods = {
                "held": {resource: devices[:2]},
                # Same IDs under another resource: not ours, not a holder of `gone`.
                "other": {"example.com/thing": devices[2:4]},
            }
            # A client on `used`'s socket (no pod holds its units: the kubelet is being slow).
            _, writer = await asyncio.open_unix_connection(os.path.join(used, "scheduler.sock"))
            calls = pods.calls
            await asyncio.sleep(0.4)
            assert pods.calls > calls, "the plugin does not look at the pod resources"
            assert os.path.exists(gone), "retired before its grace period"
            await wait_gone(gone)
            assert os.path.isdir(held) and os.path.isdir(used)
            writer.close()  # the last client of `used` goes: its grace period starts
            assert await wait_gone(used) >= grace - 0.5
            assert os.path.isdir(held)
            pods.pods = {}  # the last pod goes
            await wait_gone(held)
            # The state file is written after the directory goes: on a loaded machine the test
            # read it between the two.
            state_file = Path(sock_dir) / "state" / "allocations.json"
            for _ in range(200):
                state = json.loads(state_file.read_text())
                if state == {"allocations": []}:
                    break
                await asyncio.sleep(0.05)
            assert state == {"allocations": []}
    finally:
        await pods.server.stop(grace=None)
