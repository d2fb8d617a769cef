"""The GPU taken at a scheduler restart (issue 22, item 3; A05, A06a, A06c, A07 in
docs/reliability.md), as real separate uids.

A restart opens a recovery window in which reconnecting shims say what they held and since when.
Each attack here is one way another user tried to profit from it: a resume secret of an old grant
(A06c), a plain client served before the window was armed (A06a), a forged ``since_ms`` (A05) and
the victim's client id taken first (A07). The scheduler runs in this process as root, restarted
on the same socket as a service manager restarts it; the shims are processes of other uids.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from local_users import (
    LocalUser,
    clients_of,
    collect,
    kill,
    open_to_everyone,
    recording_shim,
    run_as,
    shim,
    spawn_as,
    tmp_dir,
    until,
)

from jupyter_gpushare.protocol import Message, MsgType, encode, read_message_sync
from jupyter_gpushare.scheduler.shell import resume as resume_module

DEVICE = {"device_uuid": "GPU-restart-0", "device_total": 8 << 30}
BIG = 3 << 30  # two of these do not fit the 4 GiB pool: one holds at a time


@pytest.fixture(scope="module")
def users(local_users: Callable[[str], LocalUser]) -> dict[str, LocalUser]:
    return {role: local_users(role) for role in ("victim", "attack", "waiter")}


@pytest.fixture
def open_tmp() -> Iterator[str]:
    with tmp_dir(0o777) as path:
        yield path


async def node(make_scheduler: Any, **kw: Any) -> Any:
    sched = await make_scheduler(pool_size="4GiB", recovery_seconds=2.0, **kw)
    open_to_everyone(sched)
    return sched


async def collected(pid: int, rfd: int) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, collect, pid, rfd, 30)


def secret_of(heard: list[Any]) -> str:
    grants = [m for m in heard if m and m[0] == MsgType.GRANT]
    assert grants, heard
    return str(grants[-1][1]["resume_secret"])


async def stopped_with(first: Any, user: LocalUser, client_id: str, request: int, tmp: str) -> str:
    """``user``'s kernel ``client_id`` holds ``request`` bytes on ``first`` when it stops (as a
    service manager restarts it); the resume secret its GRANT gave."""
    stop = os.path.join(tmp, "stop")
    fields = {**DEVICE, "client_id": client_id}
    pid, rfd = spawn_as(user, recording_shim, str(first.socket_path), fields, request, stop)
    await until(lambda: clients_of(first).get(client_id, {}).get("state") == "running")
    await first.stop()  # with the kernel connected: the next scheduler expects it back
    return secret_of(await collected(pid, rfd))


def resume(client_id: str, mode: int, since_ms: int, secret: str = "") -> dict[str, Any]:
    fields = {**DEVICE, "client_id": client_id, "resume": mode, "since_ms": since_ms}
    fields["used_bytes"] = BIG
    return {**fields, "resume_secret": secret} if secret else fields


# -- A06c: the secret of an old grant ------------------------------------------------------------


async def test_a06c_an_old_grants_secret_does_not_take_the_gpu(
    make_scheduler: Any, users: dict[str, LocalUser], open_tmp: str
) -> None:
    victim, attacker = users["victim"], users["attack"]
    first = await node(make_scheduler)
    path = str(first.socket_path)
    # The attacker held the GPU once (its GRANT's secret), then left; the victim holds it now.
    old = await run_as(attacker, shim, path, {**DEVICE, "client_id": "a-k"}, BIG, 0.2)
    old_secret = secret_of(old)
    victim_secret = await stopped_with(first, victim, "v-k", BIG, open_tmp)

    second = await node(make_scheduler, socket_path=path)
    # The attacker reconnects first, claiming its old hold with its old grant's genuine secret.
    got = await run_as(attacker, shim, path, resume("a-k", 1, 1000, old_secret), 0, 0.5)
    assert got[0][0] == MsgType.WELCOME and got[0][1]["resume"] == 0, got
    got = await run_as(victim, shim, path, resume("v-k", 1, 1000, victim_secret), 0, 0.5)
    assert got[0][0] == MsgType.WELCOME and got[0][1]["resume"] == 1, got
    # The kept state proves one restart only: the same secret again is a plain claim.
    await second.stop()
    third = await node(make_scheduler, socket_path=path)
    got = await run_as(attacker, shim, path, resume("v-k", 1, 1000, victim_secret), 0, 0)
    assert got[0][1]["resume"] == 0, got
    await third.stop()


# -- A06a: served before the recovery window is armed --------------------------------------------


def eager_shim(path: str, fields: dict[str, Any], request: int, hold: float) -> list[Any]:
    """Connect as soon as the socket exists, HELLO, REQUEST; what came within ``hold`` s."""
    deadline = time.monotonic() + 30
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            break
        except OSError:
            sock.close()
            assert time.monotonic() < deadline, "the socket never appeared"
            time.sleep(0.005)
    sock.settimeout(10)
    sock.sendall(encode(Message(MsgType.HELLO, {"pid": os.getpid(), **fields})))
    sock.sendall(encode(Message(MsgType.REQUEST, {"used_bytes": request})))
    got = []
    end = time.monotonic() + hold
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            msg = read_message_sync(sock)
        except (TimeoutError, OSError):
            break
        if msg is None:
            break
        got.append((int(msg.type), dict(msg.fields)))
    sock.close()
    return got


async def test_a06a_nothing_is_granted_before_the_recovery_window_is_armed(
    make_scheduler: Any,
    users: dict[str, LocalUser],
    open_tmp: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    victim, attacker = users["victim"], users["attack"]
    first = await node(make_scheduler)
    path = str(first.socket_path)
    victim_secret = await stopped_with(first, victim, "v-k", BIG, open_tmp)

    # The next scheduler is slow between publishing its socket and arming the window (a slow
    # disk under its private directory): the attacker's shim is there the moment it appears.
    load = resume_module.ResumeKey.load_or_create

    def slow_load(directory: str) -> Any:
        time.sleep(1.0)
        return load(directory)

    monkeypatch.setattr(resume_module.ResumeKey, "load_or_create", slow_load)
    apid, arfd = spawn_as(attacker, eager_shim, path, {**DEVICE, "client_id": "a-k"}, BIG, 2.5)
    await asyncio.sleep(0.2)
    second = await node(make_scheduler, socket_path=path)
    got = await run_as(victim, shim, path, resume("v-k", 1, 1000, victim_secret), 0, 0.5)
    assert got[0][1]["resume"] == 1, got
    heard = await collected(apid, arfd)
    assert heard and heard[0][0] == MsgType.WELCOME, heard
    assert MsgType.GRANT not in [m[0] for m in heard], heard  # it waited for the holder
    await second.stop()


# -- A05: a forged since_ms ----------------------------------------------------------------------


async def test_a05_a_forged_since_ms_does_not_jump_the_queue(
    make_scheduler: Any, users: dict[str, LocalUser], open_tmp: str
) -> None:
    victim, attacker, waiter = users["victim"], users["attack"], users["waiter"]
    first = await node(make_scheduler)
    path = str(first.socket_path)
    stop = os.path.join(open_tmp, "stop")
    hpid, hrfd = spawn_as(victim, recording_shim, path, {**DEVICE, "client_id": "h-k"}, BIG, stop)
    await until(lambda: clients_of(first).get("h-k", {}).get("state") == "running")
    wpid, wrfd = spawn_as(waiter, recording_shim, path, {**DEVICE, "client_id": "w-k"}, BIG, stop)
    await until(lambda: clients_of(first).get("w-k", {}).get("state") == "waiting")
    await asyncio.sleep(1.0)  # the waiter has waited a second
    await first.stop()
    holder_secret = secret_of(await collected(hpid, hrfd))
    await collected(wpid, wrfd)

    second = await node(make_scheduler, socket_path=path)
    pids = [
        spawn_as(victim, shim, path, resume("h-k", 1, 2000, holder_secret), 0, 8.0),
        spawn_as(waiter, shim, path, resume("w-k", 2, 1000), BIG, 8.0),
        # The attacker never waited; it claims to have waited for a day.
        spawn_as(attacker, shim, path, resume("a-k", 2, 86_400_000), BIG, 8.0),
    ]
    try:
        await until(lambda: {"h-k", "w-k", "a-k"} <= set(clients_of(second)), 20)
        await until(lambda: len(second.status_document()["devices"][0]["queue"]) == 2, 20)
        assert second.status_document()["devices"][0]["queue"] == ["w-k", "a-k"]
    finally:
        for pid, rfd in pids:
            kill(pid)
            os.close(rfd)
    await second.stop()


# -- A07: the victim's id taken first at a restart -----------------------------------------------


async def test_a07_client_ids_keep_their_owner_across_a_restart(
    make_scheduler: Any, users: dict[str, LocalUser], open_tmp: str
) -> None:
    victim, attacker = users["victim"], users["attack"]
    first = await node(make_scheduler)
    path = str(first.socket_path)
    await stopped_with(first, victim, "v-k", 1 << 20, open_tmp)

    second = await node(make_scheduler, socket_path=path)
    apid, arfd = spawn_as(attacker, shim, path, {**DEVICE, "client_id": "v-k"}, 0, 8.0)
    try:
        await until(lambda: any(c["user"] == attacker.name for c in clients_of(second).values()))
        squat = [k for k, c in clients_of(second).items() if c["user"] == attacker.name]
        assert squat != ["v-k"] and squat[0].startswith("v-k#"), squat
    finally:
        kill(apid)
        os.close(arfd)
    await second.stop()
