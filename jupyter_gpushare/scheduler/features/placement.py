"""Which GPU a new kernel goes to: a pure function of the node's devices and their load.

The scheduler answers the ``place`` control action (docs/protocol.md) with :func:`choose_device`;
the kernel provisioner then starts the kernel with ``CUDA_VISIBLE_DEVICES=<that GPU's UUID>``, so
the kernel's CUDA sees that one GPU and its shim registers there. Nothing here does I/O or reads a
clock, so the rule is tested exhaustively (tests/policy/test_placement.py).

The rule
--------
Every kernel on a device *commits* memory: ``max(used, expected)``, where ``expected`` is its quota
when it has one, else the scheduler's default estimate (``GPUShareScheduler.placement_estimate``).
A kernel placed but not yet connected (it has not used CUDA yet) commits the need it was placed
with, for as long as its reservation lasts. A device's *free room* is its pool minus what is
committed there.

0. Only the devices the kernel can reach are candidates, when the caller says which (a Jupyter
   server in a container sees only the GPUs given to it, while a node-wide scheduler sees all).
1. A pinned kernel (by index or UUID) goes to that device, whether it fits or not.
2. Otherwise, of the devices where the kernel's need fits the free room, the one with the most
   free room; ties go to the device with fewer kernels, then to the lower index.
3. When it fits nowhere, the device with the most free room (the least over-committed), with the
   same tie-breakers: a kernel is never refused a GPU, it takes turns there.

Most free room first *spreads* kernels over the GPUs: kernels on different GPUs run at the same
time, while kernels on one GPU share its compute even when their memory fits side by side.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DeviceLoad",
    "Placement",
    "PlacementError",
    "choose_device",
    "committed_bytes",
    "device_loads",
    "resolve_device",
]


class PlacementError(ValueError):
    """No device can be chosen: none is known, or a pin names no known device."""


@dataclass(frozen=True)
class DeviceLoad:
    """One device as placement sees it."""

    uuid: str
    index: int | None  # NVML's (nvidia-smi's) index; None for a device learnt from a shim
    pool_bytes: int
    committed_bytes: int
    clients: int  # connected kernels plus kernels placed there that have not connected yet

    @property
    def free_bytes(self) -> int:
        return self.pool_bytes - self.committed_bytes


@dataclass(frozen=True)
class Placement:
    """The answer: where the kernel goes, and why."""

    uuid: str
    index: int | None
    fits: bool  # the need fitted the device's free room
    free_bytes: int  # the device's free room before this kernel
    reason: str


def committed_bytes(used: int, quota: int, estimate: int) -> int:
    """What one kernel commits on its device: its use, or more when it is expected to grow."""
    expected = quota if quota > 0 else estimate
    return max(used, expected, 0)


def device_loads(
    devices: Iterable[Mapping[str, Any]],
    reservations: Iterable[tuple[str, int]],
    estimate: int,
) -> list[DeviceLoad]:
    """Loads from status-document devices (``uuid``, ``index``, ``pool_bytes``, ``clients`` with
    ``used_bytes`` and ``quota_bytes``) and the reservations ``(device uuid, need)`` of kernels
    placed but not connected yet."""
    extra: dict[str, list[int]] = {}
    for uuid, need in reservations:
        extra.setdefault(uuid.lower(), []).append(max(0, need))
    loads = []
    for dev in devices:
        uuid = str(dev["uuid"])
        clients = list(dev.get("clients") or [])
        reserved = extra.get(uuid.lower(), [])
        committed = sum(
            committed_bytes(int(c.get("used_bytes") or 0), int(c.get("quota_bytes") or 0), estimate)
            for c in clients
        )
        index = dev.get("index")
        loads.append(
            DeviceLoad(
                uuid=uuid,
                index=index if isinstance(index, int) else None,
                pool_bytes=int(dev.get("pool_bytes") or 0),
                committed_bytes=committed + sum(reserved),
                clients=len(clients) + len(reserved),
            )
        )
    return loads


def resolve_device(devices: Sequence[DeviceLoad], pin: str | int) -> DeviceLoad:
    """The device a pin names: an index (``1``, ``"1"``), a full UUID (any case) or a unique
    UUID prefix of at least 8 characters after ``GPU-`` (as CUDA_VISIBLE_DEVICES accepts)."""
    text = str(pin).strip()
    if isinstance(pin, bool):
        raise PlacementError(f"device {pin!r}: give an index or a GPU UUID")
    if text.isdigit():
        index = int(text)
        for dev in devices:
            if dev.index == index:
                return dev
        known = sorted(d.index for d in devices if d.index is not None)
        raise PlacementError(f"no device with index {index} (known indexes: {known or 'none'})")
    key = text.lower()
    exact = [d for d in devices if d.uuid.lower() == key]
    if exact:
        return exact[0]
    prefix = key if key.startswith(("gpu-", "mig-")) else f"gpu-{key}"
    if len(prefix) >= 12:
        found = [d for d in devices if d.uuid.lower().startswith(prefix)]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise PlacementError(f"device {text!r} matches {len(found)} devices: give more of it")
    raise PlacementError(
        f"no device {text!r} (known: {', '.join(d.uuid for d in devices) or 'none'})"
    )


def choose_device(
    devices: Sequence[DeviceLoad],
    need: int,
    pin: str | int | None = None,
    reachable: Collection[str] | None = None,
) -> Placement:
    """Where a kernel needing ``need`` bytes goes (see the module docstring for the rule).

    ``reachable``: the UUIDs of the GPUs the kernel can use (None: all of them).
    """
    if not devices:
        raise PlacementError("no GPU is known to the scheduler")
    if reachable is not None:
        wanted = {u.lower() for u in reachable}
        devices = [d for d in devices if d.uuid.lower() in wanted]
        if not devices:
            raise PlacementError(
                f"none of the GPUs the kernel can reach ({', '.join(sorted(wanted)) or 'none'}) "
                "is known to the scheduler"
            )
    if pin is not None and str(pin).strip() != "":
        dev = resolve_device(devices, pin)
        fits = need <= dev.free_bytes
        return Placement(dev.uuid, dev.index, fits, dev.free_bytes, "pinned")

    def key(dev: DeviceLoad) -> tuple[int, int, float]:
        index = float("inf") if dev.index is None else float(dev.index)
        return (-dev.free_bytes, dev.clients, index)

    fitting = [d for d in devices if need <= d.free_bytes]
    if fitting:
        dev = min(fitting, key=key)
        reason = "most free memory" if len(fitting) > 1 else "the only GPU it fits"
        return Placement(dev.uuid, dev.index, True, dev.free_bytes, reason)
    dev = min(devices, key=key)
    return Placement(dev.uuid, dev.index, False, dev.free_bytes, "fits nowhere: least committed")
