"""Placement reservations: which GPU a kernel about to start should use (the ``place`` action).

:mod:`.placement` holds the rule (the emptiest GPU that fits, a pin, the GPUs a kernel can
reach); this module remembers what was placed and has not connected yet, so that kernels started
at the same moment spread over the GPUs instead of all choosing the emptiest one.

A reservation is a claim of room by whoever placed it, believed until its kernel connects or it
expires, and bounded (A26, issue 22): one kernel reserves at most the largest pool, an owner
has at most ``per_owner`` pending (their oldest make way for their newest). Other users'
reservations are only hints: where, with them, no GPU has the room a kernel needs but without
them one has, the kernel is placed as if they did not exist. So ghost placements that never
connect cannot make every GPU look full to anyone else.
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
    #: Reservations one owner (a user) may have pending at once.
    per_owner: int = 16
    #: client id -> (device uuid, need in bytes, monotonic expiry)
    held: dict[str, tuple[str, int, float]] = field(default_factory=dict)
    #: client id -> the user who placed it
    owners: dict[str, str] = field(default_factory=dict)

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
        owner: str = "",
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
        self.owners = {cid: who for cid, who in self.owners.items() if cid in self.held}
        largest = max((int(d.get("pool_bytes") or 0) for d in devices), default=0)
        self._make_way(owner)
        loads = device_loads(devices, [(p[0], p[1]) for p in self.held.values()], estimate)
        choice = choose_device(loads, need, device, reachable)
        if not choice.fits:
            own = [(p[0], p[1]) for cid, p in self.held.items() if self.owners.get(cid) == owner]
            alone = choose_device(device_loads(devices, own, estimate), need, device, reachable)
            if alone.fits:
                choice = alone
        while len(self.held) >= self.limit:
            oldest = next(iter(self.held))
            del self.held[oldest]
            self.owners.pop(oldest, None)
        kept = min(need, largest) if largest > 0 else need  # no more than a GPU's room
        self.held[client_id] = (choice.uuid, kept, now + timeout)
        self.owners[client_id] = owner
        return {
            "device": choice.uuid,
            "index": choice.index,
            "fits": choice.fits,
            "free_bytes": choice.free_bytes,
            "need": need,
            "reason": choice.reason,
            "devices": len(loads),
        }

    def _make_way(self, owner: str) -> None:
        """Drop ``owner``'s oldest reservations until one more keeps them within
        ``per_owner``."""
        mine = [cid for cid in self.held if self.owners.get(cid) == owner]
        while len(mine) >= self.per_owner:
            oldest = mine.pop(0)
            del self.held[oldest]
            del self.owners[oldest]
