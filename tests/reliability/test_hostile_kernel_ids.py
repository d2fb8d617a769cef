"""Kernel-id squatting (issue 22, item 9; A16c, A19d in docs/reliability.md), as real uids.

A kernel's id is world-readable in ``ps`` (``kernel-<id>.json``). Before the fix the first
``HELLO`` with an unseen id got it: another user who said ``HELLO`` with it before the kernel's
first CUDA call took the id, the victim's kernel became ``<id>#<pid>``, and her server's
``Release`` and busy/idle reports for the id were refused. The provisioner places each kernel
before it starts (the ``place`` control action, from the owner's own server): that binds the
id to the owner, so the squatter gets ``<id>#<pid>`` and the owner keeps the id.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from local_users import (
    LocalUser,
    clients_of,
    control,
    kill,
    open_to_everyone,
    run_as,
    shim,
    spawn_as,
    until,
)

from jupyter_gpushare.protocol import MsgType

DEVICE = {"device_uuid": "GPU-ids-0", "device_total": 8 << 30}
KERNEL = "0f3c2a54-6b7e-4c1d-9a8f-1e2d3c4b5a69"  # a Jupyter kernel id, as ps shows it


@pytest.fixture(scope="module")
def users(local_users: Callable[[str], LocalUser]) -> tuple[LocalUser, LocalUser]:
    return local_users("victim"), local_users("attack")


async def test_a16c_a19d_a_placed_kernels_id_stays_its_owners(
    make_scheduler: Any, users: tuple[LocalUser, LocalUser]
) -> None:
    victim, attacker = users
    node = await make_scheduler(pool_size="4GiB")
    open_to_everyone(node)
    path = str(node.socket_path)
    # The victim's provisioner places her kernel before starting it (no GPU known yet: the
    # answer is not_found, the kernel starts anyway; the id is hers all the same).
    await run_as(victim, control, path, MsgType.CONTROL, {"action": "place", "client": KERNEL})
    # Mallory reads the id in ps and says HELLO with it first.
    apid, arfd = spawn_as(attacker, shim, path, {**DEVICE, "client_id": KERNEL}, 0, 30.0)
    vpid, vrfd = -1, -1
    try:
        await until(lambda: any(c["user"] == attacker.name for c in clients_of(node).values()))
        squat = [k for k, c in clients_of(node).items() if c["user"] == attacker.name]
        assert squat != [KERNEL] and squat[0].startswith(f"{KERNEL}#"), squat
        # The victim's kernel gets its own id; her server's reports and Release work.
        vpid, vrfd = spawn_as(victim, shim, path, {**DEVICE, "client_id": KERNEL}, 0, 30.0)
        await until(lambda: clients_of(node).get(KERNEL, {}).get("user") == victim.name)
        busy = {"action": "kernel_state", "client": KERNEL, "state": "busy"}
        kind, _ = await run_as(victim, control, path, MsgType.CONTROL, busy)
        assert kind == MsgType.CONTROL_REPLY
        release = {"action": "release", "client": KERNEL}
        kind, _ = await run_as(victim, control, path, MsgType.CONTROL, release)
        assert kind == MsgType.CONTROL_REPLY
    finally:
        for pid, rfd in ((apid, arfd), (vpid, vrfd)):
            if pid > 0:
                kill(pid)
                os.close(rfd)
