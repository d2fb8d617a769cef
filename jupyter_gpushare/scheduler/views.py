"""What each peer may see of the status document (docs/protocol.md, "Who sees what").

An admin sees the document in full. Anyone else sees their own clients in full and everyone
else's only summed per user: how many clients, how much memory, how much GPU time, how many hold
the device or wait. Other users' client ids, pids, labels (notebook paths, command lines) and
quotas never leave the scheduler for them. Queue and holder *order* stays visible by user name
(``holder_users``, ``queue_users``), so a user can see who they wait behind, not what runs.
"""

from __future__ import annotations

from typing import Any

from .users import Identity

__all__ = ["filter_status"]

#: Per-user sums of other users' clients.
_SUMMED = ("used_bytes", "evicted_bytes", "gpu_seconds", "wait_seconds", "weight")


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
