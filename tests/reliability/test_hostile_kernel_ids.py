"""Kernel-id squatting (issue 22, item 9; A16c, A19d in docs/reliability.md), as real uids.

A kernel's id is world-readable in ``ps`` (``kernel-<id>.json``). Before the fix the first
``HELLO`` with an unseen id got it: another user who said ``HELLO`` with it before the kernel's
first CUDA call took the id, the victim's kernel became ``<id>#<pid>``, and her server's
``Release`` and busy/idle reports for the id were refused. The provisioner places each kernel
before it starts (the ``place`` control action, from the owner's own server): that binds the
id to the owner, so the squatter gets ``<id>#<pid>`` and the owner keeps the id. Placed or not,
it also binds the id to a secret it gives the kernel in its environment (``bind_kernel``,
``GPUSHARE_KERNEL_SECRET``; scheduler/shell/kernel_ids.py): only a HELLO with that secret gets
the id, and a squatter that came before the binding loses it.
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

from jupyter_gpushare.protocol import ErrorCode, MsgType
from jupyter_gpushare.scheduler.shell.kernel_ids import secret_digest

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


SECRET = "5e" * 32  # the kernel's secret, as its provisioner makes it (secrets.token_hex(32))
BIND = {"action": "bind_kernel", "client": KERNEL, "secret_sha256": secret_digest(SECRET)}


def _squatters(node: Any, attacker: LocalUser) -> list[str]:
    return sorted(k for k, c in clients_of(node).items() if c["user"] == attacker.name)


async def _victim_keeps_her_id(node: Any, victim: LocalUser, attacker: LocalUser) -> None:
    """The victim's kernel (with its secret) gets the id; her server's busy report and Release
    of it work; the attacker's Release of it is not_found and his clients keep other ids."""
    path = str(node.socket_path)
    pid, rfd = spawn_as(
        victim, shim, path, {**DEVICE, "client_id": KERNEL, "kernel_secret": SECRET}, 0, 30.0
    )
    try:
        await until(lambda: clients_of(node).get(KERNEL, {}).get("user") == victim.name)
        assert all(k.startswith(f"{KERNEL}#") for k in _squatters(node, attacker))
        busy = {"action": "kernel_state", "client": KERNEL, "state": "busy"}
        kind, _ = await run_as(victim, control, path, MsgType.CONTROL, busy)
        assert kind == MsgType.CONTROL_REPLY
        release = {"action": "release", "client": KERNEL}
        kind, reply = await run_as(attacker, control, path, MsgType.CONTROL, release)
        assert (kind, reply["error_code"]) == (MsgType.ERROR, ErrorCode.NOT_FOUND), reply
        kind, reply = await run_as(victim, control, path, MsgType.CONTROL, release)
        assert (kind, reply["body"]["client"]) == (MsgType.CONTROL_REPLY, KERNEL), reply
    finally:
        kill(pid)
        os.close(rfd)


async def test_a16c_a19d_an_unplaced_kernels_id_is_bound_to_its_secret(
    make_scheduler: Any, users: tuple[LocalUser, LocalUser]
) -> None:
    """No placement (place_kernels = False, or CUDA_VISIBLE_DEVICES set): the provisioner still
    binds the id to the kernel's secret before the kernel starts. Mallory's HELLOs with the id,
    without the secret or with a made-up one, get ``<id>#<pid>``, though they come first."""
    victim, attacker = users
    node = await make_scheduler(pool_size="4GiB")
    open_to_everyone(node)
    path = str(node.socket_path)
    await run_as(victim, control, path, MsgType.CONTROL, BIND)
    squats = [
        spawn_as(attacker, shim, path, {**DEVICE, "client_id": KERNEL, **extra}, 0, 30.0)
        for extra in ({}, {"kernel_secret": "guessed"})
    ]
    try:
        await until(lambda: len(_squatters(node, attacker)) == 2)
        assert KERNEL not in clients_of(node), _squatters(node, attacker)
        await _victim_keeps_her_id(node, victim, attacker)
    finally:
        for pid, rfd in squats:
            kill(pid)
            os.close(rfd)


async def test_a16c_a_squatter_before_the_binding_keeps_only_what_it_took_first(
    make_scheduler: Any, users: tuple[LocalUser, LocalUser]
) -> None:
    """Mallory says HELLO with the id before the victim's provisioner binds it (possible only
    for a kernel started while the scheduler was away: the provisioner binds before the kernel
    starts, and its id is in ``ps`` only after). A binding never takes an id from another
    user's live client (a ``bind_kernel`` names any id, every plain program's ``pid-<pid>``
    included: round 3, item 3), so the victim's bind is refused, nothing of hers is closed, and
    her kernel keeps working as ``<id>#<pid>``: the documented limit (docs/reliability.md)."""
    victim, attacker = users
    node = await make_scheduler(pool_size="4GiB")
    open_to_everyone(node)
    path = str(node.socket_path)
    first = spawn_as(attacker, shim, path, {**DEVICE, "client_id": KERNEL}, 0, 30.0)
    kernel = (-1, -1)
    try:
        await until(lambda: clients_of(node).get(KERNEL, {}).get("user") == attacker.name)
        kind, reply = await run_as(victim, control, path, MsgType.CONTROL, BIND)
        assert (kind, reply["error_code"]) == (MsgType.ERROR, ErrorCode.FORBIDDEN), reply
        assert "live client of another user" in reply["message"], reply
        fields = {**DEVICE, "client_id": KERNEL, "kernel_secret": SECRET}
        kernel = spawn_as(victim, shim, path, fields, 0, 30.0)
        await until(lambda: any(c["user"] == victim.name for c in clients_of(node).values()))
        hers = [k for k, c in clients_of(node).items() if c["user"] == victim.name]
        assert hers[0].startswith(f"{KERNEL}#"), hers
        release = {"action": "release", "client": hers[0]}
        kind, reply = await run_as(victim, control, path, MsgType.CONTROL, release)
        assert kind == MsgType.CONTROL_REPLY, reply
    finally:
        for pid, rfd in (first, kernel):
            if pid > 0:
                kill(pid)
                os.close(rfd)


async def test_a16c_a_binding_outlives_a_scheduler_restart(
    make_scheduler: Any, users: tuple[LocalUser, LocalUser]
) -> None:
    """The binding is kept with the scheduler's state (.resume.KeptState): after a restart,
    before the kernel ever connected, a HELLO with the id but not the secret still gets
    ``<id>#<pid>``."""
    victim, attacker = users
    first = await make_scheduler(pool_size="4GiB", recovery_seconds=1.0)
    open_to_everyone(first)
    path = str(first.socket_path)
    await run_as(victim, control, path, MsgType.CONTROL, BIND)
    await first.stop()
    second = await make_scheduler(pool_size="4GiB", recovery_seconds=1.0, socket_path=path)
    open_to_everyone(second)
    squat = spawn_as(attacker, shim, path, {**DEVICE, "client_id": KERNEL}, 0, 30.0)
    try:
        await until(lambda: len(_squatters(second, attacker)) == 1)
        assert KERNEL not in clients_of(second), _squatters(second, attacker)
        await _victim_keeps_her_id(second, victim, attacker)
    finally:
        kill(squat[0])
        os.close(squat[1])
