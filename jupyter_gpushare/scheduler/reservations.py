"""Placement reservations: which GPU a kernel about to start should use (the ``place`` action).

:mod:`.placement` holds the rule (the emptiest GPU that fits, a pin, the GPUs a kernel can
reach); this module remembers what was placed and has not connected yet, so that kernels started
at the same moment spread over the GPUs instead of all choosing the emptiest one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .placement import choose_device, device_loads

__all__ = ["Reservations"]


@dataclass
class Reservations:
    """Room reserved on a GPU for each placed kernel until it connects or the reservation ends."""

    #: At most this many kernels may be placed and not connected yet (oldest dropped first).
    limit: int = 4096
    #: client id -> (device uuid, need in bytes, monotonic expiry)
    held: dict[str, tuple[str, int, float]] = field(default_factory=dict)

    def place(
        self,
        now: float,
        devices: list[dict[str, Any]],
        connected: Callable[[str], bool],
        client_id: str,
        need: int,
        estimate: int,
        timeout: float,
        device: str | int | None = None,
        reachable: list[str] | None = None,
    ) -> dict[str, Any]:
        """Choose ``client_id``'s GPU among the status ``devices`` and reserve ``need`` there.

        Raises PlacementError (no device known, or a pin naming none).
        """
        # A reservation ends when its kernel connects (the policy counts it then) or expires.
        self.held = {
            cid: p
            for cid, p in self.held.items()
            if p[2] > now and cid != client_id and not connected(cid)
        }
        loads = device_loads(devices, [(p[0], p[1]) for p in self.held.values()], estimate)
        choice = choose_device(loads, need, device, reachable)
        while len(self.held) >= self.limit:
            del self.held[next(iter(self.held))]
        self.held[client_id] = (choice.uuid, need, now + timeout)
        return {
            "device": choice.uuid,
            "index": choice.index,
            "fits": choice.fits,
            "free_bytes": choice.free_bytes,
            "need": need,
            "reason": choice.reason,
            "devices": len(loads),
        }
