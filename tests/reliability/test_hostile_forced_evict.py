"""Forced evicts a hostile holder cannot dodge, and what they say (round 3 of "A hostile local
user", docs/reliability.md), under a node scheduler run by a service account, as real uids on
the stand-in driver (the set-up of test_deep_idle_service_account.py).

Before: root's ``gpushare evict`` checkpointed the pid that said ``HELLO``; a holder that forked
a child which made the context and kept the socket was never touched. A checkpoint agent of the
holder's own user that never answered made the evict wait about 320 s. A ``revoke_signal`` the
service account may not send was logged as a "gone" pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from local_users import collect, control, kill, spawn_as
from test_deep_idle_service_account import (  # noqa: F401  (fixtures)
    DEVICE,
    MiB,
    Node,
    hog,
    hog_under_server,
    node_files,
    people,
    running_node,
    waiter,
)

from jupyter_gpushare.protocol import Message, MsgType, encode, read_message_sync
from jupyter_gpushare.scheduler.features.sleeping import (
    FORCE_EVICT_AGENT_SECONDS,
    FORCE_EVICT_SECONDS_PER_GIB,
)

OPTIONS = {
    "pool_size": "1GiB",
    "base_quantum": 0.3,
    "revoke_deadline_seconds": 1.0,
    "deep_idle_seconds": 0,  # the evict needs no deep idle
}
HELD = 768 * MiB


def forked_holder(node: Node, nbytes: int, stop: str, out: str) -> None:
    """Says HELLO and takes the grant, then forks a child that makes the context and the
    memory and keeps the socket; neither answers a revoke."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(node.socket)
    hello = {"client_id": "forked", "pid": os.getpid(), "used_bytes": nbytes, **DEVICE}
    sock.sendall(encode(Message(MsgType.HELLO, hello)))
    read_message_sync(sock)  # WELCOME
    sock.sendall(encode(Message(MsgType.REQUEST, {"used_bytes": nbytes})))
    read_message_sync(sock)  # GRANT
    child = os.fork()
    if child == 0:
        lib = ctypes.CDLL(str(node.driver))
        dev, ctx, ptr = ctypes.c_int(0), ctypes.c_void_p(0), ctypes.c_uint64(0)
        ok = lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
        ok = ok and lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
        ok = ok and lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)) == 0
        if ok:
            ctypes.memset(ptr.value, 0x5A, nbytes)
        Path(out).write_text(str(os.getpid()) if ok else "failed")
        while not os.path.exists(stop):
            time.sleep(0.05)
        os._exit(0)
    sock.settimeout(0.2)
    while not os.path.exists(stop):
        with contextlib.suppress(TimeoutError, OSError):
            read_message_sync(sock)
    os.waitpid(child, 0)


def under_silent_agent(node: Node, nbytes: int, stop: str, out: str) -> int:
    """A holder's own user runs an agent that registers and never answers."""
    child = os.fork()
    if child == 0:
        hog(node, nbytes, stop, out)
        os._exit(0)
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    agent.connect(node.socket)
    agent.sendall(encode(Message(MsgType.CONTROL, {"body": {"action": "checkpoint_agent"}})))
    read_message_sync(agent)
    while not os.path.exists(stop):
        time.sleep(0.05)
    agent.close()
    return os.waitpid(child, 0)[1]


@contextlib.contextmanager
def holding(node: Node, name: str, server: Callable[..., int], *more: Any) -> Iterator[str]:
    """Alice's ``server`` runs her holder ``name`` (768 MiB) until the test is done; yields
    where the holder writes what it reports."""
    stop, out = (str(node.root / "logs" / f"{what}-{name}") for what in ("stop", "out"))
    pid, rfd = spawn_as(node.alice, server, node, HELD, stop, out, *more)
    try:
        node.wait_log("checkpoint_agent uid=", 20)
        node.wait_log(f"grant client={name}", 20)
        yield out
    finally:
        open(stop, "w").close()
        with contextlib.suppress(Exception):
            collect(pid, rfd, 30)
        kill(pid)


def test_r3_a_forced_evict_reaches_the_child_that_holds_the_context(
    node_files: Node,  # noqa: F811 (the fixture imported above)
) -> None:
    """Before: the evict checkpointed the pid that said HELLO, which holds no context: it
    failed, and the child kept 768 MiB of the GPU while the waiter waited."""
    with (
        running_node(node_files, **OPTIONS) as node,
        holding(node, "forked", hog_under_server, forked_holder) as out,
    ):
        deadline = time.monotonic() + 20
        while not os.path.exists(out) or not Path(out).read_text():
            assert time.monotonic() < deadline, node.log_text()
            time.sleep(0.05)
        child = int(Path(out).read_text())
        assert node.device_bytes(child) >= HELD
        with contextlib.closing(waiter(node, HELD)) as sock:
            node.wait_log("revoke_overdue client=forked", 20)
            reply = node.ask("evict", "forked")
            assert reply["done"] is True and reply["checkpointed"] is True, reply
            assert str(child) in reply["effect"], reply
            grant = read_message_sync(sock)
            assert grant is not None and grant.type == MsgType.GRANT, grant
            assert node.device_bytes(child) == 0, "the child's memory is still on the device"


def test_r3_a_silent_agent_holds_a_forced_evict_for_a_bounded_time(
    node_files: Node,  # noqa: F811 (the fixture imported above)
) -> None:
    """Before: root's evict waited for the holder's own silent agent up to the lock's timeout
    plus 300 s. Now at most the lock's timeout plus FORCE_EVICT_AGENT_SECONDS and a second per
    GiB held, then it answers what it could not do (the documented fallback: the memory stays
    counted, the waiter waits)."""
    lock = 1.0
    with (
        running_node(node_files, checkpoint_lock_timeout=lock, **OPTIONS) as node,
        holding(node, "hog", under_silent_agent),
        contextlib.closing(waiter(node, HELD)),
    ):
        node.wait_log("revoke_overdue client=hog", 20)
        bound = lock + FORCE_EVICT_AGENT_SECONDS + FORCE_EVICT_SECONDS_PER_GIB * 0.75
        t0 = time.monotonic()
        body = {"action": "evict", "client": "hog"}
        kind, fields = control(node.socket, MsgType.CONTROL, body, timeout=bound + 20)
        took = time.monotonic() - t0
        assert kind == MsgType.CONTROL_REPLY, fields
        reply = fields["body"]
        assert reply["done"] is False and "no answer in" in reply["effect"], reply
        assert bound - 1.0 <= took <= bound + 10.0, (took, bound)
        print(f"the evict answered in {took:.1f} s (bound {bound:.1f} s)")
        assert "force_evict_failed client=hog" in node.log_text()


def test_r3_a_signal_the_service_account_may_not_send_says_eperm(
    node_files: Node,  # noqa: F811 (the fixture imported above)
) -> None:
    """Before: "not sending SIGTERM to client hog (pid N): pid N is gone ([Errno 1] Operation
    not permitted)" for a live process of another user. Now the line says EPERM and why."""
    options = {**OPTIONS, "revoke_signal": "SIGTERM", "revoke_signal_grace": 0.5}
    with (
        running_node(node_files, **options) as node,
        holding(node, "hog", hog_under_server),
        contextlib.closing(waiter(node, HELD)),
    ):
        log = node.wait_log("not sending SIGTERM to client hog", 20)
        (line,) = [ln for ln in log.splitlines() if "not sending SIGTERM" in ln]
        assert "EPERM" in line and "gone" not in line, line
