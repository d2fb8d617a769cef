"""Kernel-id bindings and id owners against a hostile local user, round 3 (docs/reliability.md,
"A hostile local user", round 3), as real separate uids.

Before, one ordinary user could undo another's kernel-id binding five ways: the newest 1,024
bindings of all users together were kept across a restart; ``state.json`` was bounded in entries
but read only up to 4 MiB, so long ids made the next scheduler keep nothing; ``bind_kernel``
took an id from another user's live client (a plain program's ``pid-<pid>``, a kernel started
while the scheduler was away); a kernel whose provisioner could not reach the scheduler stayed
unbound for good; and one list of 16,384 id owners for everyone was flushed by 16,500 binds.
Each test below failed on that code.
"""

from __future__ import annotations

import _strptime  # noqa: F401  (jupyter_client uses it; the other users cannot read the stdlib)
import asyncio
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.kernelspec import KernelSpec
from local_users import (
    LocalUser,
    clients_of,
    collect,
    control,
    kill,
    open_to_everyone,
    run_as,
    shim,
    spawn_as,
    tmp_dir,
    until,
)
from test_hostile_kernel_ids import BIND, DEVICE, KERNEL, SECRET, _victim_keeps_her_id

from jupyter_gpushare.protocol import ErrorCode, Message, MsgType, encode, read_message_sync
from jupyter_gpushare.provisioner import PROVISIONER_NAME, GPUShareProvisioner
from jupyter_gpushare.scheduler.shell.kernel_ids import (
    ENV_KERNEL_SECRET,
    OWNED_PER_USER,
    PER_USER,
    secret_digest,
)
from jupyter_gpushare.scheduler.shell.resume import MAX_STATE_BYTES, KeptState

# An id as long as a HELLO may send, of astral-plane characters (12 bytes each in JSON).
LONG = "\U0001f600" * 249


@pytest.fixture(scope="module")
def users(local_users: Callable[[str], LocalUser]) -> tuple[LocalUser, LocalUser]:
    return local_users("alice"), local_users("mallory")


def bind_many(path: str, ids: list[str], digest: str) -> int:
    """``bind_kernel`` of each id, on one connection (as fast as the scheduler reads); how many
    were bound."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60.0)
    sock.connect(path)
    bound = 0
    for start in range(0, len(ids), 64):  # 64 in flight at a time
        batch = ids[start : start + 64]
        for cid in batch:
            body = {"action": "bind_kernel", "client": cid, "secret_sha256": digest}
            sock.sendall(encode(Message(MsgType.CONTROL, {"body": body})))
        for _ in batch:
            reply = read_message_sync(sock)
            bound += reply is not None and reply.type == MsgType.CONTROL_REPLY
    sock.close()
    return bound


def hold_shims(path: str, ids: list[str], stop: str) -> int:
    """One connection per id, each a HELLO with that id, held until ``stop`` exists; how many
    were welcomed."""
    socks, welcomed = [], 0
    for cid in ids:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(20.0)
        sock.connect(path)
        hello = {"pid": os.getpid(), "client_id": cid, **DEVICE}
        sock.sendall(encode(Message(MsgType.HELLO, hello)))
        reply = read_message_sync(sock)
        welcomed += reply is not None and reply.type == MsgType.WELCOME
        socks.append(sock)
    deadline = time.monotonic() + 60
    while not os.path.exists(stop) and time.monotonic() < deadline:
        time.sleep(0.05)
    for sock in socks:
        sock.close()
    return welcomed


def _mine(node: Any, user: LocalUser) -> list[str]:
    return sorted(k for k, c in clients_of(node).items() if c["user"] == user.name)


async def _bind_refused(user: LocalUser, path: str, client: str, digest: str = "0" * 64) -> None:
    body = {"action": "bind_kernel", "client": client, "secret_sha256": digest}
    kind, reply = await run_as(user, control, path, MsgType.CONTROL, body)
    assert (kind, reply.get("error_code")) == (MsgType.ERROR, ErrorCode.FORBIDDEN), reply


async def _restarted(make_scheduler: Any, first: Any) -> Any:
    """``first`` stopped and a new scheduler on its socket (it reads what ``first`` kept)."""
    path = str(first.socket_path)
    await first.stop()
    second = await make_scheduler(pool_size="4GiB", recovery_seconds=1.0, socket_path=path)
    open_to_everyone(second)
    return second


async def _her_kernel_keeps_her_id(node: Any, alice: LocalUser, mallory: LocalUser) -> None:
    """Mallory's HELLO with alice's id, first, gets ``<id>#<pid>`` and her bind of it is
    refused; alice's kernel (with its secret) gets the id, her release of it works."""
    path = str(node.socket_path)
    squat = spawn_as(mallory, shim, path, {**DEVICE, "client_id": KERNEL}, 0, 30.0)
    try:
        await until(lambda: len(_mine(node, mallory)) == 1)
        assert _mine(node, mallory)[0].startswith(f"{KERNEL}#"), _mine(node, mallory)
        await _bind_refused(mallory, path, KERNEL, secret_digest("mallory's"))
        await _victim_keeps_her_id(node, alice, mallory)
    finally:
        kill(squat[0])
        os.close(squat[1])


