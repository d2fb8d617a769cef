"""The status snapshot: what ``status``, the sidebar and the wait line show of the policy.

Pure, like the policy (:mod:`.policy`): it reads the policy's records (:mod:`.policy_state`) and
the few rulings only the policy can make (:class:`DeviceFacts`: the queue's order, each holder's
quantum, whether a waiter is paused by the ordering, whether the scheduler is recovering), and
builds one dict per device in the status document's shape (docs/protocol.md). It decides
nothing and changes no state; who holds, why a client waits and its place in the queue are all
worked out here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .policy_state import ClientState, DeviceState

__all__ = ["DeviceFacts", "device_status", "duration_text"]


@dataclass(frozen=True)
class DeviceFacts:
    """The policy's rulings on one device at the snapshot's time."""

    queue: Sequence[ClientState]  # waiters, highest priority first
    quantum: Callable[[ClientState], float]  # a holder's time slice, in seconds
    paused_for_order: Callable[[ClientState], bool]  # a waiter waits only for shorter cells
    recovering: bool  # the scheduler restarted: grants are held back (Policy.recover_until)
    resident_bytes: int  # what the policy accounts as on the GPU
    base_quantum: float  # the quantum when no holder runs
    starvation_window: float  # the ordering's bound on a pause (OrderingConfig)
    # Why waiters wait for host memory (the node's host budget is full, .host_budget); None: not
    host_full: str | None = None


def device_status(dev: DeviceState, facts: DeviceFacts, now: float, dt: float) -> dict[str, Any]:
    """One device's status at ``now``; ``dt`` is the time since the policy's last event."""
    position = {c.id: i + 1 for i, c in enumerate(facts.queue)}
    holders = [c for c in dev.clients.values() if c.holding is not None]
    running = [c for c in holders if c.holding == "running"]
    quantum = max((facts.quantum(c) for c in running), default=facts.base_quantum)
    return {
        "uuid": dev.uuid,
        "name": dev.name,
        "total_bytes": dev.total_bytes,
        "pool_bytes": dev.pool_bytes,
        "resident_bytes": facts.resident_bytes,
        "mode": "turns" if dev.turns else "shared",
        "quantum_ms": round(quantum * 1000),
        "holders": [c.id for c in holders],
        "queue": [c.id for c in facts.queue],
        "clients": [
            {**_client_status(c, dt, position), **_explain(dev, facts, c, now, position)}
            for c in dev.clients.values()
        ],
    }


def _explain(
    dev: DeviceState, facts: DeviceFacts, c: ClientState, now: float, position: dict[str, int]
) -> dict[str, Any]:
    """Why a waiter waits, and how long a holder has held (docs/reliability.md).

    Holders get ``held_seconds`` (this turn), ``quantum_seconds`` and, once a revoke is
    pending, ``revoking_seconds``. Waiters get ``wait``: a machine-readable ``reason``, the
    ``holders`` in its way and a ``text`` for people, e.g. "waiting for alice's kernel:
    asked to release the GPU 4 min ago, 3 min past its 60 s quantum".
    """
    if c.holding is not None:
        out: dict[str, Any] = {
            "held_seconds": max(0.0, now - c.run_start),
            "quantum_seconds": facts.quantum(c),
            "revoking_seconds": None,
        }
        if c.holding == "revoking":
            out["revoking_seconds"] = max(0.0, now - c.revoked_at)
        return out
    if c.waiting_since is None:
        return {"wait": None}
    holders = sorted(
        (h for h in dev.clients.values() if h.holding is not None),
        key=lambda h: (h.holding != "revoking", -(now - h.run_start), h.seq),
    )
    ahead = position.get(c.id, 1) - 1
    about = [
        {
            "id": h.id,
            "user": h.user,
            "state": h.holding,
            "held_seconds": max(0.0, now - h.run_start),
            "quantum_seconds": facts.quantum(h),
            # The same sum the policy compares a holder's expiry with (Policy._expires_at).
            "past_quantum_seconds": max(0.0, now - (h.run_start + facts.quantum(h))),
            "revoking_seconds": max(0.0, now - h.revoked_at) if h.holding == "revoking" else None,
        }
        for h in holders
    ]
    if facts.recovering:
        reason, text = "recovering", "the scheduler restarted: waiting for kernels to reconnect"
    elif about and about[0]["state"] == "revoking":
        h = about[0]
        reason = "releasing"
        text = (
            f"waiting for {h['user']}'s kernel to finish its GPU work: asked to release "
            f"{duration_text(h['revoking_seconds'])} ago"
        )
        if h["past_quantum_seconds"] > 0:
            text += (
                f", {duration_text(h['past_quantum_seconds'])} past its "
                f"{duration_text(h['quantum_seconds'])} quantum"
            )
    elif facts.paused_for_order(c):
        left = c.waiting_since + facts.starvation_window - now
        reason = "shorter_first"
        text = (
            "paused while shorter cells run (memory kept on the GPU): resumes when they "
            f"end, in {duration_text(left)} at most"
        )
    elif facts.host_full and not about:
        reason, text = "host_memory", facts.host_full
    elif ahead > 0:
        reason = "queue"
        text = f"waiting behind {ahead} other kernel{'s' if ahead > 1 else ''}"
    elif about:
        h = about[0]
        left = h["quantum_seconds"] - h["held_seconds"]
        if left > 0:
            reason = "turn"
            text = f"waiting for {h['user']}'s kernel: its turn ends in {duration_text(left)}"
        else:
            reason = "past_quantum"
            text = (
                f"waiting for {h['user']}'s kernel, holding {duration_text(-left)} past its "
                f"{duration_text(h['quantum_seconds'])} quantum"
            )
    else:
        reason, text = "memory", "waiting for memory to be moved to the host"
    wait: dict[str, Any] = {"reason": reason, "text": text, "holders": about}
    if reason == "memory":
        # What is on its way to the host now (the wait line says how much).
        wait["moving_bytes"] = dev.incoming_bytes  # partial evictions count what they free
    return {"wait": wait}


def _client_status(c: ClientState, dt: float, position: dict[str, int]) -> dict[str, Any]:
    return {
        "id": c.id,
        "pid": c.pid,
        "uid": c.uid,
        "user": c.user,
        "label": c.label,
        "state": c.state,
        "idle": c.idle,  # its cell ended (Jupyter or the shim said so): deep idle reads it
        # Jupyter reports its cells (busy/idle): deep idle sleeps only such kernels, which a
        # busy wakes before the cell's first CUDA call.
        "notebook": c.cell.tracked,
        "used_bytes": c.used,
        "managed_bytes": c.managed,
        "pinned_bytes": c.pinned,
        "evicted_bytes": c.evicted,
        "precopied_bytes": c.precopied,
        # Host memory (.host_budget): what its engine holds on the host, the part that is
        # staging of resident memory, and the staging allowance it was told (None: none).
        "host_bytes": c.host,
        "staging_bytes": c.staging,
        "staging_allowed_bytes": c.staging_allowed,
        "quota_bytes": c.quota,
        "weight": float(c.weight),
        "gpu_seconds": c.gpu_seconds + (dt if c.holding is not None else 0.0),
        "wait_seconds": c.wait_seconds + (dt if c.waiting_since is not None else 0.0),
        "waiting_since": c.waiting_since,
        "queue_position": position.get(c.id),
        "last_restore": None
        if c.last_restore is None
        else {"bytes": c.last_restore[0], "seconds": round(c.last_restore[1], 6)},
    }


def duration_text(seconds: float | None) -> str:
    """A short duration for the status texts: "45 s", "4 min", "2 h 5 min"."""
    s = max(0, round(seconds or 0.0))
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60} min"
