"""The ``mps_env`` and ``mps_terminate`` control actions over the scheduler's MPS daemons.

:mod:`.mps` runs the daemons; this module answers the two actions a provisioner sends in MPS mode
(docs/mps.md, docs/protocol.md): the environment of a kernel about to start, and a
``terminate_client`` of a kernel's processes (MPS requires it before a SIGKILL), which only the
process's owner or an admin may ask for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

from ...protocol import ErrorCode
from ..shell import translate as tr
from ..shell.access import Access
from ..shell.transport import Connection
from .mps import MPSError, MPSManager, process_uid

__all__ = ["least_loaded_device", "mps_env", "mps_terminate"]


def least_loaded_device(manager: MPSManager, clients_per_device: Mapping[str, int]) -> str | None:
    """The MPS daemon's device with the fewest clients (``clients_per_device``: lower-case
    uuid -> count)."""
    daemons = list(manager.daemons)
    if not daemons:
        return None
    return min(daemons, key=lambda d: clients_per_device.get(d.lower(), 0))


def mps_env(
    manager: MPSManager | None,
    body: Mapping[str, Any],
    reply: dict[str, Any],
    clients_per_device: Mapping[str, int],
) -> tr.Refusal | None:
    """Fill ``reply`` with a kernel's MPS environment (nothing when MPS is off)."""
    request = tr.check_mps_env(body)
    if isinstance(request, tr.Refusal):
        return request
    if manager is None:
        return None
    device = request.device or least_loaded_device(manager, clients_per_device)
    try:
        reply.update(
            manager.client_env(
                device,
                weight=request.weight,
                compute_share=request.compute_share,
                quota_bytes=request.quota,
            )
        )
    except MPSError as exc:
        return tr.Refusal(ErrorCode.NOT_FOUND, f"mps_env: {exc}")
    return None


async def mps_terminate(
    manager: MPSManager | None,
    access: Access,
    conn: Connection,
    body: Mapping[str, Any],
    reply: dict[str, Any],
    shims: Iterable[Connection],
) -> tr.Refusal | None:
    """terminate_client the processes of the pid ``body`` names, if ``conn`` may."""
    request = tr.check_mps_terminate(body)
    if isinstance(request, tr.Refusal):
        return request
    pid, tree = request
    reply["pid"] = pid
    reply["terminated"] = []
    if manager is None:
        return None
    owner = await asyncio.get_running_loop().run_in_executor(None, process_uid, pid)
    if owner is None:
        return tr.Refusal(ErrorCode.NOT_FOUND, f"mps_terminate: no process {pid}")
    kernel_users = [c.identity.user for c in shims if c.peer.pid == pid and c.identity]
    if not access.may_terminate(conn.identity, conn.peer.uid, owner, kernel_users):
        text = f"mps_terminate: uid {conn.peer.uid} may not terminate pid {pid} (uid {owner})"
        return tr.Refusal(ErrorCode.FORBIDDEN, text)
    reply["terminated"] = await manager.terminate_process(pid, tree=tree)
    reply["ok"] = all(r["ok"] for r in reply["terminated"])
    return None
