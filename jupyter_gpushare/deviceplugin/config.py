"""Settings of ``gpushare device-plugin`` (no gRPC here: ``gpushare --help-all`` and config
files load without the k8s extra)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from traitlets import Bool, Float, Unicode, validate
from traitlets.config import LoggingConfigurable

from ..units import parse_size

__all__ = ["ContainerSetup", "GPUShareDevicePlugin"]


@dataclass(frozen=True)
class ContainerSetup:
    """What every allocated container gets besides its GPUs (from the plugin's config)."""

    unit: int
    host_socket_dir: str
    container_socket_dir: str
    socket_name: str
    dev_root: str
    device_nodes: bool


class GPUShareDevicePlugin(LoggingConfigurable):
    """Settings of ``gpushare device-plugin`` (``c.GPUShareDevicePlugin.*``)."""

    resource_name = Unicode(
        "gpushare.io/gpu-memory",
        help="The extended resource pods request (vendor-domain/resource).",
    ).tag(config=True)

    unit = Unicode(
        "1GiB", help="GPU memory per advertised unit: a pod asking for 8 gets 8 units' worth."
    ).tag(config=True)

    kubelet_dir = Unicode(
        "/var/lib/kubelet/device-plugins",
        help="The kubelet's device-plugin directory: its kubelet.sock and our socket are here.",
    ).tag(config=True)

    endpoint = Unicode(
        "gpushare-gpu-memory.sock", help="This plugin's socket name in kubelet_dir."
    ).tag(config=True)

    scheduler_socket = Unicode(
        "/run/gpushare/scheduler.sock",
        help="The node scheduler's socket, as this process sees it (pools and health).",
    ).tag(config=True)

    host_socket_dir = Unicode(
        "/run/gpushare",
        help="The scheduler's socket directory on the node, mounted into allocated containers.",
    ).tag(config=True)

    container_socket_dir = Unicode(
        "/run/gpushare", help="Where allocated containers see the scheduler's socket directory."
    ).tag(config=True)

    dev_root = Unicode(
        "/dev", help="Where this process sees the node's device nodes (/dev/nvidia*)."
    ).tag(config=True)

    device_nodes = Bool(
        True,
        help="""Give allocated containers the GPU's device nodes that exist under dev_root. Off
        when the NVIDIA container runtime (NVIDIA_VISIBLE_DEVICES) or CDI provides them.""",
    ).tag(config=True)

    refresh_interval = Float(
        5.0,
        help="Seconds between two looks at the scheduler (pools, health) and at our socket.",
    ).tag(config=True)

    @validate("unit")
    def _validate_unit(self, proposal: Any) -> Any:
        size = parse_size(proposal["value"])  # raises ValueError with the bad text
        if size <= 0:
            raise ValueError(f"GPUShareDevicePlugin.unit must be positive: {proposal['value']!r}")
        return proposal["value"]

    @property
    def unit_bytes(self) -> int:
        return parse_size(self.unit)

    def setup(self) -> ContainerSetup:
        return ContainerSetup(
            unit=self.unit_bytes,
            host_socket_dir=self.host_socket_dir,
            container_socket_dir=self.container_socket_dir,
            socket_name=os.path.basename(self.scheduler_socket),
            dev_root=self.dev_root,
            device_nodes=self.device_nodes,
        )
