"""250 connections must not blind root's ``gpushare status`` (issue 22, item 10; A15b in
docs/reliability.md), as a real separate uid.

Before the fix a status over one frame dropped every client's detail: 250 small connections
of one user, with long labels, hid the kernel holding the GPU from the operator. Now the biggest
clients stay listed, and each device gives every user's counts and sums, the biggest first.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
from local_users import (
    LocalUser,
    clients_of,
    kill,
    open_to_everyone,
    recording_shim,
    spawn_as,
    tmp_dir,
    until,
)

from jupyter_gpushare.protocol import Message, MsgType, encode, read_message_sync
from jupyter_gpushare.scheduler_client import SchedulerClient

DEVICE = {"device_uuid": "GPU-blind-0", "device_total": 8 << 30}
CROWD = 250


@pytest.fixture(scope="module")
def users(local_users: Callable[[str], LocalUser]) -> tuple[LocalUser, LocalUser]:
    return local_users("victim"), local_users("crowd")


def crowd(path: str, stop: str) -> int:
    """CROWD shim connections with 500-character labels, held until ``stop`` exists."""
    socks = []
    for i in range(CROWD):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(path)
        fields = {"pid": os.getpid(), "client_id": f"c{i}", "label": "x" * 500, **DEVICE}
        s.sendall(encode(Message(MsgType.HELLO, fields)))
        assert (read_message_sync(s) or Message(0)).type == MsgType.WELCOME
        socks.append(s)
    while not os.path.exists(stop):
        time.sleep(0.05)
    return len(socks)


async def test_a15b_a_crowd_of_connections_does_not_hide_the_holder_from_root(
    make_scheduler: Any, users: tuple[LocalUser, LocalUser]
) -> None:
    victim, attacker = users
    node = await make_scheduler(pool_size="4GiB", max_connections_per_uid=CROWD + 10)
    open_to_everyone(node)
    path = str(node.socket_path)
    with tmp_dir(0o777) as shared:
        stop = os.path.join(shared, "stop")
        fields = {**DEVICE, "client_id": "holder", "label": "train.ipynb"}
        vpid, vrfd = spawn_as(victim, recording_shim, path, fields, 2 << 30, stop)
        apid, arfd = spawn_as(attacker, crowd, path, stop)
        try:
            await until(lambda: len(clients_of(node)) == CROWD + 1, 60)
            doc = await SchedulerClient(path).status()  # root: an admin, sees everything
        finally:
            open(stop, "w").close()
            for pid, rfd in ((vpid, vrfd), (apid, arfd)):
                kill(pid)
                os.close(rfd)
    dev = doc["devices"][0]
    assert doc.get("truncated") and dev["clients"], doc.keys()
    assert dev["clients"][0]["id"] == "holder"  # the biggest first: the holder is never cut
    assert dev["clients_truncated"] == CROWD + 1 - len(dev["clients"])
    sums = {row["user"]: row for row in dev["users"]}
    assert sums[attacker.name]["clients"] == CROWD
    assert dev["users"][0]["user"] == victim.name  # the biggest user first
