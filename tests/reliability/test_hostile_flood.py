"""One user floods the scheduler; everyone else must not notice (issue 22, item 4; A15, A15c in
docs/reliability.md).

The attacker (a real uid of its own) opens many shim connections and writes MEMORY frames into
them as fast as the sockets take them. Before the fix each frame was a policy event that rebuilt
the whole status document for the history, and a read of 64 KiB of frames ran without a pause:
other users' status answers took seconds, a new kernel got no WELCOME and the liveness probe
(``gpushare status``) failed. Here another real user measures its status latency (p99) and the
time a new kernel waits for WELCOME while the flood runs, against a baseline of the same run.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from local_users import (
    LocalUser,
    clients_of,
    kill,
    open_to_everyone,
    run_as,
    spawn_as,
    tmp_dir,
    until,
)

from jupyter_gpushare.protocol import Message, MsgType, encode, read_message_sync

DEVICE = {"device_uuid": "GPU-flood-0", "device_total": 8 << 30}
FLOODERS = 24  # the attacker's connections, each a client of its own


@pytest.fixture(scope="module")
def users(local_users: Callable[[str], LocalUser]) -> tuple[LocalUser, LocalUser]:
    return local_users("victim"), local_users("flood")


@pytest.fixture
def open_tmp() -> Iterator[str]:
    with tmp_dir(0o777) as path:
        yield path


# -- what the other users' processes run (module level: loaded before the fork) ---------------


def flood(path: str, started: str, stop: str) -> dict[str, int]:
    """Open FLOODERS shim connections, then write MEMORY frames into all of them until ``stop``
    exists."""
    socks = []
    for i in range(FLOODERS):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10.0)
        s.connect(path)
        hello = {"pid": os.getpid(), "client_id": f"flood-{i}", **DEVICE}
        s.sendall(encode(Message(MsgType.HELLO, hello)))
        welcome = read_message_sync(s)
        assert welcome is not None and welcome.type == MsgType.WELCOME, welcome
        s.setblocking(False)
        socks.append(s)
    blob = b"".join(
        encode(Message(MsgType.MEMORY, {"used_bytes": (i + 1) << 20, "managed_bytes": i << 20}))
        for i in range(2000)
    )
    offsets = {s.fileno(): 0 for s in socks}
    by_fd = {s.fileno(): s for s in socks}
    sent = 0
    open(started, "w").close()
    while not os.path.exists(stop):
        _, writable, _ = select.select([], list(by_fd), [], 0.05)
        for fd in writable:
            try:
                n = by_fd[fd].send(blob[offsets[fd] :])
            except BlockingIOError:
                continue
            sent += n
            offsets[fd] = (offsets[fd] + n) % len(blob)  # the blob holds whole frames
    return {"sent": sent}


def status_latencies(path: str, seconds: float) -> list[float]:
    """Ask for the status again and again for ``seconds``; each answer's latency."""
    out: list[float] = []
    end = time.monotonic() + seconds
    request = encode(Message(MsgType.STATUS_REQUEST, {}))
    while time.monotonic() < end or len(out) < 20:
        t0 = time.perf_counter()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10.0)
        s.connect(path)
        s.sendall(request)
        reply = read_message_sync(s)
        out.append(time.perf_counter() - t0)
        s.close()
        assert reply is not None and reply.type == MsgType.STATUS, reply
        time.sleep(0.01)
    return out


def welcome_latency(path: str, client_id: str) -> float:
    """A new kernel's HELLO: how long until its WELCOME."""
    t0 = time.perf_counter()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10.0)
    s.connect(path)
    s.sendall(
        encode(Message(MsgType.HELLO, {"pid": os.getpid(), "client_id": client_id, **DEVICE}))
    )
    reply = read_message_sync(s)
    took = time.perf_counter() - t0
    s.close()
    assert reply is not None and reply.type == MsgType.WELCOME, reply
    return took


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def test_a_memory_flood_does_not_stall_other_users(
    make_scheduler: Any, users: tuple[LocalUser, LocalUser], open_tmp: str
) -> None:
    victim, attacker = users
    node = await make_scheduler(pool_size="4GiB", max_connections_per_uid=256)
    open_to_everyone(node)
    path = str(node.socket_path)

    base = await run_as(victim, status_latencies, path, 1.0, timeout=60)
    base_welcome = await run_as(victim, welcome_latency, path, "v-before", timeout=60)

    started, stop = os.path.join(open_tmp, "started"), os.path.join(open_tmp, "stop")
    pid, rfd = spawn_as(attacker, flood, path, started, stop)
    try:
        await until(lambda: os.path.exists(started), 60)
        during = await run_as(victim, status_latencies, path, 3.0, timeout=120)
        welcome = await run_as(victim, welcome_latency, path, "v-during", timeout=120)
        # The flooder is slowed, not dropped: its clients are all still there.
        assert sum(1 for c in clients_of(node) if c.startswith("flood-")) == FLOODERS
    finally:
        open(stop, "w").close()
        kill(pid)
        os.close(rfd)

    print(
        f"status p99 {p99(base) * 1e3:.1f} ms -> {p99(during) * 1e3:.1f} ms ({len(during)}), "
        f"welcome {base_welcome * 1e3:.1f} ms -> {welcome * 1e3:.1f} ms"
    )
    # Bounds: 100 ms (issue 22), or 5 times this machine's own baseline when it is slower.
    assert p99(during) < max(0.1, 5 * p99(base)), (p99(base), p99(during), len(during))
    assert welcome < max(0.5, 5 * base_welcome), (base_welcome, welcome)
