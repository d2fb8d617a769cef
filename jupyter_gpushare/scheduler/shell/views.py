"""What each peer may see of the status document (docs/protocol.md, "Who sees what").

An admin sees the document in full. Anyone else sees their own clients in full and everyone
else's only summed per user: how many clients, how much memory, how much GPU time, how many hold
the device or wait. Other users' client ids, pids, labels (notebook paths, command lines) and
quotas never leave the scheduler for them. Queue and holder *order* stays visible by user name
(``holder_users``, ``queue_users``), so a user can see who they wait behind, not what runs.
"""

from __future__ import annotations

import json
from typing import Any

from .users import Identity

__all__ = ["STATUS_BUDGET", "filter_status", "fit_status"]

#: Bytes of JSON a status document may take to fit a STATUS frame (64 KiB) with room to spare.
STATUS_BUDGET = 56_000

#: Per-user sums of other users' clients.
_SUMMED = (
    "used_bytes",
    "evicted_bytes",
    "host_bytes",
    "gpu_seconds",
    "wait_seconds",
    "weight",
)


def _identity(viewer: Identity) -> dict[str, Any]:
    return {"user": viewer.user, "admin": viewer.admin, "by": "token" if viewer.token else "uid"}


def filter_status(doc: dict[str, Any], viewer: Identity) -> dict[str, Any]:
    """``doc`` as ``viewer`` may see it (a new document; ``doc`` is not changed)."""
    out = dict(doc)
    out["identity"] = _identity(viewer)
    if viewer.admin:
        return out
    devices = []
    for dev in doc.get("devices", []):
        clients = dev.get("clients", [])
        users = {str(c.get("id")): str(c.get("user", "")) for c in clients}
        mine = [c for c in clients if c.get("user") == viewer.user]
        own_ids = {str(c.get("id")) for c in mine}
        others: dict[str, dict[str, Any]] = {}
        for c in clients:
            user = str(c.get("user", ""))
            if user == viewer.user:
                continue
            agg = others.setdefault(
                user,
                {"user": user, "clients": 0, "running": 0, "waiting": 0, "resident_bytes": 0}
                | {k: 0 for k in _SUMMED},
            )
            agg["clients"] += 1
            state = c.get("state")
            agg["running"] += int(state in ("running", "revoking"))
            agg["waiting"] += int(state == "waiting")
            for key in _SUMMED:
                agg[key] += c.get(key) or 0
            agg["resident_bytes"] += max(
                int(c.get("used_bytes") or 0) - int(c.get("evicted_bytes") or 0), 0
            )
        view = dict(dev)
        view["clients"] = [_without_others_ids(c, own_ids) for c in mine]
        view["holders"] = [h for h in dev.get("holders", []) if h in own_ids]
        view["queue"] = [q for q in dev.get("queue", []) if q in own_ids]
        view["holder_users"] = [users.get(h, "") for h in dev.get("holders", [])]
        view["queue_users"] = [users.get(q, "") for q in dev.get("queue", [])]
        view["others"] = [others[u] for u in sorted(others)]
        devices.append(view)
    out["devices"] = devices
    return out


def _without_others_ids(client: dict[str, Any], own_ids: set[str]) -> dict[str, Any]:
    """``client`` with the ids of other users' kernels it waits behind left out (``wait.holders``
    says their user and state; an id would let the viewer act on, or squat, that kernel's id)."""
    wait = client.get("wait")
    if not isinstance(wait, dict) or not wait.get("holders"):
        return client
    holders = [
        h if str(h.get("id")) in own_ids else {k: v for k, v in h.items() if k != "id"}
        for h in wait["holders"]
    ]
    return {**client, "wait": {**wait, "holders": holders}}


def _size(doc: dict[str, Any]) -> int:
    return len(json.dumps(doc, default=str))


def _user_sums(clients: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-user counts and sums of ``clients``, the biggest user (memory used) first."""
    sums: dict[str, dict[str, Any]] = {}
    for c in clients:
        user = str(c.get("user", ""))
        row = sums.setdefault(
            user, {"user": user, "clients": 0, "running": 0, "waiting": 0, "used_bytes": 0}
        )
        row["clients"] += 1
        row["running"] += int(c.get("state") in ("running", "revoking"))
        row["waiting"] += int(c.get("state") == "waiting")
        row["used_bytes"] += int(c.get("used_bytes") or 0)
    return sorted(sums.values(), key=lambda r: (-r["used_bytes"], -r["clients"], r["user"]))


def fit_status(doc: dict[str, Any], budget: int = STATUS_BUDGET) -> dict[str, Any]:
    """``doc`` cut to fit a STATUS frame, keeping what an operator needs most.

    A document that fits is returned as it is. Otherwise the labels go, each device's clients
    are listed biggest first (memory used) and as many as fit stay (the same number on every
    device), and each device says how many it left out (``clients_truncated``) and gives every
    user's counts and sums (``users``, the biggest first): hundreds of small connections never
    hide the kernel that holds the GPU, nor who they belong to."""
    if _size(doc) <= budget:
        return doc
    out = dict(doc)
    devices = []
    for dev in doc.get("devices", []):
        clients = [{k: v for k, v in c.items() if k != "label"} for c in dev.get("clients", [])]
        clients.sort(key=lambda c: -int(c.get("used_bytes") or 0))
        devices.append({**dev, "clients": clients, "users": _user_sums(clients)})
    out["devices"] = devices
    out["labels_truncated"] = True
    if _size(out) <= budget:
        return out
    full = [d["clients"] for d in devices]
    low, high = 0, max((len(c) for c in full), default=0)
    while low < high:  # the most clients per device that fit
        mid = (low + high + 1) // 2
        for dev, clients in zip(devices, full, strict=True):
            dev["clients"] = clients[:mid]
        if _size(out) <= budget:
            low = mid
        else:
            high = mid - 1
    for dev, clients in zip(devices, full, strict=True):
        dev["clients"] = clients[:low]
        if len(clients) > low:
            dev["clients_truncated"] = len(clients) - low
    out["truncated"] = True
    return out
