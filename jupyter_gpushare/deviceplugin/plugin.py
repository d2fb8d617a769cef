"""GPU memory as a Kubernetes extended resource: a device plugin (API v1beta1) for the kubelet.

Each GPU's pool (as the node scheduler reports it) is cut into units of ``unit`` bytes (1 GiB by
default), each advertised as one "device" of ``resource_name`` (``gpushare.io/gpu-memory``) with
the ID ``<GPU UUID>-<n>``. A pod that asks for 8 units is placed on a node with 8 free units; the
kubelet then calls Allocate with the 8 IDs it chose, and the container gets:

* its own socket to the scheduler, with the ceiling: before answering, the plugin asks the
  node scheduler (control action ``allocate``, features/allocations.py) for an allocation of
  8 GiB; the scheduler listens on a new socket in a directory of its own, and that directory is
  mounted read-only where the container expects the scheduler's socket directory. Every client
  on that socket gets at most 8 GiB of quota, whatever its environment says: the pod cannot
  change its ceiling. ``GPUSHARE_SOCKET`` and ``GPUSHARE_SCHEDULER=node`` point the shim at it;
* ``GPUSHARE_MEMORY_LIMIT=8GiB``: the shim declares it (informative: the socket's ceiling
  holds without it, and a larger value is cut down to it);
* the GPU: ``NVIDIA_VISIBLE_DEVICES=<uuid>`` for the NVIDIA container runtime, and (when they
  exist on the node) the device nodes ``/dev/nvidia<index>``, ``nvidiactl``, ``nvidia-uvm``.

The kubelet never says when a pod goes: every ``prune_interval`` the plugin reads which units
live pods hold from the kubelet's pod-resources API and tells the scheduler, which retires the
allocations no live pod has held and no client has used for ``prune_grace``
(:meth:`DevicePluginServer.prune_when_due`).

The scheduler must answer for Allocate to succeed: without it the container would get no
ceiling, so the plugin refuses (UNAVAILABLE) and the kubelet fails the pod's admission; its
units are Unhealthy meanwhile anyway, so the Kubernetes scheduler places no pod on them.

The units are bookkeeping for the Kubernetes scheduler, not a partition of the card: the node
scheduler still shares the whole pool (side by side when kernels fit, in turns when not); the
units only stop Kubernetes from placing more promised memory on a node than its pools hold.

A pod's units come from one GPU: a kernel uses one GPU, so 8 units split 4 + 4 over two GPUs
would give it half of what it asked under an 8 GiB ceiling. GetPreferredAllocation picks one GPU
whenever one has enough free units; when none has (the Kubernetes scheduler counts the node's
units, not each GPU's) and the kubelet splits anyway, Allocate refuses (FAILED_PRECONDITION,
the kubelet fails the pod's admission with that message) and says so in a Node event.

Health comes from the node scheduler: while its socket answers ``status``, the units of the GPUs
it lists are Healthy; when it stops answering they turn Unhealthy (the kubelet then places no new
pod on them) and Healthy again when it is back. A critical XID error on a GPU (NVML's events,
judged as NVIDIA's plugin judges them, :mod:`.health`) turns that GPU's units Unhealthy for good.
A scheduler that reports no GPU (no NVML in its container: it would learn GPUs from kernels, but
no pod can start on 0 units to bring one) is said in the log and a Node event, with NVML's
error (:mod:`.kube_events`). The kubelet removes plugin sockets when it
restarts: the plugin notices its socket is gone and serves and registers again.

The pure parts (unit IDs, the preferred allocation, the Allocate answer) are functions;
:class:`DevicePluginServer` is the asyncio/gRPC shell around them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from ..scheduler_client import SchedulerClient, SchedulerError, SchedulerUnavailable
from ..units import format_size
from .config import ContainerSetup, GPUShareDevicePlugin
from .health import ALL_GPUS, XidWatcher
from .kube_events import NodeEvents
from .node_features import feature_text, write_features
from .podresources import api_pb2 as podresources
from .podresources import api_pb2_grpc as podresources_grpc
from .v1beta1 import api_pb2 as api
from .v1beta1 import api_pb2_grpc as api_grpc

__all__ = [
    "API_VERSION",
    "ContainerSetup",
    "DevicePluginServer",
    "GPUShareDevicePlugin",
    "GpuPool",
    "allocate_container",
    "allocation_host_dir",
    "exact_size",
    "held_units",
    "preferred_units",
    "split_refusal",
    "unit_devices",
    "why_no_units",
]

API_VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
#: Device nodes every CUDA container needs besides its GPU's own /dev/nvidia<index>.
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


@dataclass(frozen=True)
class GpuPool:
    """One GPU as the node scheduler reports it."""

    uuid: str
    index: int | None  # NVML's index; None for a device learnt from a shim
    pool_bytes: int


# -- pure ---------------------------------------------------------------------------------------


def exact_size(nbytes: int) -> str:
    """``8GiB``, ``1536MiB``: the largest binary unit that divides ``nbytes`` (the size syntax
    the shim and parse_size read), never rounded."""
    for suffix, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes and nbytes % factor == 0:
            return f"{nbytes // factor}{suffix}"
    return str(nbytes)


def unit_devices(pools: Iterable[GpuPool], unit: int) -> dict[str, GpuPool]:
    """The advertised unit IDs (``<uuid>-<n>``, n from 0) and the GPU each belongs to.

    Only whole units: a pool of 79.6 GiB in 1 GiB units is 79 of them. The health is the same
    for all (it is the scheduler's), so it is applied by :func:`device_list`."""
    out: dict[str, GpuPool] = {}
    for gpu in pools:
        for n in range(gpu.pool_bytes // unit):
            out[f"{gpu.uuid}-{n}"] = gpu
    return out


def device_list(
    units: dict[str, GpuPool], healthy: bool, broken: Iterable[str] = ()
) -> api.ListAndWatchResponse:
    """Every unit, Healthy while the scheduler answers and its GPU is not in ``broken`` (lower-case
    uuids, or ALL_GPUS)."""
    broken = set(broken)

    def health(gpu: GpuPool) -> str:
        ok = healthy and ALL_GPUS not in broken and gpu.uuid.lower() not in broken
        return HEALTHY if ok else UNHEALTHY

    return api.ListAndWatchResponse(
        devices=[api.Device(ID=unit_id, health=health(gpu)) for unit_id, gpu in units.items()]
    )


def why_no_units(doc: dict[str, Any], pools: Sequence[GpuPool], unit: int) -> str | None:
    """Why a scheduler's status gives no unit to advertise (None when it gives some)."""
    if any(gpu.pool_bytes >= unit for gpu in pools):
        return None
    nvml = doc.get("nvml", True)
    if pools:
        return f"every GPU's pool is smaller than one unit ({format_size(unit)}): " + ", ".join(
            f"{g.uuid} {format_size(g.pool_bytes)}" for g in pools
        )
    if nvml is not True:
        return (
            f"the node scheduler finds no GPU through NVML ({nvml}); it would learn GPUs from "
            "the kernels that use one, but no pod can start on 0 units to bring one. Give the "
            "scheduler's container NVML (the NVIDIA runtime: runtimeClassName nvidia, "
            "NVIDIA_VISIBLE_DEVICES=all, NVIDIA_DRIVER_CAPABILITIES=utility)"
        )
    return "the node scheduler's NVML sees no GPU on this node"


def split_refusal(unit_ids: Sequence[str], units: dict[str, GpuPool], resource: str) -> str | None:
    """The refusal of units that come from more than one GPU (None when they come from one)."""
    per_gpu: dict[str, int] = {}
    for unit_id in unit_ids:
        uuid = units[unit_id].uuid
        per_gpu[uuid] = per_gpu.get(uuid, 0) + 1
    if len(per_gpu) <= 1:
        return None
    split = ", ".join(f"{n} on {uuid}" for uuid, n in per_gpu.items())
    return (
        f"{len(unit_ids)} units of {resource} split over {len(per_gpu)} GPUs ({split}): a "
        "kernel uses one GPU and would get only part of what the pod asked, so the pod is "
        "refused. No GPU of this node had that many units free; ask for fewer units, or let "
        "the pod go to a node where one GPU has them"
    )


def preferred_units(
    available: Sequence[str], must_include: Sequence[str], size: int, units: dict[str, GpuPool]
) -> list[str]:
    """Which ``size`` units to take: all of them from one GPU when possible, the GPU whose free
    units fit most tightly (best fit keeps big holes for big requests), the units that must be
    included first. Falls back to spreading over GPUs, the fullest-free first."""
    chosen = list(dict.fromkeys(must_include))[:size]
    free: dict[str, list[str]] = {}
    for unit_id in available:
        gpu = units.get(unit_id)
        if gpu is not None and unit_id not in chosen:
            free.setdefault(gpu.uuid, []).append(unit_id)
    need = size - len(chosen)
    if need <= 0:
        return chosen
    pinned = {units[u].uuid for u in chosen if u in units}
    if len(pinned) <= 1:
        candidates = [g for g in free if (not pinned or g in pinned) and len(free[g]) >= need]
        if candidates:
            best = min(candidates, key=lambda g: (len(free[g]), g))
            return chosen + free[best][:need]
    for gpu in sorted(free, key=lambda g: (-len(free[g]), g)):
        take = free[gpu][:need]
        chosen += take
        need -= len(take)
        if need == 0:
            break
    return chosen


def container_gpus(unit_ids: Sequence[str], units: dict[str, GpuPool]) -> dict[str, GpuPool]:
    """The GPUs of the unit IDs the kubelet chose (KeyError for an ID never advertised)."""
    gpus: dict[str, GpuPool] = {}
    for unit_id in unit_ids:
        gpu = units[unit_id]
        gpus.setdefault(gpu.uuid, gpu)
    return gpus


def allocation_host_dir(scheduler_dir: str, setup: ContainerSetup) -> str:
    """The node's path of an allocation's socket directory, which the scheduler reports as it
    sees it: under its socket directory, which the node has at ``setup.host_socket_dir``."""
    relative = os.path.relpath(scheduler_dir, os.path.dirname(setup.scheduler_socket))
    if relative.startswith(os.pardir) or os.path.isabs(relative):
        raise ValueError(f"the allocation's directory {scheduler_dir} is not under the socket's")
    return os.path.join(setup.host_socket_dir, relative)


def allocate_container(
    unit_ids: Sequence[str], units: dict[str, GpuPool], setup: ContainerSetup, socket_dir: str
) -> api.ContainerAllocateResponse:
    """The Allocate answer for one container given the unit IDs the kubelet chose and the node's
    path of the socket directory the scheduler opened for them (:func:`allocation_host_dir`).

    Raises KeyError for an ID this plugin never advertised."""
    gpus = container_gpus(unit_ids, units)
    limit = len(unit_ids) * setup.unit
    envs = {
        "GPUSHARE_MEMORY_LIMIT": exact_size(limit),
        "GPUSHARE_SOCKET": os.path.join(setup.container_socket_dir, setup.socket_name),
        "GPUSHARE_SCHEDULER": "node",
        "NVIDIA_VISIBLE_DEVICES": ",".join(gpus),
    }
    mounts = [
        api.Mount(
            container_path=setup.container_socket_dir,
            host_path=socket_dir,  # this allocation's socket alone, not the shared one
            read_only=True,  # a writable socket directory would let the user replace the socket
        )
    ]
    devices = []
    if setup.device_nodes:
        names = [f"nvidia{g.index}" for g in gpus.values() if g.index is not None]
        for name in [*names, *CONTROL_NODES]:
            path = os.path.join(setup.dev_root, name)
            if os.path.exists(path):
                devices.append(
                    api.DeviceSpec(container_path=f"/dev/{name}", host_path=path, permissions="rw")
                )
    return api.ContainerAllocateResponse(envs=envs, mounts=mounts, devices=devices)


def held_units(response: podresources.ListPodResourcesResponse, resource: str) -> list[str]:
    """The units of ``resource`` that the kubelet's live pods hold."""
    return [
        unit_id
        for pod in response.pod_resources
        for container in pod.containers
        for devices in container.devices
        if devices.resource_name == resource
        for unit_id in devices.device_ids
    ]


def pools_from_status(doc: dict[str, Any]) -> list[GpuPool]:
    out = []
    for dev in doc.get("devices", []):
        index = dev.get("index")
        out.append(
            GpuPool(
                uuid=str(dev["uuid"]),
                index=int(index) if isinstance(index, int) else None,
                pool_bytes=int(dev.get("pool_bytes") or 0),
            )
        )
    return out


# -- the gRPC shell -----------------------------------------------------------------------------


class _Servicer(api_grpc.DevicePluginServicer):
    def __init__(self, owner: DevicePluginServer) -> None:
        self.owner = owner

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return api.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        )

    async def ListAndWatch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        async for response in self.owner.watch():
            yield response

    async def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        units = self.owner.units
        return api.PreferredAllocationResponse(
            container_responses=[
                api.ContainerPreferredAllocationResponse(
                    deviceIDs=preferred_units(
                        r.available_deviceIDs, r.must_include_deviceIDs, r.allocation_size, units
                    )
                )
                for r in request.container_requests
            ]
        )

    async def Allocate(self, request: Any, context: Any) -> Any:
        units, setup = self.owner.units, self.owner.config_setup
        responses = []
        for r in request.container_requests:
            unit_ids = list(r.devices_ids)
            try:
                refusal = split_refusal(unit_ids, units, self.owner.resource)
            except KeyError as exc:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"unknown {self.owner.resource} unit {exc}"
                )
            if refusal is not None:
                await self.owner.events.warn("GPUShareUnitsSplit", refusal)
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
            try:
                socket_dir = await self.owner.open_allocation(unit_ids)
            except (SchedulerUnavailable, SchedulerError, ValueError) as exc:
                self.owner.log.error("gpushare device plugin: no allocation: %s", exc)
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, f"the node scheduler opened no allocation: {exc}"
                )
            responses.append(allocate_container(unit_ids, units, setup, socket_dir))
        for c in responses:
            self.owner.log.info(
                "gpushare device plugin: allocated %s on %s",
                c.envs["GPUSHARE_MEMORY_LIMIT"],
                c.envs["NVIDIA_VISIBLE_DEVICES"],
            )
        return api.AllocateResponse(container_responses=responses)

    async def PreStartContainer(self, request: Any, context: Any) -> Any:
        return api.PreStartContainerResponse()


