"""The connection limit on a uid many users share (issue 22, item 7; docs/reliability.md,
"Round two"), as a real separate uid.

On a hub's uid (``token_uids``), or every pod's uid 1000, the users prove who they are with
tokens. Before the fix the limit counted connections per uid: one user's 256 connections made
every other user's kernels run unshared and their status ``forbidden``. Now it counts per user a
token proves, and half-open connections of the uid (that proved nobody yet) never keep a user
out: the oldest of them is closed instead.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from local_users import LocalUser, collect, open_to_everyone, run_as, shim, spawn_as, tmp_dir, until

from jupyter_gpushare.identity import generate_key, load_key, user_token
from jupyter_gpushare.protocol import Message, MsgType, encode, read_message_sync

DEVICE = {"device_uuid": "GPU-shared-0", "device_total": 8 << 30}
LIMIT = 12


@pytest.fixture(scope="module")
def hub(local_users: Callable[[str], LocalUser]) -> LocalUser:
    return local_users("hub")


def hog(path: str, user: str, token: str, n: int, half: int, stop: str) -> list[int]:
    """``n`` HELLOs proving ``user``, then ``half`` connections with half a frame, held until
    ``stop`` exists; the type of each HELLO's answer."""
    socks, answers = [], []
    for i in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(path)
        fields = {"pid": os.getpid(), "client_id": f"hog-{i}", "user": user, "token": token}
        s.sendall(encode(Message(MsgType.HELLO, {**fields, **DEVICE})))
        reply = read_message_sync(s)
        answers.append(-1 if reply is None else int(reply.type))
        socks.append(s)
    for _ in range(half):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        with contextlib.suppress(OSError):  # refused at once (the limit per uid before the fix)
            s.sendall(b"GPSH\x01")
        socks.append(s)
    with open(stop + ".ready", "w"):
        pass
    while not os.path.exists(stop):
        time.sleep(0.02)
    for s in socks:
        s.close()
    return answers


async def test_one_user_of_a_shared_uid_does_not_keep_the_others_out(
    make_scheduler: Any, hub: LocalUser, tmp_path: Path
) -> None:
    key_file = str(tmp_path / "user.key")
    generate_key(key_file)
    key = load_key(key_file)
    node = await make_scheduler(
        pool_size="4GiB",
        token_uids=[str(hub.uid)],
        user_key_file=key_file,
        max_connections_per_uid=LIMIT,
        handshake_seconds=30.0,
    )
    open_to_everyone(node)
    path = str(node.socket_path)
    with tmp_dir(0o777) as shared:
        stop = os.path.join(shared, "stop")
        # Mallory, a user of the hub's uid: all the connections she may prove, one more, and
        # as many half-open ones as the whole uid may hold.
        pid, rfd = spawn_as(
            hub, hog, path, "mallory", user_token(key, "mallory"), LIMIT + 1, LIMIT, stop
        )
        try:
            await until(lambda: os.path.exists(stop + ".ready"), 60)
            # Alice, another user of the same uid: her kernel gets its WELCOME.
            alice = {**DEVICE, "client_id": "alice-k", "user": "alice"}
            alice["token"] = user_token(key, "alice")
            got = await run_as(hub, shim, path, alice, 0, 0.0)
        finally:
            open(stop, "w").close()
            answers = collect(pid, rfd, 30)  # before its directory goes
    assert got[0] is not None and got[0][0] == MsgType.WELCOME, got
    # Mallory's own limit holds: her connection past it was refused.
    assert answers == [MsgType.WELCOME] * LIMIT + [MsgType.ERROR], answers


def forged_hellos(path: str, n: int) -> int:
    """``n`` HELLOs with a made-up token; how many were refused."""
    refused = 0
    for i in range(n):
        fields = {"pid": os.getpid(), "client_id": f"f{i}", "user": "alice", "token": "00" * 32}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(encode(Message(MsgType.HELLO, {**fields, **DEVICE})))
            reply = read_message_sync(s)
            refused += reply is not None and reply.type == MsgType.ERROR
    return refused


async def test_token_refusals_do_not_flood_the_log(
    make_scheduler: Any, hub: LocalUser, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key_file = str(tmp_path / "user.key")
    generate_key(key_file)
    node = await make_scheduler(token_uids=[str(hub.uid)], user_key_file=key_file)
    open_to_everyone(node)
    assert await run_as(hub, forged_hellos, str(node.socket_path), 200) == 200
    about = [r for r in caplog.records if r.levelno >= 30 and f"uid {hub.uid}" in r.getMessage()]
    assert 1 <= len(about) <= 22, len(about)  # 20 a minute, the line saying so, then a count