async def test_r3_1_a_binding_outlives_a_restart_whatever_another_user_binds(
    make_scheduler: Any, users: tuple[LocalUser, LocalUser]
) -> None:
    """Before: only the newest 1,024 bindings of all users together were kept; mallory's 1,100
    made after alice's pushed hers out of the next scheduler."""
    alice, mallory = users
    first = await make_scheduler(pool_size="4GiB", recovery_seconds=1.0, frames_per_second=0)
    open_to_everyone(first)
    path = str(first.socket_path)
    await run_as(alice, control, path, MsgType.CONTROL, BIND)
    ids = [f"m-{n}" for n in range(PER_USER + 76)]
    assert await run_as(mallory, bind_many, path, ids, secret_digest("m"), timeout=120) == len(ids)
    await _her_kernel_keeps_her_id(await _restarted(make_scheduler, first), alice, mallory)


async def test_r3_2_state_json_is_bounded_in_bytes_and_read_whole(
    make_scheduler: Any, users: tuple[LocalUser, LocalUser]
) -> None:
    """Before: 1,024 bindings and 200 clients of mallory's, with 249-character astral-plane
    ids, made ``state.json`` 4.4 MB, which the next scheduler read only up to 4 MiB: it kept
    nothing, alice's binding (made after all of mallory's) included. Now each user's share of
    the file is bounded, the whole under MAX_STATE_BYTES, and alice's entries are in it."""
    alice, mallory = users
    first = await make_scheduler(pool_size="4GiB", recovery_seconds=1.0, frames_per_second=0)
    open_to_everyone(first)
    path = str(first.socket_path)
    ids = [f"{LONG}{n:07d}" for n in range(PER_USER)]
    assert await run_as(mallory, bind_many, path, ids, secret_digest("m"), timeout=120) == len(ids)
    with tmp_dir(0o755) as shared:
        stop = os.path.join(shared, "stop")
        clients = [f"{LONG}c{n:06d}" for n in range(200)]
        held = spawn_as(mallory, hold_shims, path, clients, stop)
        try:
            await until(lambda: len(_mine(first, mallory)) == 200, 60)
            await run_as(alice, control, path, MsgType.CONTROL, BIND)
            await first.stop()  # it keeps its state (a second stop does nothing)
        finally:
            Path(stop).touch()
            kill(held[0])
            os.close(held[1])
    state = Path(first._private_dir) / KeptState.FILE
    size = state.stat().st_size
    assert size <= MAX_STATE_BYTES, size
    assert KERNEL in state.read_text()
    await _her_kernel_keeps_her_id(await _restarted(make_scheduler, first), alice, mallory)


async def test_r3_3_bind_kernel_never_takes_an_id_another_users_client_holds(
    make_scheduler: Any, users: tuple[LocalUser, LocalUser]
) -> None:
    """Before: mallory's ``bind_kernel`` of alice's plain program's ``pid-<pid>`` (``ps``
    shows it) closed alice's live connection, holding the grant, and took the id. Now it is
    refused while her client holds the id, and after it left (the id is hers)."""
    alice, mallory = users
    node = await make_scheduler(pool_size="4GiB")
    open_to_everyone(node)
    path = str(node.socket_path)
    program = spawn_as(alice, shim, path, {**DEVICE, "client_id": "pid-0"}, 1 << 30, 30.0)
    try:
        await until(lambda: clients_of(node).get("pid-0", {}).get("state") == "running")
        for _ in range(2):  # while it holds the id; then the same, a second time
            await _bind_refused(mallory, path, "pid-0")
            assert clients_of(node)["pid-0"]["user"] == alice.name
            assert clients_of(node)["pid-0"]["state"] == "running"
        fields = {**DEVICE, "client_id": "pid-0", "kernel_secret": "0" * 8}
        await run_as(mallory, shim, path, fields, 0, 0.2)
        assert clients_of(node)["pid-0"]["user"] == alice.name
    finally:
        kill(program[0])
        os.close(program[1])
    await until(lambda: "pid-0" not in clients_of(node))
    await _bind_refused(mallory, path, "pid-0")


