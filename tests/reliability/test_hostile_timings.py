"""Issue 22, item 10 (A28 in docs/reliability.md), as real separate uids: forged move timings.

The policy sizes a holder's quantum from how long moving its memory takes, at bandwidths it
learns from the shims' ``RELEASED``/``EVICTED``/``RESTORED`` reports. Before, one device-wide
estimate learnt from every client: mallory's kernel reported 1 GiB moves taking 1,000 s each, the
estimate fell to about a megabyte a second, and every holder's quantum went from 5 s to the 60 s
maximum. Now each client's reports set only its own estimate, and each reported rate is cut to
what the hardware can do (scheduler/core/costs.py: between the slowest move measured and the
bus's speed).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from local_users import (
    LocalUser,
    clients_of,
    kill,
    open_to_everyone,
    shim,
    spawn_as,
    tmp_dir,
    until,
)

from jupyter_gpushare.protocol import Message, MsgType, encode, read_message_sync
from jupyter_gpushare.scheduler.core.costs import SLOWEST_MOVE_BPS

GIB = 1 << 30
DEVICE = {"device_uuid": "GPU-timings-0", "device_total": 8 * GIB}
#: mallory's forged report: 1 GiB moved in 1,000 s (about a megabyte a second).
FORGED = {"bytes_moved": GIB, "micros": 1_000_000_000}


def _forger(path: str, rounds: int, stop: str) -> int:
    """mallory: takes turns with 1 GiB, each time saying that evicting and restoring it took
    1,000 s; then holds the GPU until ``stop`` exists. The GRANTs she got."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10.0)
    sock.connect(path)
    hello = {"pid": os.getpid(), "client_id": "forger", **DEVICE}
    sock.sendall(encode(Message(MsgType.HELLO, hello)))
    read_message_sync(sock)  # WELCOME
    mem = {"used_bytes": GIB, "managed_bytes": GIB}
    grants = 0
    for n in range(rounds + 1):
        sock.sendall(encode(Message(MsgType.REQUEST, mem)))
        reply = read_message_sync(sock)
        grants += reply is not None and reply.type == MsgType.GRANT
        if n:
            sock.sendall(encode(Message(MsgType.RESTORED, FORGED)))
        if n < rounds:
            released = {"flag": 1, "evicted_bytes": GIB, **FORGED}
            sock.sendall(encode(Message(MsgType.RELEASED, released)))
    # Frames are handled in order: once a status answers, every report above was taken.
    sock.sendall(encode(Message(MsgType.STATUS_REQUEST, {})))
    read_message_sync(sock)
    open(f"{stop}.forged", "w").close()
    while not os.path.exists(stop):
        time.sleep(0.05)
    sock.close()
    return grants


async def test_a28_forged_timings_do_not_lengthen_other_users_quanta(
    make_scheduler: Any, local_users: Any
) -> None:
    victim, attacker = local_users("victim"), local_users("attack")
    node = await make_scheduler(pool_size="4GiB", base_quantum=5.0, max_quantum=60.0)
    open_to_everyone(node)
    with tmp_dir(0o777) as tmp:
        await _attack(node, victim, attacker, os.path.join(tmp, "stop"))


async def _attack(node: Any, victim: LocalUser, attacker: LocalUser, stop: str) -> None:
    path = str(node.socket_path)
    # alice's kernel holds the GPU with 2 GiB: her quantum is the base one (5 s).
    vpid, vrfd = spawn_as(victim, shim, path, {**DEVICE, "client_id": "alice-k"}, 2 * GIB, 60.0)
    apid, arfd = -1, -1
    try:
        await until(lambda: clients_of(node).get("alice-k", {}).get("state") == "running")
        before = clients_of(node)["alice-k"]["quantum_seconds"]
        assert before == 5.0
        apid, arfd = spawn_as(attacker, _forger, path, 8, stop)
        await until(lambda: os.path.exists(f"{stop}.forged"), timeout=30.0)
        mine = clients_of(node)
        # alice's quantum did not move; mallory's own is bounded by the slowest real move.
        assert mine["alice-k"]["quantum_seconds"] == before, mine["alice-k"]
        forger = next(c for c in mine.values() if c["user"] == attacker.name)
        bound = 4 * 2 * GIB / SLOWEST_MOVE_BPS  # move_factor x (evict + restore) at the floor
        assert forger["quantum_seconds"] <= bound + 1e-6, forger
    finally:
        open(stop, "w").close()
        for pid, rfd in ((apid, arfd), (vpid, vrfd)):
            if pid > 0:
                kill(pid)
                os.close(rfd)