class DevicePluginServer:
    """Serves DevicePlugin on ``kubelet_dir/endpoint``, registers with the kubelet, follows the
    node scheduler's pools and health, and re-registers when the kubelet restarts."""

    def __init__(self, config: GPUShareDevicePlugin) -> None:
        self.config = config
        self.log = config.log
        self.resource = config.resource_name
        self.config_setup = config.setup()
        self.units: dict[str, GpuPool] = {}
        self.healthy = False
        self.broken: dict[str, int] = {}  # lower-case uuid (or ALL_GPUS) -> the XID that broke it
        self.no_units_reason: str | None = None
        self.nfd_error = ""  # the last failure to write the node features file
        self.events = NodeEvents.in_cluster(
            self.log, config.node_name, config.kube_api, config.service_account_dir
        )
        self.xids = XidWatcher(self.log, self._on_xid, config.xid_ignored)
        self.xid_health: str | None = None  # None: watching; else why not
        self._tasks: set[asyncio.Future[Any]] = set()
        self._version = 0  # bumped on every change of the advertised list
        self._changed = asyncio.Condition()
        self._server: grpc.aio.Server | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._pruned_at = 0.0  # monotonic time of the last prune (0: none yet)
        self.registered = False  # the kubelet accepted our last Register
        self.registrations = 0

    @property
    def socket_path(self) -> str:
        return os.path.join(self.config.kubelet_dir, self.config.endpoint)

    @property
    def kubelet_socket(self) -> str:
        return os.path.join(self.config.kubelet_dir, "kubelet.sock")

    # -- the advertised list ------------------------------------------------------------------

    async def refresh(self) -> None:
        """Ask the scheduler for its pools; publish a new list when the units or health change."""
        try:
            doc = await SchedulerClient(self.config.scheduler_socket, timeout=5.0).status()
        except (SchedulerUnavailable, SchedulerError) as exc:
            if self.healthy:
                self.log.warning("gpushare device plugin: scheduler unavailable: %s", exc)
            await self._publish(self.units, healthy=False)
            return
        pools = pools_from_status(doc)
        reason = why_no_units(doc, pools, self.config.unit_bytes)
        if reason != self.no_units_reason:
            self.no_units_reason = reason
            if reason is not None:
                await self.events.warn("GPUShareNoUnits", f"0 units advertised: {reason}")
        units = unit_devices(pools, self.config.unit_bytes)
        await self._publish(units, healthy=True)
        if self.config.nfd_features_dir:
            text = feature_text(pools, self.config.unit_bytes)
            try:
                if await asyncio.to_thread(write_features, self.config.nfd_features_dir, text):
                    self.log.info("gpushare device plugin: node features %s", text.split())
            except OSError as exc:
                if self.nfd_error != str(exc):  # once per distinct failure, not every refresh
                    self.log.warning("gpushare device plugin: cannot write node features: %s", exc)
                self.nfd_error = str(exc)

    def _on_xid(self, uuid: str, xid: int) -> None:
        """A critical XID on ``uuid`` (from the watcher's thread, on the loop): its units turn
        Unhealthy until the plugin restarts."""
        key = uuid.lower()
        if key in self.broken:
            return
        self.broken[key] = xid
        what = "every GPU (the event names none)" if uuid == ALL_GPUS else uuid
        message = f"XID {xid} on {what}: its units are Unhealthy until the plugin restarts"
        for work in (
            self.events.warn("GPUShareXidError", message),
            self._publish(self.units, self.healthy, force=True),
        ):
            task = asyncio.ensure_future(work)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _publish(self, units: dict[str, GpuPool], healthy: bool, force: bool = False) -> None:
        if units == self.units and healthy == self.healthy and self._version and not force:
            return
        self.units, self.healthy = units, healthy
        self._version += 1
        self.log.info(
            "gpushare device plugin: %d units of %s (%s), %s",
            len(units),
            self.resource,
            format_size(self.config.unit_bytes),
            HEALTHY if healthy else UNHEALTHY,
        )
        async with self._changed:
            self._changed.notify_all()

    async def watch(self) -> AsyncIterator[api.ListAndWatchResponse]:
        """The list now, then again after each change, until the plugin stops."""
        seen = -1
        while not self._stopping:
            if seen != self._version:
                seen = self._version
                yield device_list(self.units, self.healthy, self.broken)
            async with self._changed:
                if seen == self._version and not self._stopping:
                    await self._changed.wait()

    async def open_allocation(self, unit_ids: Sequence[str]) -> str:
        """Ask the scheduler for an allocation of these units (their bytes as its ceiling); the
        node's path of its socket directory."""
        client = SchedulerClient(self.config.scheduler_socket, timeout=10.0)
        reply = await client.control(
            "allocate", ceiling=len(unit_ids) * self.config.unit_bytes, units=list(unit_ids)
        )
        return allocation_host_dir(str(reply["directory"]), self.config_setup)

    async def prune_when_due(self) -> list[str]:
        """Every prune_interval: tell the scheduler which units live pods hold (the kubelet's
        pod-resources API), so that it retires the allocations of pods that are gone; the ids
        it retired. Nothing when the API's socket is absent (an old kubelet: allocations are
        then retired only when their units are allocated again)."""
        interval = self.config.prune_interval
        now = asyncio.get_running_loop().time()
        if interval <= 0 or now - self._pruned_at < interval:
            return []
        self._pruned_at = now
        path = self.config.pod_resources_socket
        if not os.path.exists(path):
            return []
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            stub = podresources_grpc.PodResourcesListerStub(channel)
            response = await stub.List(podresources.ListPodResourcesRequest(), timeout=10)
        reply = await SchedulerClient(self.config.scheduler_socket, timeout=10.0).control(
            "prune_allocations",
            held=held_units(response, self.resource),
            grace=self.config.prune_grace,
        )
        retired = [str(r) for r in reply.get("retired", [])]
        if retired:
            self.log.info("gpushare device plugin: allocations of gone pods retired: %s", retired)
        return retired

    # -- serve and register -------------------------------------------------------------------

    async def start(self) -> None:
        """Serve, register, and follow the scheduler and the kubelet. A kubelet that is not up
        yet (or refuses) is not an error: registration is retried every refresh_interval."""
        if self.config.xid_health:
            self.xid_health = self.xids.start(asyncio.get_running_loop())
        else:
            self.xid_health = "switched off (xid_health = False)"
        if self.xid_health is not None:
            self.log.warning(
                "gpushare device plugin: no XID health checks: %s; a GPU's units turn "
                "Unhealthy only when the scheduler stops answering",
                self.xid_health,
            )
        if not self.events.enabled:
            self.log.info(
                "gpushare device plugin: no Kubernetes events (no API server or node name): "
                "problems are in this log only"
            )
        await self.refresh()
        await self._serve()
        try:
            await self.register()
        except grpc.aio.AioRpcError as exc:
            self.log.warning(
                "gpushare device plugin: cannot register yet (%s); retrying", exc.details()
            )
        self._loop_task = asyncio.ensure_future(self._follow())

    async def _serve(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)  # a previous run's socket: the kubelet cannot use it
        server = grpc.aio.server()
        api_grpc.add_DevicePluginServicer_to_server(_Servicer(self), server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._server = server
        self.log.info("gpushare device plugin: serving on %s", self.socket_path)

    async def register(self) -> None:
        """Register with the kubelet (raises grpc.aio.AioRpcError when it refuses)."""
        request = api.RegisterRequest(
            version=API_VERSION,
            endpoint=self.config.endpoint,
            resource_name=self.resource,
            options=api.DevicePluginOptions(get_preferred_allocation_available=True),
        )
        async with grpc.aio.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
            await api_grpc.RegistrationStub(channel).Register(request, timeout=10)
        self.registered = True
        self.registrations += 1
        self.log.info(
            "gpushare device plugin: registered %s with the kubelet at %s",
            self.resource,
            self.kubelet_socket,
        )

    async def _follow(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.config.refresh_interval)
            try:
                await self.refresh()
                if not os.path.exists(self.socket_path):
                    # The kubelet restarted (it empties its directory): serve and register again.
                    self.log.warning("gpushare device plugin: socket gone; registering again")
                    self.registered = False
                    await self._stop_server()
                    await self._serve()
                if not self.registered:  # also when the restarted kubelet was not up yet
                    await self.register()
                await self.prune_when_due()
            except Exception as exc:  # keep following; the next round retries
                self.log.warning("gpushare device plugin: will retry: %s", exc)

    async def _stop_server(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace=1.0)

    async def stop(self) -> None:
        self._stopping = True
        async with self._changed:
            self._changed.notify_all()  # ListAndWatch streams end
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        await self._stop_server()
        await asyncio.to_thread(self.xids.stop)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