async def test_r3_4_an_unbound_kernel_is_bound_by_its_own_hello(
    make_scheduler: Any, users: tuple[LocalUser, LocalUser]
) -> None:
    """A kernel started while the scheduler was away is unbound; its first HELLO gives its
    secret. Before: mallory's ``bind_kernel`` of its id (read in ``ps``) took it from the live
    kernel. Now the HELLO bound the id to that secret: mallory's bind is refused, her HELLO
    gets ``<id>#<pid>`` after the kernel left too, the provisioner's bind (the same secret) is
    accepted, and the binding outlives a restart."""
    alice, mallory = users
    first = await make_scheduler(pool_size="4GiB", recovery_seconds=1.0)
    open_to_everyone(first)
    path = str(first.socket_path)
    fields = {**DEVICE, "client_id": KERNEL, "kernel_secret": SECRET}
    await run_as(alice, shim, path, fields, 0, 0.3)
    binding = first._kernel_ids.binding(KERNEL)
    assert binding is not None and binding.user == alice.name
    await _bind_refused(mallory, path, KERNEL, secret_digest("mallory's"))
    kind, reply = await run_as(alice, control, path, MsgType.CONTROL, BIND)
    assert kind == MsgType.CONTROL_REPLY, reply
    await _her_kernel_keeps_her_id(await _restarted(make_scheduler, first), alice, mallory)


async def test_r3_5_one_users_ids_never_push_out_anothers_owners(
    make_scheduler: Any, users: tuple[LocalUser, LocalUser]
) -> None:
    """Before: one owner list of 16,384 ids for everyone; 16,500 of mallory's binds flushed
    alice's, and mallory took alice's id once alice's client had left. Now each user's owned
    ids are bounded on their own (OWNED_PER_USER)."""
    alice, mallory = users
    node = await make_scheduler(pool_size="4GiB", frames_per_second=0)
    open_to_everyone(node)
    path = str(node.socket_path)
    await run_as(alice, shim, path, {**DEVICE, "client_id": "alice-job"}, 0, 0.2)
    ids = [f"m{n}" for n in range(16_500)]
    assert len(ids) > OWNED_PER_USER
    assert await run_as(mallory, bind_many, path, ids, secret_digest("m"), timeout=300) == len(ids)
    fields = {**DEVICE, "client_id": "alice-job", "kernel_secret": "mine"}
    await run_as(mallory, shim, path, fields, 0, 0.2)
    await _bind_refused(mallory, path, "alice-job")
    squat = spawn_as(mallory, shim, path, {**DEVICE, "client_id": "alice-job"}, 0, 30.0)
    try:
        await until(lambda: len(_mine(node, mallory)) == 1)
        assert _mine(node, mallory)[0].startswith("alice-job#"), _mine(node, mallory)
    finally:
        kill(squat[0])
        os.close(squat[1])


def provision_while_away(path: str, kernel_id: str) -> dict[str, Any]:
    """Alice's server starts a kernel while the scheduler is away: its provisioner's bind
    fails, the kernel starts, and the bind is tried again in the background."""
    spec = KernelSpec(
        argv=["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        display_name="t",
        language="python",
        metadata={"kernel_provisioner": {"provisioner_name": PROVISIONER_NAME, "config": {}}},
    )

    async def main() -> dict[str, Any]:
        prov = GPUShareProvisioner(kernel_id=kernel_id, kernel_spec=spec, socket=path)
        env: dict[str, str] = {}
        t0 = time.monotonic()
        await prov._bind_kernel(env)
        started = time.monotonic() - t0  # the kernel starts then: the bind did not wait
        retry = getattr(prov, "_bind_retry", None)
        if retry is not None:
            await asyncio.wait_for(retry, 60)
        return {"secret": env[ENV_KERNEL_SECRET], "retried": retry is not None, "start": started}

    return asyncio.run(main())


async def test_r3_6_the_provisioner_binds_once_the_scheduler_is_back(
    make_scheduler: Any, users: tuple[LocalUser, LocalUser], sock_path: str
) -> None:
    """Before: a bind that found no scheduler was logged at debug and never tried again; the
    kernel stayed unbound and mallory could take its id from ``ps``. Now the provisioner
    tries again in the background (the kernel's start does not wait) until the scheduler
    answers, and the id is alice's."""
    alice, mallory = users
    os.chmod(os.path.dirname(sock_path), 0o755)
    away = spawn_as(alice, provision_while_away, sock_path, KERNEL)
    await asyncio.sleep(1.0)  # the first try and the next have found nothing
    node = await make_scheduler(pool_size="4GiB")
    open_to_everyone(node)
    await until(lambda: node._kernel_ids.binding(KERNEL) is not None, 10)
    done = await asyncio.get_running_loop().run_in_executor(None, collect, *away, 60)
    assert done["retried"] and done["start"] < 5.0, done
    binding = node._kernel_ids.binding(KERNEL)
    assert binding is not None and binding.user == alice.name, binding
    assert node._kernel_ids.proves(KERNEL, done["secret"])
    await _bind_refused(mallory, str(node.socket_path), KERNEL, secret_digest("mallory's"))
