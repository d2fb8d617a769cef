"""Settings of ``gpushare device-plugin`` (no gRPC here: ``gpushare --help-all`` and config
files load without the k8s extra)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from traitlets import Bool, Float, Int, List, Unicode, default, validate
from traitlets.config import LoggingConfigurable

from ..units import parse_size
from .health import XID_IGNORED

__all__ = ["ContainerSetup", "GPUShareDevicePlugin"]


@dataclass(frozen=True)
class ContainerSetup:
    """What every allocated container gets besides its GPUs (from the plugin's config)."""

    unit: int
    scheduler_socket: str
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
        help="""The scheduler's socket directory on the node: each allocation's socket directory
        (made by the scheduler under it) is mounted into its container from there.""",
    ).tag(config=True)

    container_socket_dir = Unicode(
        "/run/gpushare",
        help="Where allocated containers see their allocation's socket directory.",
    ).tag(config=True)

    dev_root = Unicode(
        "/dev", help="Where this process sees the node's device nodes (/dev/nvidia*)."
    ).tag(config=True)

    device_nodes = Bool(
        True,
        help="""Give allocated containers the GPU's device nodes that exist under dev_root. Off
        when the NVIDIA container runtime (NVIDIA_VISIBLE_DEVICES) or CDI provides them.""",
    ).tag(config=True)

    pod_resources_socket = Unicode(
        "/var/lib/kubelet/pod-resources/kubelet.sock",
        help="""The kubelet's pod-resources API (v1): which units live pods hold. The scheduler
        retires the allocations of pods that are gone (see prune_interval).""",
    ).tag(config=True)

    prune_interval = Float(
        60.0,
        help="""Seconds between two looks at the kubelet's pod resources, after which the
        scheduler retires the allocations no live pod holds and no client uses (0: never; they
        are retired anyway when their units are allocated again).""",
    ).tag(config=True)

    prune_grace = Float(
        300.0,
        help="""Seconds an allocation must have been unheld by any live pod and unused, at every
        look, before the scheduler retires it.""",
    ).tag(config=True)

    refresh_interval = Float(
        5.0,
        help="Seconds between two looks at the scheduler (pools, health) and at our socket.",
    ).tag(config=True)

    xid_health = Bool(
        True,
        help="""Mark a GPU's units Unhealthy after a critical NVML XID error, as NVIDIA's device
        plugin does (needs NVML in this container; without it, health is the scheduler's).""",
    ).tag(config=True)

    xid_ignored = List(
        Int(),
        list(XID_IGNORED),
        help="XIDs that are an application's error, not the GPU's: they change no health.",
    ).tag(config=True)

    nfd_features_dir = Unicode(
        "",
        help="""Node Feature Discovery's local features directory on the node (usually
        /etc/kubernetes/node-feature-discovery/features.d, mounted): the plugin keeps a file
        there from which NFD labels the node with its largest GPU's units
        (feature.node.kubernetes.io/gpushare-gpu-memory-largest-gpu) and its GPU count, for
        placing pods by one GPU's memory. Empty: no file.""",
    ).tag(config=True)

    node_name = Unicode(
        help="""This node's name (the chart sets NODE_NAME from the downward API): the object
        of the plugin's Kubernetes events. Empty: no events, log lines only.""",
    ).tag(config=True)

    @default("node_name")
    def _default_node_name(self) -> str:
        return os.environ.get("NODE_NAME", "")

    kube_api = Unicode(
        "",
        help="""The Kubernetes API server's URL for the plugin's events ("": in-cluster, from
        KUBERNETES_SERVICE_HOST/PORT; no events when that is unset either).""",
    ).tag(config=True)

    service_account_dir = Unicode(
        "/var/run/secrets/kubernetes.io/serviceaccount",
        help="The service account's token, ca.crt and namespace (events only).",
    ).tag(config=True)

    @validate("prune_interval", "prune_grace", "refresh_interval")
    def _validate_seconds(self, proposal: Any) -> Any:
        if proposal["value"] < 0:
            raise ValueError(f"{proposal['trait'].name} must be 0 or more: {proposal['value']}")
        return proposal["value"]

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
            scheduler_socket=self.scheduler_socket,
            host_socket_dir=self.host_socket_dir,
            container_socket_dir=self.container_socket_dir,
            socket_name=os.path.basename(self.scheduler_socket),
            dev_root=self.dev_root,
            device_nodes=self.device_nodes,
        )
