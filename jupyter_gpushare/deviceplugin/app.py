"""``gpushare device-plugin``: GPU memory as the Kubernetes resource ``gpushare.io/gpu-memory``.

Runs on every GPU node beside the node scheduler (the Helm chart puts both in one DaemonSet pod);
see plugin.py for what it advertises and hands out, docs/operators/helm.md for the deployment.
Needs the ``k8s`` extra (grpcio, protobuf): ``pip install 'jupyter-gpushare[k8s]'``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from ..cli import GPUShareBaseApp
from .config import GPUShareDevicePlugin


class DevicePluginApp(GPUShareBaseApp):
    name = "gpushare-device-plugin"
    description = """Advertise the node scheduler's GPU memory pools to the kubelet as units of
    the extended resource gpushare.io/gpu-memory (Kubernetes device plugin API v1beta1), and give
    each container that gets units its GPU, the scheduler's socket and GPUSHARE_MEMORY_LIMIT."""
    examples = """gpushare device-plugin --unit 1GiB --scheduler-socket /run/gpushare/scheduler.sock
gpushare device-plugin --resource-name example.com/gpu-memory --unit 512MiB"""

    aliases: dict[Any, Any] = {
        **GPUShareBaseApp.aliases,
        "resource-name": "GPUShareDevicePlugin.resource_name",
        "unit": "GPUShareDevicePlugin.unit",
        "kubelet-dir": "GPUShareDevicePlugin.kubelet_dir",
        "endpoint": "GPUShareDevicePlugin.endpoint",
        "scheduler-socket": "GPUShareDevicePlugin.scheduler_socket",
        "host-socket-dir": "GPUShareDevicePlugin.host_socket_dir",
        "container-socket-dir": "GPUShareDevicePlugin.container_socket_dir",
        "dev-root": "GPUShareDevicePlugin.dev_root",
        "refresh-interval": "GPUShareDevicePlugin.refresh_interval",
        "pod-resources-socket": "GPUShareDevicePlugin.pod_resources_socket",
        "prune-interval": "GPUShareDevicePlugin.prune_interval",
        "prune-grace": "GPUShareDevicePlugin.prune_grace",
        "node-name": "GPUShareDevicePlugin.node_name",
        "nfd-features-dir": "GPUShareDevicePlugin.nfd_features_dir",
    }
    flags: dict[Any, Any] = {
        "no-device-nodes": (
            {"GPUShareDevicePlugin": {"device_nodes": False}},
            "Hand out no /dev/nvidia* nodes (the NVIDIA runtime or CDI provides them).",
        ),
        "no-xid-health": (
            {"GPUShareDevicePlugin": {"xid_health": False}},
            "Leave GPUs Healthy after NVML XID errors (health is then the scheduler's alone).",
        ),
    }

    classes = [GPUShareDevicePlugin]

    def _log_level_default(self) -> int:
        return logging.INFO

    def initialize(self, argv: Any = None) -> None:
        super().initialize(argv)
        self.load_gpushare_config()

    def start(self) -> None:
        try:
            from .plugin import DevicePluginServer
        except ImportError as exc:
            self.log.critical(
                "the device plugin needs grpcio and protobuf: "
                "pip install 'jupyter-gpushare[k8s]' (%s)",
                exc,
            )
            self.exit(2)
        try:
            config = GPUShareDevicePlugin(parent=self)
        except Exception as exc:  # a bad config value
            self.config_error(exc)
        asyncio.run(self._serve(DevicePluginServer(config)))

    async def _serve(self, server: Any) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await server.start()  # registration is retried until the kubelet accepts it
        await stop.wait()
        self.log.info("device plugin: stopping")
        await server.stop()
