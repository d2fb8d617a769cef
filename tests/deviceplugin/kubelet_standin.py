"""A kubelet stand-in for the device plugin's tests (tests/deviceplugin, tests/gpu): the kubelet's
side of the device plugin API v1beta1 over real gRPC on Unix sockets."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc

from jupyter_gpushare.deviceplugin.config import GPUShareDevicePlugin
from jupyter_gpushare.deviceplugin.plugin import DevicePluginServer
from jupyter_gpushare.deviceplugin.podresources import api_pb2 as podresources
from jupyter_gpushare.deviceplugin.podresources import api_pb2_grpc as podresources_grpc
from jupyter_gpushare.deviceplugin.v1beta1 import api_pb2 as api
from jupyter_gpushare.deviceplugin.v1beta1 import api_pb2_grpc as api_grpc

__all__ = ["KubeletStandIn", "PodResourcesStandIn", "next_list"]


class KubeletStandIn(api_grpc.RegistrationServicer):
    """The kubelet's side: Registration on ``<dir>/kubelet.sock``; each RegisterRequest is kept
    and wakes whoever waits for it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.requests: asyncio.Queue[api.RegisterRequest] = asyncio.Queue()
        self.server = grpc.aio.server()
        api_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{directory / 'kubelet.sock'}")

    async def Register(self, request: Any, context: Any) -> Any:
        if request.version != "v1beta1":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "unsupported version")
        await self.requests.put(request)
        return api.Empty()

    def plugin(self, request: api.RegisterRequest) -> tuple[grpc.aio.Channel, Any]:
        """A channel to the plugin that registered (the endpoint is relative to the dir)."""
        channel = grpc.aio.insecure_channel(f"unix://{self.directory / request.endpoint}")
        return channel, api_grpc.DevicePluginStub(channel)


class PodResourcesStandIn(podresources_grpc.PodResourcesListerServicer):
    """The kubelet's pod-resources API (v1) on ``path``: List answers with ``pods``, a dict of
    pod name -> {resource name: [device IDs]} the test changes as pods come and go."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pods: dict[str, dict[str, list[str]]] = {}
        self.calls = 0
        self.server = grpc.aio.server()
        podresources_grpc.add_PodResourcesListerServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{path}")

    async def List(self, request: Any, context: Any) -> Any:
        self.calls += 1
        return podresources.ListPodResourcesResponse(
            pod_resources=[
                podresources.PodResources(
                    name=name,
                    namespace="jhub",
                    containers=[
                        podresources.ContainerResources(
                            name="notebook",
                            devices=[
                                podresources.ContainerDevices(resource_name=r, device_ids=ids)
                                for r, ids in resources.items()
                            ],
                        )
                    ],
                )
                for name, resources in self.pods.items()
            ]
        )


async def next_list(stream: Any, timeout: float = 10.0) -> list[api.Device]:
    """The next device list a ListAndWatch stream sends."""
    response = await asyncio.wait_for(stream.read(), timeout)
    assert response is not grpc.aio.EOF, "ListAndWatch ended"
    return list(response.devices)


def plugin_for(kubelet: KubeletStandIn, harness: Any, **config: Any) -> DevicePluginServer:
    """A device plugin registering with ``kubelet`` and asking ``harness``'s scheduler (the
    tests' "containers" run on this host: one socket directory), refreshing every 0.1 s;
    ``config`` adds or overrides GPUShareDevicePlugin's traits."""
    settings: dict[str, Any] = {
        "kubelet_dir": str(kubelet.directory),
        "scheduler_socket": str(harness.socket_path),
        "host_socket_dir": str(harness.sock_dir),
        "container_socket_dir": str(harness.sock_dir),
        "refresh_interval": 0.1,
        **config,
    }
    return DevicePluginServer(GPUShareDevicePlugin(**settings))
